"""``chatctx plan``: size weights, KV cache and compute buffers before loading anything."""

from __future__ import annotations

import os
from typing import Any

import click
from rich.table import Table

from chatctx.cli._common import console, handle_errors, json_option, print_json, settings
from chatctx.model.memory import (
    KV_TYPE_IDS,
    MemoryPlan,
    ModelShape,
    alternatives,
    pad256,
    parse_allocations,
    parse_size,
    plan_memory,
    summary_room_for,
)
from chatctx.model.paths import resolve_model_path

MIB = 1024 * 1024


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.1f} MiB"


def physical_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gpu_total() -> int | None:
    """The first GPU's memory, through NVML when installed (the ``gpu`` extra)."""
    from chatctx.backends.device import gpu_memory

    used, free = gpu_memory()
    return None if used is None or free is None else used + free


def _flash(value: str) -> bool | None:
    return {"auto": None, "on": True, "off": False}[value]


@click.command()
@click.option("--model", "-m", "model", metavar="GGUF", default=None, help="GGUF model file.")
@click.option(
    "--n-ctx", type=int, default=None, help="One conversation's context (default CHATCTX_N_CTX)."
)
@click.option(
    "--slots",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Conversations held in the cache at once.",
)
@click.option(
    "--summary-room",
    type=click.IntRange(0),
    default=None,
    help="Cells in the unified pool for the summary sequence [default: min(n_ctx, 1792), "
    "as the engine reserves].",
)
@click.option(
    "--unified/--split",
    "unified",
    default=True,
    show_default=True,
    help="One KV pool for all sequences, or one stream per sequence.",
)
@click.option(
    "--type-k",
    type=click.Choice(list(KV_TYPE_IDS)),
    default="f16",
    show_default=True,
    help="KV cache type for keys.",
)
@click.option(
    "--type-v",
    type=click.Choice(list(KV_TYPE_IDS)),
    default="f16",
    show_default=True,
    help="KV cache type for values (quantized needs flash attention).",
)
@click.option(
    "--flash-attn",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="auto turns it on for a quantized V cache.",
)
@click.option(
    "--n-gpu-layers",
    type=int,
    default=None,
    help="Layers to offload (default: CHATCTX_N_GPU_LAYERS or all).",
)
@click.option(
    "--n-ubatch",
    type=click.IntRange(1),
    default=512,
    show_default=True,
    help="Micro-batch size (drives the compute buffers).",
)
@click.option(
    "--n-batch",
    type=click.IntRange(1),
    default=512,
    show_default=True,
    help="Most tokens per decode call.",
)
@click.option(
    "--vram",
    metavar="SIZE",
    default=None,
    help="GPU memory to fit in, e.g. 24G (default: the first GPU's, via NVML).",
)
@click.option(
    "--ram",
    metavar="SIZE",
    default=None,
    help="Host memory to fit in, e.g. 16G (default: physical memory).",
)
@click.option(
    "--rope-scaling",
    type=click.Choice(["none", "linear", "yarn"]),
    default=None,
    help="RoPE scaling you will load with (default: the model's own).",
)
@click.option("--rope-freq-scale", type=float, default=None, help="RoPE frequency scale.")
@click.option(
    "--measure",
    is_flag=True,
    help="Also load the model with these settings and report what llama.cpp allocated.",
)
@json_option
@handle_errors
def plan(
    model: str | None,
    n_ctx: int | None,
    slots: int,
    summary_room: int | None,
    unified: bool,
    type_k: str,
    type_v: str,
    flash_attn: str,
    n_gpu_layers: int | None,
    n_ubatch: int,
    n_batch: int,
    vram: str | None,
    ram: str | None,
    rope_scaling: str | None,
    rope_freq_scale: float | None,
    measure: bool,
    as_json: bool,
) -> None:
    """Size a configuration from the GGUF header alone: will it fit, and if not, what would.

    \b
    KV cells for S slots of N tokens (--n-ctx is ONE conversation's context):
      --unified (default): pad256(S*N + summary_room)   (one pool, all sequences)
      --split:             (S+1) * pad256(N)            (one stream per sequence, one spare
                                                         for summaries)
    Both make S+1 sequences (n_seq_max), one reserved for summaries.
    A cell costs n_layer x n_head_kv x (key_length + value_length) values in the cache types
    (q8_0: 34 bytes per 32 values, q4_0: 18/32, f16: 2 bytes). Weights split by
    --n-gpu-layers as llama.cpp does it (the last layers and the output go first; token
    embeddings stay on the CPU); the compute buffer is an estimate of llama.cpp's
    worst-case graph for --n-ubatch. --vram/--ram default to the first GPU (NVML) and the
    physical memory. Exit status 1 when it does not fit.
    """
    from chatctx.backends.engine import measure_allocations, supports_gpu_offload

    env = settings()
    path = resolve_model_path(model)
    shape = ModelShape.from_gguf(path)
    gpu = supports_gpu_offload()
    options: dict[str, Any] = {
        # As the engine sizes it: each conversation's context rounded up to 256 cells.
        "n_ctx": pad256(n_ctx or env.n_ctx),
        "slots": slots,
        "unified": unified,
        "summary_room": summary_room_for(n_ctx or env.n_ctx, summary_room) if unified else 0,
        "type_k": type_k,
        "type_v": type_v,
        "flash_attn": _flash(flash_attn),
        "n_gpu_layers": env.n_gpu_layers if n_gpu_layers is None else n_gpu_layers,
        "gpu": gpu,
        "n_ubatch": n_ubatch,
        "n_batch": n_batch,
        "vram": parse_size(vram) if vram else (gpu_total() if gpu else None),
        "ram": parse_size(ram) if ram else physical_ram(),
        "rope_scaling": rope_scaling,
        "rope_freq_scale": rope_freq_scale,
    }
    result = plan_memory(shape, **options)
    measured: dict[str, Any] | None = None
    if measure:
        lines = measure_allocations(
            path,
            n_ctx=result.n_ctx_param,
            n_seq_max=result.n_seq_max,
            kv_unified=unified,
            type_k=type_k,
            type_v=type_v,
            flash_attn=result.flash_attn,
            n_gpu_layers=options["n_gpu_layers"],
            n_batch=n_batch,
            n_ubatch=n_ubatch,
        )
        measured = parse_allocations(lines)
    others = [] if result.fits is not False else alternatives(shape, result, options)
    report = _report(path=str(path), shape=shape, plan=result, measured=measured, gpu=gpu)
    report["alternatives"] = [{"change": c, **_brief(p)} for c, p in others]
    if as_json:
        print_json(report)
    else:
        _print(report, result, measured, others)
    if result.fits is False:
        raise SystemExit(1)


