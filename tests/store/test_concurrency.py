"""Several processes and threads on one store: no lost appends, no failed first opens.

Oracles: every writer's payload ``worker:index`` is parsed back from the stored content (the
set must be complete and each worker's messages in its own order), positions are counted
0..n-1, SQLite's own ``PRAGMA integrity_check``, and the schema of a database upgraded by one
process alone.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from chatctx.store import Store, _connect, create_db_engine, current_revision, head_revision

WORKERS = 8
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
APPENDS = 50
# forkserver: fresh processes (no inherited connections or locks), forked from a server that
# imported the store once, instead of eight imports of chatctx.
SPAWN = multiprocessing.get_context("forkserver")
SPAWN.set_forkserver_preload([__name__])


def _append(url: str, cid: str, worker: int, barrier: Barrier) -> None:
    with Store(url) as store:
        barrier.wait()
        for index in range(APPENDS):
            store.add_message(cid, "user", f"{worker}:{index}")


def _read(url: str, cid: str, barrier: Barrier, done: Barrier) -> None:
    # Every snapshot a reader sees is a prefix of the final history: positions 0..n-1.
    with Store(url) as store:
        barrier.wait()
        while True:
            writers_done = done.n_waiting == WORKERS
            positions = [m.position for m in store.messages(cid)]
            if positions != list(range(len(positions))):
                raise SystemExit(f"reader saw positions {positions[:5]}... (gap or duplicate)")
            if writers_done:
                return
            time.sleep(0.01)


def _append_then_wait(url: str, cid: str, worker: int, barrier: Barrier, done: Barrier) -> None:
    try:
        _append(url, cid, worker, barrier)
    finally:
        done.wait()  # a failed writer too, so the reader and the test go on to the checks


def _open(url: str, barrier: Barrier) -> None:
    barrier.wait()
    Store(url).close()


def _integrity(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])


def _schema(path: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name")
        return [tuple(row) for row in rows]


def _join_all(processes: Sequence[multiprocessing.process.BaseProcess]) -> list[int | None]:
    for process in processes:
        process.join(timeout=240)
    return [process.exitcode for process in processes]


def test_eight_processes_append_to_one_conversation(tmp_path: Path) -> None:
    path = tmp_path / "chat.db"
    url = f"sqlite:///{path}"
    with Store(url) as store:
        cid = store.create_conversation("shared").id
    start = SPAWN.Barrier(WORKERS + 1)
    done = SPAWN.Barrier(WORKERS + 1)
    writers = [
        SPAWN.Process(target=_append_then_wait, args=(url, cid, w, start, done))
        for w in range(WORKERS)
    ]
    reader = SPAWN.Process(target=_read, args=(url, cid, start, done))
    for process in [*writers, reader]:
        process.start()
    # The reader leaves once it has seen all writers waiting at `done`; then they are freed.
    reader.join(timeout=240)
    assert reader.exitcode == 0
    done.wait(timeout=60)
    assert _join_all(writers) == [0] * WORKERS

    with Store(url) as store:
        messages = store.messages(cid)
    assert len(messages) == WORKERS * APPENDS
    assert [m.position for m in messages] == list(range(WORKERS * APPENDS))
    payloads = [tuple(map(int, m.content.split(":"))) for m in messages]
    assert set(payloads) == {(w, i) for w in range(WORKERS) for i in range(APPENDS)}
    for worker in range(WORKERS):
        assert [i for w, i in payloads if w == worker] == list(range(APPENDS))
    assert _integrity(path) == "ok"


def test_eight_processes_open_a_fresh_database_at_once(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "chat.db"
    url = f"sqlite:///{path}"
    barrier = SPAWN.Barrier(WORKERS)
    openers = [SPAWN.Process(target=_open, args=(url, barrier)) for _ in range(WORKERS)]
    for process in openers:
        process.start()
    assert _join_all(openers) == [0] * WORKERS

    engine = create_db_engine(url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    assert _integrity(path) == "ok"
    # The same schema as a database that one process upgraded alone.
    Store(f"sqlite:///{tmp_path / 'solo.db'}").close()
    assert _schema(path) == _schema(tmp_path / "solo.db")
    assert (path.parent / "chat.db.lock").is_file()


def test_threads_share_an_in_memory_store() -> None:
    # One connection (StaticPool) for every thread: without the store's lock, transactions of
    # different threads interleave on it.
    with Store("sqlite://") as store:
        cid = store.create_conversation("bot").id
        errors: list[BaseException] = []

        def work(worker: int) -> None:
            try:
                for index in range(APPENDS):
                    store.add_message(cid, "user", f"{worker}:{index}")
                    store.get_conversation(cid)  # reads share the one connection too
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(WORKERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        messages = store.messages(cid)
    assert [m.position for m in messages] == list(range(WORKERS * APPENDS))
    payloads = [tuple(map(int, m.content.split(":"))) for m in messages]
    for worker in range(WORKERS):
        assert [i for w, i in payloads if w == worker] == list(range(APPENDS))


@pytest.mark.parametrize("write", ["add_message", "add_turn", "update_conversation"])
def test_writes_wait_out_a_lock_held_past_the_busy_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    path = tmp_path / "chat.db"
    # A short busy timeout, so the lock below outlasts it and only the retries can succeed.
    monkeypatch.setattr(_connect, "BUSY_TIMEOUT_MS", 50)
    store = Store(f"sqlite:///{path}")
    cid = store.create_conversation("c").id
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    released = threading.Event()

    def release() -> None:
        time.sleep(0.6)
        holder.execute("COMMIT")
        released.set()

    threading.Thread(target=release).start()
    try:
        if write == "add_message":
            store.add_message(cid, "user", "after the lock")
        elif write == "add_turn":
            store.add_turn(cid, **TURN)
        else:
            store.update_conversation(cid, title="after the lock")
        assert released.is_set()  # it really waited for the other writer
        assert store.get_conversation(cid).message_count == int(write == "add_message")
        assert len(store.turns(cid)) == int(write == "add_turn")
    finally:
        released.wait(5)
        holder.close()
        store.close()
