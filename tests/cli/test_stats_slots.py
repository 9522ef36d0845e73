"""``chatctx stats --slots``: the slot table and the stored turns' swap figures.

Every expected number is worked out by hand from tests/monitor/data/slots_v1.json and the
turns written here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from chatctx.backends.engine import Engine
from chatctx.cli import cli
from chatctx.store import Store

SAMPLE = Path(__file__).parents[1] / "monitor" / "data" / "slots_v1.json"
REASON = "fingerprint mismatch: n_ctx 1024 != 2048"
TURN = {
    "n_ctx": 1024,
    "prompt_tokens": 40,
    "reused_tokens": 0,
    "evaluated_tokens": 40,
    "generated_tokens": 5,
    "prefill_ms": 12.5,
    "total_ms": 30.0,
    "stop_reason": "stop",
}


@pytest.fixture
def db(db_url: str) -> str:
    with Store(db_url) as store:
        for cid in ("c1", "c2"):
            store.create_conversation(cid)
        store.add_turn("c1", slot=0, swap_in="ram", swap_in_ms=4.0, swap_in_bytes=1000, **TURN)
        store.add_turn("c1", slot=0, swap_in="disk", swap_in_ms=10.0, swap_in_bytes=5000, **TURN)
        store.add_turn("c1", slot=1, reprefill_reason=REASON, **TURN)
        store.add_turn("c2", slot=2, swap_in="ram", swap_in_ms=1.0, batch_max=2, **TURN)
        store.add_turn("c2", slot=2, reprefill_reason=REASON, **TURN)
        store.add_turn("c2", slot=3, reprefill_reason="state [red]gone[/red]", **TURN)
        store.add_turn("c2", batch_max=3, **TURN)
    return db_url


def cells(output: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is ``first``."""
    for line in output.splitlines():
        parts = [p.strip() for p in line.strip("│ ").split("│")]
        if parts[0] == first and len(parts) > 1:
            return parts
    raise AssertionError(f"no row {first!r} in:\n{output}")


def test_slots_text(db: str) -> None:
    result = CliRunner().invoke(cli, ["stats", "--slots-file", str(SAMPLE), "--db", db])
    assert result.exit_code == 0, result.output
    out = result.output
    lines = out.splitlines()
    assert lines[0] == (
        f"slot table {SAMPLE} · model tiny.gguf · n_ctx 1024 · unified KV no · pid 4194305 · "
        "updated 2026-12-01 02:00:00 UTC"
    )
    assert lines[1] == "process 4194305 is not running: the table shows the pool as it was left"
    assert cells(out, "0") == ["0", "0", "c1", "300", "yes", "2026-12-01 01:59:30"]
    # markup in a conversation id is printed as written; +02:00 shown in UTC
    assert cells(out, "1") == ["1", "1", "[bold]c3[/bold]", "120", "yes", "2026-12-01 01:59:00"]
    assert cells(out, "2") == ["2", "2", "-", "0", "no", "-"]
    assert "2 of 4 slots leased · 420 cells in slots" in lines
    assert cells(out, "4") == ["4", "summary", "64"]
    # 123456 B = 120.5625 KiB; 2097152 B = 2 MiB
    assert cells(out, "c2") == ["c2", "RAM", "120.6 KiB", "100", "2026-12-01 01:30:00"]
    assert cells(out, "c4") == ["c4", "disk", "2.0 MiB", "1700", "2026-12-01 00:15:00"]
    # 370368 B = 361.6875 KiB, 9.0 ms / 3 swap-ins; 2469120 B = 2.35 MiB, 12.5 ms / 5
    assert "swap-ins 3 (RAM 2, disk 1) · 361.7 KiB · 3.00 ms per swap-in" in lines
    assert "swap-outs 5 · 2.4 MiB · 2.50 ms per swap-out" in lines
    assert (
        "held now: RAM 120.6 KiB, disk 2.0 MiB · spilled to disk 1 · dropped from disk 0 · "
        "re-prefills 1"
    ) in lines
    # 200 tokens / 8 steps; 20 sequences / 8 steps
    assert (
        "batching: 8 steps · 200 tokens (25.0 per step) · sequences per step: mean 2.50, max 3"
    ) in lines
    # turns: RAM c1#1 and c2#1, disk c1#2; (4.0 + 10.0 + 1.0) / 3 = 5.00 ms
    assert (
        "stored turns (all conversations): 7 · from a swap-in 3 (RAM 2, disk 1), mean swap-in "
        "5.00 ms · re-prefilled 3"
    ) in lines
    assert cells(out, REASON) == [REASON, "2"]
    assert cells(out, "state [red]gone[/red]") == ["state [red]gone[/red]", "1"]