def _brief(plan: MemoryPlan) -> dict[str, Any]:
    return {
        "kv_bytes": plan.kv_bytes,
        "gpu_bytes": plan.gpu_bytes,
        "cpu_bytes": plan.cpu_bytes,
        "fits": plan.fits,
    }


def _report(
    *, path: str, shape: ModelShape, plan: MemoryPlan, measured: dict[str, Any] | None, gpu: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": path, "gpu_offload_supported": gpu, **plan.as_dict()}
    out["measured_kv_bytes"] = measured["kv_bytes"] if measured else None
    out["measured_weights_bytes"] = measured["model_bytes"] if measured else None
    out["measured_compute_bytes"] = measured["compute_bytes"] if measured else None
    out["measured_output_bytes"] = measured["output_bytes"] if measured else None
    out["measured_offloaded_layers"] = measured["offloaded"] if measured else None
    out["measured_buffers"] = measured["buffers"] if measured else None
    out["rope"] = {"model": shape.rope, "n_ctx_train": shape.n_ctx_train}
    return out


def _print(
    report: dict[str, Any],
    plan: MemoryPlan,
    measured: dict[str, Any] | None,
    others: list[tuple[str, MemoryPlan]],
) -> None:
    console.print(
        f"{report['model']}\n{plan.slots} slot(s) x {plan.n_ctx} tokens "
        f"({'unified pool' if plan.unified else 'split streams'}) = {plan.kv_cells} KV cells, "
        f"n_seq_max {plan.n_seq_max}; K {plan.type_k}, V {plan.type_v}, flash attention "
        f"{ {None: 'auto', True: 'on', False: 'off'}[plan.flash_attn] }; "
        f"{plan.kv_bytes_per_token:,} KV bytes/token; GPU layers {plan.n_gpu_layers}"
        + ("" if report["gpu_offload_supported"] else " (this build cannot offload)")
    )
    table = Table("", "planned", "measured", "on GPU", title="memory")
    m = measured or {}
    table.add_row(
        "weights", mib(plan.weights_bytes), mib(m.get("model_bytes")), mib(plan.weights_gpu_bytes)
    )
    table.add_row("KV cache", mib(plan.kv_bytes), mib(m.get("kv_bytes")), mib(plan.kv_gpu_bytes))
    table.add_row(
        "compute (estimate)",
        mib(plan.compute_bytes),
        mib(m.get("compute_bytes")),
        mib(plan.compute_bytes if plan.n_gpu_layers else 0),
    )
    table.add_row("output", mib(plan.output_bytes), mib(m.get("output_bytes")), mib(0))
    console.print(table)
    rope = report["rope"]["model"]
    console.print(
        f"RoPE: trained context {plan.n_ctx_train}, base {rope.get('freq_base')}, scaling "
        f"{rope.get('scaling') or 'none'}"
    )
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    if measured and measured.get("offloaded") is not None:
        console.print(f"offloaded {measured['offloaded']}/{measured['offloadable']} layers")
    limits = f"CPU {mib(plan.cpu_bytes)} of {mib(plan.ram)}"
    if report["gpu_offload_supported"]:
        limits = f"GPU {mib(plan.gpu_bytes)} of {mib(plan.vram)}, {limits}"
    if plan.fits is None:
        console.print(f"needs {limits} (no limit known)")
    elif plan.fits:
        console.print(f"[green]fits[/green]: {limits}")
    else:
        console.print(f"[red]does not fit[/red]: {limits}")
        if others:
            alt = Table("change", "KV cache", "GPU", "CPU", title="what would fit")
            for change, p in others:
                alt.add_row(change, mib(p.kv_bytes), mib(p.gpu_bytes), mib(p.cpu_bytes))
            console.print(alt)
        else:
            console.print("nothing smaller in the table fits: a smaller model is needed")
