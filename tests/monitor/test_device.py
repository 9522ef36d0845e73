"""Device memory figures: RSS against the kernel's own report, NVML absent or present."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from click.testing import CliRunner

from chatctx.cli import cli
from chatctx.monitor import memory_snapshot, prometheus_text, rss_bytes
from chatctx.store import Store

MIB = 2**20


def vm_rss() -> int:
    """VmRSS from /proc/self/status: the kernel's figure, read another way."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_rss_matches_the_kernel_and_tracks_an_allocation() -> None:
    before = rss_bytes()
    assert abs(before - vm_rss()) < 16 * MIB
    block = bytearray(b"\x01") * (256 * MIB)  # written, so every page is resident
    after = rss_bytes()
    assert after - before >= 240 * MIB
    assert abs(after - vm_rss()) < 16 * MIB
    del block


def test_snapshot_without_a_gpu_has_no_gpu_figures() -> None:
    snap = memory_snapshot()
    assert snap.rss_bytes > 0
    no_driver = not Path("/dev/nvidiactl").exists()
    if no_driver or importlib.util.find_spec("pynvml") is None:
        assert snap.gpu_used_bytes is None and snap.gpu_free_bytes is None
    else:  # a real GPU: NVML's used + free is the card's memory
        assert snap.gpu_used_bytes is not None and snap.gpu_free_bytes is not None
        assert snap.gpu_used_bytes + snap.gpu_free_bytes > 0


def _turn(store: Store, cid: str, rss: int | None, gpu: tuple[int, int] | None) -> None:
    store.add_turn(
        cid,
        seq_id=0,
        n_ctx=512,
        prompt_tokens=10,
        reused_tokens=0,
        evaluated_tokens=10,
        generated_tokens=2,
        prefill_ms=1.0,
        ttft_ms=1.5,
        decode_tokens_per_s=10.0,
        total_ms=2.0,
        stop_reason="eog",
        plan=None,
        rss_bytes=rss,
        gpu_used_bytes=gpu[0] if gpu else None,
        gpu_free_bytes=gpu[1] if gpu else None,
    )


def test_memory_gauges_and_stats(db_url: str) -> None:
    snap = memory_snapshot()
    with Store(db_url) as store:
        store.create_conversation("a")
        store.create_conversation("b")
        _turn(store, "a", snap.rss_bytes - 1000, None)
        _turn(store, "a", snap.rss_bytes, None)
        _turn(store, "b", 300 * MIB, (5 * MIB, 7 * MIB))
        turns = {cid: store.turns(cid) for cid in ("a", "b")}
    text = prometheus_text(turns, live_memory=snap)
    assert "# TYPE chatctx_rss_bytes gauge" in text
    assert f'chatctx_rss_bytes{{conversation="a"}} {snap.rss_bytes}' in text
    assert f'chatctx_gpu_used_bytes{{conversation="b"}} {5 * MIB}' in text
    assert f'chatctx_gpu_free_bytes{{conversation="b"}} {7 * MIB}' in text
    assert 'chatctx_gpu_used_bytes{conversation="a"}' not in text  # not measured: no sample
    assert f"chatctx_live_rss_bytes {snap.rss_bytes}" in text

    result = CliRunner().invoke(cli, ["stats", "a", "--db", db_url, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["memory"]["peak_rss_bytes"] == snap.rss_bytes
    assert data["memory"]["last_gpu_used_bytes"] is None
    assert [t["rss_bytes"] for t in data["turns"]] == [snap.rss_bytes - 1000, snap.rss_bytes]

    result = CliRunner().invoke(cli, ["stats", "b", "--db", db_url])
    assert result.exit_code == 0, result.output
    assert "RSS MiB" in result.output and "GPU used/free MiB" in result.output
    assert "peak RSS 300 MiB" in result.output and "GPU used 5 MiB, free 7 MiB" in result.output
