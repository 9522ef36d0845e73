"""``chatctx plan``: size weights, KV cache and compute buffers before loading anything."""

from __future__ import annotations

import os
from typing import Any

import click
from rich.table import Table

from chatctx.cli._common import console, handle_errors, json_option, print_json, settings
from chatctx.cli._options import FLASH_CHOICE, field_option
from chatctx.model.memory import (
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
from chatctx.settings import EngineConfig

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


def _flash(value: str | None) -> bool | None:
    return {None: None, "auto": None, "on": True, "off": False}[value]


@click.command()
@click.option("--model", "-m", "model", metavar="GGUF", default=None, help="GGUF model file.")
@field_option(EngineConfig, "n_ctx", default=None, help_after="Default: CHATCTX_N_CTX.")
@field_option(EngineConfig, "slots")
@field_option(EngineConfig, "summary_room", help_after="As the engine reserves.")
@field_option(EngineConfig, "kv_unified", "--unified/--split", "unified")
@field_option(EngineConfig, "type_k")
@field_option(EngineConfig, "type_v")
@field_option(EngineConfig, "flash_attn", type=FLASH_CHOICE)
@field_option(
    EngineConfig, "n_gpu_layers", default=None, help_after="Default: CHATCTX_N_GPU_LAYERS."
)
@field_option(EngineConfig, "n_ubatch", help_after="Drives the compute buffers.")
@field_option(EngineConfig, "n_batch")
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
@field_option(EngineConfig, "rope_scaling")
@field_option(EngineConfig, "rope_freq_scale")
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
    flash_attn: str | None,
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
