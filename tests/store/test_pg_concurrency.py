"""Many writer processes on one PostgreSQL database (and SQLite where noted): no lost or
failed writes.

Oracles: the rows read back with plain SQL (not through the store), counted and compared with
what each worker reports it committed; each worker's exit status and the errors it printed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from chatctx.errors import ContextStateConflict, StoreError
from chatctx.store import Store, create_db_engine, export_jsonl

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 8
APPENDS = 50
TURN = {
    "n_ctx": 512,
    "prompt_tokens": 10,
    "reused_tokens": 0,
    "evaluated_tokens": 10,
    "generated_tokens": 1,
    "prefill_ms": 1.0,
    "total_ms": 2.0,
    "stop_reason": "eog",
}
SPAWN = multiprocessing.get_context("forkserver")
SPAWN.set_forkserver_preload([__name__])


def _rows(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = create_db_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def _join(processes: Sequence[multiprocessing.process.BaseProcess]) -> list[int | None]:
    for process in processes:
        process.join(timeout=240)
    return [process.exitcode for process in processes]


def _run_all(target: Any, args: Sequence[tuple[Any, ...]]) -> list[int | None]:
    processes = [SPAWN.Process(target=target, args=a) for a in args]
    for process in processes:
        process.start()
    return _join(processes)


# workers (module level: the forkserver imports this module) ---------------------------------


def _append(url: str, cid: str, worker: int, barrier: Barrier) -> None:
    with Store(url) as store:
        barrier.wait()
        for index in range(APPENDS):
            store.add_message(cid, "user", f"{worker}:{index}")


def _open_and_send(url: str, worker: int, barrier: Barrier, errors: Path) -> None:
    try:
        with Store(url) as store:
            barrier.wait()
            store.get_or_create_conversation("fresh", system_prompt="shared")
            for index in range(10):
                store.add_message("fresh", "user", f"{worker}:{index}")
    except BaseException as exc:
        (errors / f"{worker}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise


def _create(url: str, worker: int, barrier: Barrier, results: Path) -> None:
    with Store(url) as store:
        barrier.wait()
        try:
            store.create_conversation("same")
            outcome = "created"
        except StoreError as exc:
            outcome = str(exc)
        (results / f"{worker}.txt").write_text(outcome)


def _token_counts(url: str, worker: int, barrier: Barrier, ids: list[int]) -> None:
    with Store(url) as store:
        barrier.wait()
        for round_ in range(20):
            store.put_token_counts("tok", {i: 1000 * round_ + i for i in ids})


def _context_state(url: str, worker: int, barrier: Barrier, saves: int) -> None:
    # Read-modify-write: each save adds this worker's next number to pending_ids.
    with Store(url) as store:
        barrier.wait()
        for index in range(saves):
            while True:
                state = store.context_state("c")
                try:
                    store.save_context_state(
                        "c",
                        window_start=0,
                        pending_ids=[*state.pending_ids, worker * 1000 + index],
                        expected_version=state.version,
                    )
                    break
                except ContextStateConflict:
                    time.sleep(random.uniform(0, 0.005))


def _turns(url: str, cid: str, barrier: Barrier, turns: int) -> None:
    with Store(url) as store:
        store.create_conversation(cid)
        barrier.wait()
        for index in range(turns):
            user = store.add_message(cid, "user", f"{cid} question {index}")
            store.record_reply(
                cid,
                {"role": "assistant", "content": f"{cid} answer {index}"},
                user_message_id=user.id,
                **TURN,
            )


def _upgrade_loop(url: str, barrier: Barrier, rounds: int) -> None:
    barrier.wait()
    for _ in range(rounds):
        subprocess.run(
            [sys.executable, "-m", "chatctx", "db", "upgrade", "--db", url],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )


def _export_loop(url: str, barrier: Barrier, out: Path, rounds: int) -> None:
    # Each export must be a consistent snapshot per conversation: positions without gaps,
    # every question followed by its answer except perhaps the last one.
    with Store(url) as store:
        barrier.wait()
        for _ in range(rounds):
            for conversation in store.list_conversations():
                messages = store.messages(conversation.id)
                positions = [m.position for m in messages]
                if positions != list(range(len(positions))):
                    raise SystemExit(f"export saw positions {positions}")
        with out.open("w") as handle:
            export_jsonl(store, [c.id for c in store.list_conversations()], handle)


# tests --------------------------------------------------------------------------------------


def test_eight_processes_append_to_one_conversation(pg_url: str) -> None:
    with Store(pg_url) as store:
        store.create_conversation("shared")
    barrier = SPAWN.Barrier(WORKERS)
    codes = _run_all(_append, [(pg_url, "shared", w, barrier) for w in range(WORKERS)])
    assert codes == [0] * WORKERS
    rows = _rows(pg_url, "SELECT position, content FROM messages ORDER BY position")
    assert [p for p, _ in rows] == list(range(WORKERS * APPENDS))
    payloads = [tuple(map(int, c.split(":"))) for _, c in rows]
    assert set(payloads) == {(w, i) for w in range(WORKERS) for i in range(APPENDS)}
    for worker in range(WORKERS):
        assert [i for w, i in payloads if w == worker] == list(range(APPENDS))


def test_eight_processes_open_the_same_new_conversation(db_url: str, tmp_path: Path) -> None:
    Store(db_url).close()  # the schema exists: the race is on the conversation alone
    barrier = SPAWN.Barrier(WORKERS)
    codes = _run_all(_open_and_send, [(db_url, w, barrier, tmp_path) for w in range(WORKERS)])
    errors = [p.read_text() for p in tmp_path.glob("*.txt")]
    assert errors == []
    assert codes == [0] * WORKERS
    assert _rows(db_url, "SELECT id, system_prompt FROM conversations") == [("fresh", "shared")]
    rows = _rows(db_url, "SELECT role, position FROM messages ORDER BY position")
    assert len(rows) == WORKERS * 10 and {r for r, _ in rows} == {"user"}
    assert [p for _, p in rows] == list(range(WORKERS * 10))


def test_racing_creates_of_one_id_give_one_conversation_and_clear_refusals(
    db_url: str, tmp_path: Path
) -> None:
    Store(db_url).close()
    barrier = SPAWN.Barrier(WORKERS)
    codes = _run_all(_create, [(db_url, w, barrier, tmp_path) for w in range(WORKERS)])
    assert codes == [0] * WORKERS
    outcomes = sorted(p.read_text() for p in tmp_path.glob("*.txt"))
    assert outcomes == ["conversation 'same' already exists"] * (WORKERS - 1) + ["created"]
    assert _rows(db_url, "SELECT id FROM conversations") == [("same",)]


def test_racing_token_count_writes_never_fail(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        ids = [m.id for m in store.add_messages("c", [{"role": "user", "content": "x"}] * 30)]
    barrier = SPAWN.Barrier(WORKERS)
    codes = _run_all(_token_counts, [(db_url, w, barrier, ids) for w in range(WORKERS)])
    assert codes == [0] * WORKERS
    rows = _rows(db_url, "SELECT message_id, tokens FROM message_tokens ORDER BY message_id")
    assert rows == [(i, 19_000 + i) for i in ids]  # every worker's last round wrote these


def test_context_state_read_modify_write_loses_no_update(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
    saves = 15
    barrier = SPAWN.Barrier(WORKERS)
    codes = _run_all(_context_state, [(db_url, w, barrier, saves) for w in range(WORKERS)])
    assert codes == [0] * WORKERS
    ((pending, version),) = _rows(db_url, "SELECT pending_ids, version FROM context_states")
    if isinstance(pending, str):  # SQLite's JSON comes back as text through text()
        pending = json.loads(pending)
    assert sorted(pending) == sorted(w * 1000 + i for w in range(WORKERS) for i in range(saves))
    assert version == WORKERS * saves
    # Each worker's own numbers in its own order: no save was applied twice or reordered.
    for worker in range(WORKERS):
        assert [p % 1000 for p in pending if p // 1000 == worker] == list(range(saves))


def test_a_stale_context_state_save_is_refused_and_changes_nothing(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        assert store.context_state("c").version == 0
        first = store.save_context_state("c", window_start=2, expected_version=0)
        assert first.version == 1
        with pytest.raises(ContextStateConflict) as info:
            store.save_context_state("c", window_start=9, expected_version=0)
        assert (info.value.expected, info.value.found) == (0, 1)
        assert store.context_state("c").window_start == 2
        # Without expected_version a save still applies (and counts).
        assert store.save_context_state("c", window_start=3).version == 2


def test_turns_while_another_process_upgrades_and_another_exports(
    pg_url: str, tmp_path: Path
) -> None:
    Store(pg_url).close()
    turns = 20
    barrier = SPAWN.Barrier(WORKERS + 2)
    export = tmp_path / "export.jsonl"
    args: list[tuple[Any, ...]] = [(pg_url, f"c{w}", barrier, turns) for w in range(WORKERS)]
    processes = [SPAWN.Process(target=_turns, args=a) for a in args]
    processes.append(SPAWN.Process(target=_upgrade_loop, args=(pg_url, barrier, 3)))
    processes.append(SPAWN.Process(target=_export_loop, args=(pg_url, barrier, export, 15)))
    for process in processes:
        process.start()
    assert _join(processes) == [0] * (WORKERS + 2)

    rows = _rows(
        pg_url,
        "SELECT conversation_id, position, role, content FROM messages "
        "ORDER BY conversation_id, position",
    )
    assert len(rows) == WORKERS * turns * 2
    n_turns = _rows(
        pg_url,
        "SELECT count(*) FROM turns t JOIN messages m ON m.id = t.assistant_message_id "
        "JOIN messages u ON u.id = t.user_message_id",
    )
    assert n_turns == [(WORKERS * turns,)]
    # A final export equals the rows.
    with Store(pg_url) as store, export.open("w") as handle:
        export_jsonl(store, [c.id for c in store.list_conversations()], handle)
    exported = sorted(
        (line["id"], i, m["role"], m["content"])
        for line in map(json.loads, export.read_text().splitlines())
        for i, m in enumerate(line["messages"])
    )
    assert exported == sorted(rows)


# kill -9 of writers ------------------------------------------------------------------------

KILL_WRITER = """
import sys
from chatctx.store import Store
url, cid, tag = sys.argv[1:4]
turn = dict(n_ctx=512, prompt_tokens=1, reused_tokens=0, evaluated_tokens=1,
            generated_tokens=1, prefill_ms=1.0, total_ms=1.0, stop_reason="eog")
