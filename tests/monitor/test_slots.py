"""The slot table file (read, write, validation) and the slot pool's Prometheus metrics.

Expected figures are worked out by hand from data/slots_v1.json.
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from chatctx.errors import StoreError
from chatctx.monitor import (
    ReservedRow,
    SlotRow,
    SlotTable,
    SwappedRow,
    default_slots_path,
    prometheus_text,
    read_slot_table,
    swap_totals,
    write_slot_table,
)
from chatctx.store import Store, Turn

SAMPLE = Path(__file__).parent / "data" / "slots_v1.json"
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


def sample() -> dict[str, Any]:
    return json.loads(SAMPLE.read_text())


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_reads_the_sample_table() -> None:
    table = read_slot_table(SAMPLE)
    assert (table.version, table.pid, table.model, table.n_ctx, table.kv_unified) == (
        1,
        4194305,
        "tiny.gguf",
        1024,
        False,
    )
    assert table.updated_at == datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
    assert table.slots == (
        SlotRow(0, 0, "c1", 300, True, datetime(2026, 12, 1, 1, 59, 30, tzinfo=UTC)),
        # written as 03:59 at +02:00
        SlotRow(1, 1, "[bold]c3[/bold]", 120, True, datetime(2026, 12, 1, 1, 59, tzinfo=UTC)),
        SlotRow(2, 2, None, 0, False, None),
        SlotRow(3, 3, "c2", 0, False, datetime(2026, 12, 1, 1, 0, tzinfo=UTC)),
    )
    assert table.reserved == (ReservedRow(4, "summary", 64),)
    assert table.swapped == (
        SwappedRow("c2", "ram", 123456, 100, datetime(2026, 12, 1, 1, 30, tzinfo=UTC)),
        SwappedRow("c4", "disk", 2097152, 1700, datetime(2026, 12, 1, 0, 15, tzinfo=UTC)),
    )
    assert table.counters["swap_in_ms"] == 9.0 and table.counters["batch_sequences"] == 20
    # 2 of 4 leased; swap-ins 2 + 1; 9.0 ms / 3; 12.5 ms / 5; 20 sequences and 200 tokens
    # over 8 steps.
    assert (table.leased, table.swap_ins) == (2, 3)
    assert table.mean_swap_in_ms == 3.0
    assert table.mean_swap_out_ms == 2.5
    assert table.mean_batch_sequences == 2.5
    assert table.mean_batch_tokens == 25.0
    # pid_max is at most 2**22 on Linux: this pid cannot be running.
    assert table.writer_running() is False


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    data = sample()
    data["pid"] = os.getpid()
    data["updated_at"] = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)  # a datetime is accepted too
    path = tmp_path / "run" / "slots.json"  # the directory is created
    written = write_slot_table(path, data)
    read = read_slot_table(path)
    assert read == written
    assert read.writer_running() is True
    assert read.updated_at == datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
    assert json.loads(path.read_text())["updated_at"] == "2026-12-01T02:00:00+00:00"
    # as_dict is the file schema again: writing it gives the same table.
    assert write_slot_table(path, read.as_dict()) == read
    assert write_slot_table(path, read) == read
    assert os.listdir(path.parent) == ["slots.json"]  # no temporary file left behind


def test_default_path_is_in_chatctx_home(tmp_path: Path) -> None:
    # conftest points CHATCTX_HOME at tmp_path / "home"
    assert default_slots_path() == tmp_path / "home" / "slots.json"
    write_slot_table(None, sample())
    assert read_slot_table().n_ctx == 1024


def test_counters_missing_from_a_table_read_as_zero() -> None:
    data = sample()
    data["counters"] = {"swap_out": 2, "future_counter": 7}
    table = SlotTable.from_dict(data)
    assert table.counters["swap_out"] == 2 and table.counters["batch_steps"] == 0
    assert table.counters["future_counter"] == 7
    assert table.mean_batch_sequences is None and table.mean_swap_in_ms is None


def test_the_file_is_replaced_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "slots.json"
    write_slot_table(path, sample())
    before = path.read_bytes()
    seen: list[tuple[bytes, dict[str, Any]]] = []
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        # At the rename, readers still see the old file and the new one is complete.
        seen.append((Path(dst).read_bytes(), json.loads(Path(src).read_text())))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    data = sample()
    data["n_ctx"] = 2048
    write_slot_table(path, data)
    assert seen[0][0] == before and seen[0][1]["n_ctx"] == 2048
    assert read_slot_table(path).n_ctx == 2048


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "slots.json"
    write_slot_table(path, sample())
    before = path.read_bytes()

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(StoreError, match=r"cannot write slot table .*No space left on device"):
        write_slot_table(path, sample())
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["slots.json"]


def test_a_malformed_table_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "slots.json"
    write_slot_table(path, sample())
    before = path.read_bytes()
    data = sample()
    data["slots"][2]["cells"] = -1
    with pytest.raises(StoreError, match=r"slots\[2\]\.cells: expected a non-negative integer"):
        write_slot_table(path, data)
    data = sample()
    data["counters"]["swap_in_ms"] = float("nan")
    with pytest.raises(StoreError, match="cannot encode the slot table"):
        write_slot_table(path, data)
    assert path.read_bytes() == before


def edit(change: Any) -> dict[str, Any]:
    data = sample()
    change(data)
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (edit(lambda d: d.update(version=2)), "version: slot table version 2 is not one"),
        (edit(lambda d: d.pop("version")), "version: slot table version None is not one"),
        ([1, 2], "top level: expected an object, got list"),
        (edit(lambda d: d.pop("pid")), "top level: missing 'pid'"),
        (edit(lambda d: d.update(n_ctx="1024")), "n_ctx: expected a non-negative integer"),
        (edit(lambda d: d["slots"][0].update(leased=1)), r"slots\[0\]\.leased: expected true"),
        (edit(lambda d: d["slots"][1].update(cells=True)), r"slots\[1\]\.cells: expected a non"),
        (edit(lambda d: d["slots"][3].update(slot=0)), "slots: slot 0 appears twice"),
        (
            edit(lambda d: d["reserved"][0].update(seq_id=2)),
            "slots and reserved: seq_id 2 appears twice",
        ),
        (
            edit(lambda d: d["swapped"][0].update(where="gpu")),
            r"swapped\[0\]\.where: expected 'ram' or 'disk', got 'gpu'",
        ),
        (
            edit(lambda d: d["swapped"][1].update(conversation="c2")),
            "swapped: conversation 'c2' appears twice",
        ),
        (
            edit(lambda d: d.update(updated_at="2026-12-01T02:00:00")),
            "updated_at: expected an ISO-8601 time with a UTC offset",
        ),
        (
            edit(lambda d: d["slots"][0].update(last_use="yesterday")),
            r"slots\[0\]\.last_use: expected an ISO-8601 time",
        ),
        (
            edit(lambda d: d["counters"].update(swap_in_ram=1.5)),
            "counters.swap_in_ram: expected a non-negative integer, got 1.5",
        ),
        (
            edit(lambda d: d["counters"].update(swap_out_ms="fast")),
            "counters.swap_out_ms: expected a non-negative number",
        ),
        (edit(lambda d: d.update(reserved={})), "reserved: expected a list, got dict"),
        (edit(lambda d: d["swapped"].append(None)), r"swapped\[2\]: expected an object, got null"),
    ],
)
def test_malformed_tables_are_refused_with_the_field(
    tmp_path: Path, data: Any, message: str
) -> None:
    path = tmp_path / "slots.json"
    path.write_text(json.dumps(data))
    with pytest.raises(StoreError, match=f"^{re.escape(str(path))}: {message}"):
        read_slot_table(path)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not a JSON slot table"),
        (b'{"version": 1, "pid": 1', "not a JSON slot table"),
        (b"\xff\xfe{}", "not a JSON slot table"),
        (b'{"version": 1, "pid": NaN}', "not a JSON slot table .*NaN"),
        (b"[" * 100_000 + b"]" * 100_000, "not a JSON slot table"),
    ],
)
def test_unreadable_files_are_clear_errors(tmp_path: Path, raw: bytes, message: str) -> None:
    path = tmp_path / "slots.json"
    path.write_bytes(raw)
    with pytest.raises(StoreError, match=message):
        read_slot_table(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "none" / "slots.json"
    with pytest.raises(
        StoreError, match=f"^no engine has written a slot table at {re.escape(str(missing))}$"
    ):
        read_slot_table(missing)
    with pytest.raises(StoreError, match="cannot read slot table"):
        read_slot_table(tmp_path)


def make_turns(db_url: str) -> dict[str, list[Turn]]:
    with Store(db_url) as store:
        for cid in ("c1", "c2"):
            store.create_conversation(cid)
        store.add_turn("c1", slot=0, swap_in="ram", swap_in_ms=4.0, swap_in_bytes=1000, **TURN)
        store.add_turn("c1", slot=0, swap_in="disk", swap_in_ms=10.0, swap_in_bytes=5000, **TURN)
        store.add_turn("c1", slot=1, reprefill_reason=REASON, **TURN)
        store.add_turn("c1", slot=1, batch_max=3, **TURN)
        store.add_turn("c2", slot=2, swap_in="ram", swap_in_bytes=2000, batch_max=2, **TURN)
        store.add_turn("c2", slot=2, reprefill_reason=REASON, **TURN)
        store.add_turn("c2", slot=3, reprefill_reason="state file missing [x]", **TURN)
        return {cid: store.turns(cid) for cid in ("c1", "c2")}


def test_swap_totals_over_stored_turns(db_url: str) -> None:
    turns = make_turns(db_url)
    every = swap_totals(turns["c1"] + turns["c2"])
    # ram: c1#1, c2#1; disk: c1#2; timed swap-ins 4.0 and 10.0 ms (c2's is untimed).
    assert (every.turns, every.swap_in_ram, every.swap_in_disk) == (7, 2, 1)
    assert every.swap_in_bytes == 8000 and every.swap_in_ms_mean == 7.0
    assert every.reprefills == 3
    assert every.reprefill_reasons == {REASON: 2, "state file missing [x]": 1}
    assert list(every.reprefill_reasons) == [REASON, "state file missing [x]"]
    assert every.batch_max == 3
    none = swap_totals([])
    assert (none.turns, none.swap_in_ms_mean, none.batch_max, none.reprefill_reasons) == (
        0,
        None,
        None,
        {},
    )


def metric_lines(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = value
    return out


def test_prometheus_slot_pool_metrics(db_url: str) -> None:
    table = read_slot_table(SAMPLE)
    text = prometheus_text(make_turns(db_url), slot_table=table)
    values = metric_lines(text)
    expected = {
        "chatctx_pool_slots": "4",
        "chatctx_pool_slots_leased": "2",
        'chatctx_pool_slot_cells{slot="0",seq="0"}': "300",
        'chatctx_pool_slot_cells{slot="1",seq="1"}': "120",
        'chatctx_pool_slot_cells{slot="3",seq="3"}': "0",
        'chatctx_pool_slot_leased{slot="1",seq="1"}': "1",
        'chatctx_pool_slot_leased{slot="2",seq="2"}': "0",
        'chatctx_pool_reserved_cells{seq="4",role="summary"}': "64",
        'chatctx_swap_stored_bytes{where="ram"}': "123456",
        'chatctx_swap_stored_bytes{where="disk"}': "2097152",
        'chatctx_swap_stored_conversations{where="ram"}': "1",
        'chatctx_swap_stored_conversations{where="disk"}': "1",
        'chatctx_swap_in_total{where="ram"}': "2",
        'chatctx_swap_in_total{where="disk"}': "1",
        "chatctx_swap_in_bytes_total": "370368",
        "chatctx_swap_in_seconds_total": "0.009",
        "chatctx_swap_out_total": "5",
        "chatctx_swap_out_bytes_total": "2469120",
        "chatctx_swap_out_seconds_total": "0.0125",
        "chatctx_reprefill_total": "1",
        "chatctx_swap_spill_to_disk_total": "1",
        "chatctx_swap_disk_dropped_total": "0",
        "chatctx_batch_steps_total": "8",
        "chatctx_batch_tokens_total": "200",
        "chatctx_batch_sequences_total": "20",
        "chatctx_batch_max_sequences": "3",
        # 2026-12-01 is day 20788 after 1970-01-01: 20788 * 86400 + 2 * 3600
        "chatctx_slot_table_updated_seconds": "1796090400.000",
        # from the stored turns
        'chatctx_swap_in_turns_total{conversation="c1",where="ram"}': "1",
        'chatctx_swap_in_turns_total{conversation="c1",where="disk"}': "1",
        'chatctx_swap_in_turns_total{conversation="c2",where="ram"}': "1",
        'chatctx_swap_in_turns_total{conversation="c2",where="disk"}': "0",
        'chatctx_reprefill_turns_total{conversation="c1"}': "1",
        'chatctx_reprefill_turns_total{conversation="c2"}': "2",
    }
    assert {name: values.get(name) for name in expected} == expected
    assert "# TYPE chatctx_swap_in_total counter" in text
    assert "# TYPE chatctx_pool_slot_cells gauge" in text
    # Each metric family is declared once.
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    # Without a slot table, only the turns' swap figures appear.
    plain = prometheus_text(make_turns_again(db_url))
    assert "chatctx_pool_slots" not in plain and "chatctx_swap_in_turns_total" in plain


def make_turns_again(db_url: str) -> dict[str, list[Turn]]:
    with Store(db_url) as store:
        return {cid: store.turns(cid) for cid in ("c1", "c2")}