def test_slots_for_one_conversation(db: str) -> None:
    args = ["stats", "c1", "--slots-file", str(SAMPLE), "--db", db]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert (
        "stored turns (conversation c1): 3 · from a swap-in 2 (RAM 1, disk 1), mean swap-in "
        "7.00 ms · re-prefilled 1"
    ) in result.output.splitlines()
    missing = CliRunner().invoke(cli, ["stats", "nope", "--slots-file", str(SAMPLE), "--db", db])
    assert missing.exit_code == 1 and "no conversation with id 'nope'" in missing.output


def test_slots_json(db: str) -> None:
    args = ["stats", "--slots-file", str(SAMPLE), "--db", db, "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["slots_file"] == str(SAMPLE) and report["writer_running"] is False
    assert report["table"] == json.loads(SAMPLE.read_text()) | {
        # times come back in UTC
        "slots": [
            row | {"last_use": "2026-12-01T01:59:00+00:00"} if row["slot"] == 1 else row
            for row in json.loads(SAMPLE.read_text())["slots"]
        ]
    }
    assert report["derived"] == {
        "slots": 4,
        "leased": 2,
        "cells": 420,
        "swap_in": 3,
        "mean_swap_in_ms": 3.0,
        "mean_swap_out_ms": 2.5,
        "mean_batch_sequences": 2.5,
        "mean_batch_tokens": 25.0,
        "max_batch_sequences": 3,
    }
    assert report["turns"] == {
        "turns": 7,
        "swap_in_ram": 2,
        "swap_in_disk": 1,
        "swap_in_bytes": 6000,
        "swap_in_ms_mean": 5.0,
        "reprefills": 3,
        "reprefill_reasons": {REASON: 2, "state [red]gone[/red]": 1},
        "batch_max": 3,
    }


def test_stats_slots_reads_every_live_engine_under_the_home(
    db: str, tmp_path: Path, tiny_llama3_path: Path
) -> None:
    runner = CliRunner()
    home = tmp_path / "home"  # conftest's CHATCTX_HOME
    result = runner.invoke(cli, ["stats", "--slots", "--db", db])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: no running engine has written a slot table under {home / 'engines'} "
        f"(nor is there {home / 'slots.json'})\n"
    )
    # Two engines in this process stand for two bot processes sharing the home: each keeps
    # its own table (the last writer used to overwrite the other's).
    with (
        Engine.load(tiny_llama3_path, n_ctx=256, slots=1) as one,
        Engine.load(tiny_llama3_path, n_ctx=256, slots=2) as two,
    ):
        one.release(one.lease("a"))
        two.release(two.lease("b"))
        one.write_slot_table()
        two.write_slot_table()
        found = runner.invoke(cli, ["stats", "--slots", "--db", db, "--json"])
        assert found.exit_code == 0, found.output
        engines = json.loads(found.output)["engines"]
        assert sorted(len(e["table"]["slots"]) for e in engines) == [1, 2]
        assert {e["table"]["slots"][0]["conversation"] for e in engines} == {"a", "b"}
        assert all(Path(e["slots_file"]).parent.parent == home / "engines" for e in engines)
        prometheus = runner.invoke(cli, ["stats", "--prometheus", "--slots", "--db", db])
        assert prometheus.exit_code == 0, prometheus.output
        assert prometheus.output.count("# TYPE chatctx_pool_slots gauge") == 1
        pid = os.getpid()
        assert prometheus.output.count(f'chatctx_pool_slots{{engine="{pid}"}}') == 2
    # Both closed: no live engine is left to show.
    gone = runner.invoke(cli, ["stats", "--slots", "--db", db])
    assert gone.exit_code == 1 and "no running engine" in gone.output


def test_bad_slot_files_exit_1_without_a_traceback(db: str, tmp_path: Path) -> None:
    path = tmp_path / "slots.json"
    runner = CliRunner()
    for content, message in [
        ("{not json", "not a JSON slot table"),
        (json.dumps({"version": 7}), "version: slot table version 7 is not one this chatctx"),
    ]:
        path.write_text(content)
        result = runner.invoke(cli, ["stats", "--slots-file", str(path), "--db", db])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert result.output.startswith(f"Error: {path}: ") and message in result.output
        assert "Traceback" not in result.output


def test_prometheus_with_slots(db: str) -> None:
    args = ["stats", "--prometheus", "--slots-file", str(SAMPLE), "--db", db]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for line in [
        "chatctx_pool_slots_leased 2",
        'chatctx_pool_slot_cells{slot="0",seq="0"} 300',
        'chatctx_swap_in_total{where="disk"} 1',
        "chatctx_batch_steps_total 8",
        "chatctx_batch_tokens_total 200",
        'chatctx_swap_in_turns_total{conversation="c1",where="ram"} 1',
        'chatctx_swap_in_turns_total{conversation="c2",where="ram"} 1',
        'chatctx_reprefill_turns_total{conversation="c2"} 2',
    ]:
        assert line in lines
    # Without --slots the exposition has no pool metrics and needs no slot table.
    plain = CliRunner().invoke(cli, ["stats", "--prometheus", "--db", db])
    assert plain.exit_code == 0 and "chatctx_pool_slots" not in plain.output