with Store(url) as store:
    store.get_or_create_conversation(cid)
    print("ready", flush=True)
    index = 0
    while True:
        user = store.add_message(cid, "user", f"{tag}:{index} " + "x" * 2000)
        print(f"m {user.id}", flush=True)
        reply, row = store.record_reply(
            cid, {"role": "assistant", "content": f"{tag}:{index} answer " + "y" * 4000},
            user_message_id=user.id, **turn)
        print(f"m {reply.id}", flush=True)
        print(f"t {row.id}", flush=True)
        index += 1
"""


@pytest.mark.slow
def test_kill_9_of_writers_loses_no_committed_message_and_leaves_no_half_turn(
    pg_url: str,
) -> None:
    Store(pg_url).close()
    reported: dict[str, set[int]] = {"m": set(), "t": set()}
    rng = random.Random(24)
    for round_ in range(20):
        writers = [
            subprocess.Popen(
                [sys.executable, "-c", KILL_WRITER, pg_url, f"k{w}", f"r{round_}w{w}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            for w in range(2)
        ]
        for writer in writers:
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "ready", writer.stderr
        time.sleep(rng.uniform(0.05, 0.4))
        for writer in writers:
            writer.send_signal(signal.SIGKILL)
        for writer in writers:
            out, _ = writer.communicate(timeout=60)
            assert writer.returncode == -signal.SIGKILL
            for line in out.splitlines():
                kind, _, number = line.partition(" ")
                if kind in reported and number.isdigit():
                    reported[kind].add(int(number))
    assert len(reported["t"]) >= 20  # the writers got somewhere before each kill
    messages = {r[0] for r in _rows(pg_url, "SELECT id FROM messages")}
    turns = {r[0] for r in _rows(pg_url, "SELECT id FROM turns")}
    assert reported["m"] - messages == set()  # every committed message is there
    assert reported["t"] - turns == set()
    # No half turn: every turn has its assistant message, every assistant message its turn.
    half = _rows(
        pg_url,
        "SELECT t.id FROM turns t LEFT JOIN messages m ON m.id = t.assistant_message_id "
        "WHERE m.id IS NULL",
    )
    orphans = _rows(
        pg_url,
        "SELECT m.id FROM messages m LEFT JOIN turns t ON t.assistant_message_id = m.id "
        "WHERE m.role = 'assistant' AND t.id IS NULL",
    )
    assert half == [] and orphans == []
    # Positions stay gapless in each conversation.
    for cid in ("k0", "k1"):
        positions = [
            r[0]
            for r in _rows(
                pg_url,
                "SELECT position FROM messages WHERE conversation_id = :c ORDER BY position",
                c=cid,
            )
        ]
        assert positions == list(range(len(positions)))


@pytest.mark.parametrize("write", ["add_message", "record_reply", "save_context_state"])
def test_writes_wait_out_a_row_lock_held_past_the_lock_timeout(pg_url: str, write: str) -> None:
    # A short lock_timeout: a write waiting on the other transaction's row lock fails with
    # SQLSTATE 55P03, and only the store's retries can get it through once the lock is gone.
    url = pg_url + "?options=-c%20lock_timeout%3D100"
    with Store(url) as store:
        store.create_conversation("c")
        user = store.add_message("c", "user", "before the lock")
        if write == "save_context_state":
            store.save_context_state("c", window_start=0)  # the row exists: it is locked too
        released = threading.Event()
        holder = create_db_engine(pg_url)
        conn = holder.connect()
        conn.execute(text("SELECT 1 FROM conversations WHERE id = 'c' FOR UPDATE"))
        conn.execute(text("SELECT 1 FROM context_states FOR UPDATE"))

        def release() -> None:
            time.sleep(0.6)
            conn.rollback()
            released.set()

        threading.Thread(target=release).start()
        try:
            if write == "add_message":
                store.add_message("c", "user", "after the lock")
            elif write == "record_reply":
                store.record_reply(
                    "c",
                    {"role": "assistant", "content": "after the lock"},
                    user_message_id=user.id,
                    **TURN,
                )
            else:
                store.save_context_state("c", window_start=1)
            assert released.is_set()  # it really waited for the other transaction
        finally:
            released.wait(5)
            conn.close()
            holder.dispose()
    rows = _rows(pg_url, "SELECT content FROM messages ORDER BY position")
    if write == "save_context_state":
        assert _rows(pg_url, "SELECT window_start, version FROM context_states") == [(1, 2)]
    else:
        assert rows == [("before the lock",), ("after the lock",)]
