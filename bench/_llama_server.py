"""Helpers shared by the llama-server benchmarks: start a server, post to it, read its counters.

Kept apart from ``chatctx.backends.llama_server`` so that the raw-HTTP baselines (what a client of
llama-server does without chatctx) depend on nothing but httpx and the binary.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# Re-exported for the benchmarks: the project's own rounding and rendezvous score, and
# kv_bench's naive trimming, so every baseline uses exactly what it is compared with.
from kv_bench import trim_last as trim_last

from chatctx.backends.router import _score
from chatctx.model.memory import pad256 as pad256

score = _score

DEFAULT_BINARY = Path.home() / ".cache/chatctx/llama-server/0442baf7f942c15c/bin/llama-server"


def find_binary(given: str | None) -> str:
    """``--server``, else ``CHATCTX_LLAMA_SERVER``, else the cached build, else PATH."""
    for candidate in (given, os.environ.get("CHATCTX_LLAMA_SERVER"), str(DEFAULT_BINARY)):
        if candidate and Path(candidate).is_file():
            return candidate
    found = shutil.which("llama-server")
    if found is None:
        raise SystemExit("no llama-server: pass --server BIN or set CHATCTX_LLAMA_SERVER")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    command: list[str]
    n_ctx: int  # per slot
    slots: int


@contextlib.contextmanager
def llama_server(
    binary: str,
    model: Path,
    *,
    slots: int,
    n_ctx: int,
    threads: int,
    extra: Sequence[str] = (),
    log: Path | None = None,
) -> Iterator[Server]:
    """A llama-server with ``slots`` slots of ``n_ctx`` tokens each (``-c slots * n_ctx``)."""
    port = free_port()
    command = [
        binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(slots * n_ctx), "-t", str(threads),
        "--metrics", "--no-webui", *extra,
    ]  # fmt: skip
    sink = log.open("wb") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(command)}")
            time.sleep(0.2)
        props = httpx.get(f"{url}/props", timeout=10).json()
        served = props["default_generation_settings"]["n_ctx"]
        if served != n_ctx or props["total_slots"] != slots:
            raise RuntimeError(f"asked {slots} x {n_ctx}, got {props['total_slots']} x {served}")
        yield Server(url, proc.pid, command, n_ctx, slots)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None and hasattr(sink, "close"):
            sink.close()


def completion(http: httpx.Client, body: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
    """POST /completion; (response, wall ms)."""
    started = time.perf_counter()
    r = http.post("/completion", json=dict(body))
    wall = (time.perf_counter() - started) * 1000
    if r.status_code != 200:
        raise RuntimeError(f"/completion {r.status_code}: {r.text[:300]}")
    out: dict[str, Any] = r.json()
    return out, wall


def metric(url: str, name: str) -> float:
    """One counter from ``/metrics`` (``llamacpp:prompt_tokens_total``: tokens evaluated)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"{url}/metrics has no {name}")


def prompt_tokens_total(urls: Sequence[str]) -> int:
    return int(sum(metric(u, "llamacpp:prompt_tokens_total") for u in urls))
