"""ChatSession at the edges a support bot meets every day; the database rows are the oracle.

Two first messages of a new customer at once, a session or an engine closed while a reply
streams, a turn record that cannot be written, a plan asked for while a summary is ready, a
stream dropped before it started, a session refused after its engine was loaded.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from chatctx import ChatSession, ConfigError, Engine, StoreError
from chatctx.backends.engine._instance import live_directories
from chatctx.context import BackgroundSummarizer
from chatctx.monitor import engines_dir
from chatctx.session._context import ConversationContext
from chatctx.store import Store

LONG = {"max_tokens": 300, "temperature": 0.0, "repeat_penalty": 1.0}


def rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with Store(url) as store, store.engine.connect() as connection:
        return [tuple(r) for r in connection.execute(text(sql))]


def test_eight_threads_open_one_new_conversation_at_once(
    db_url: str, llama3_engine: Engine
) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(8)
    store = Store(db_url)  # one store and one engine for all, as a bot has

    def customer(n: int) -> None:
        try:
            start.wait()
            with ChatSession.open(
                store,
                conversation_id="new-customer",
                model=llama3_engine,
                settings={"max_tokens": 4, "temperature": 0.0},
            ) as chat:
                chat.send(f"message {n}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=customer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    assert errors == []
    assert rows(db_url, "SELECT id FROM conversations") == [("new-customer",)]
    messages = rows(db_url, "SELECT position, role, content FROM messages ORDER BY position")
    # One turn at a time: every user message is followed by its reply.
    assert [m[0] for m in messages] == list(range(16))
    assert [m[1] for m in messages] == ["user", "assistant"] * 8
    assert sorted(m[2] for m in messages[::2]) == [f"message {n}" for n in range(8)]
    turns = rows(db_url, "SELECT user_message_id, assistant_message_id FROM turns")
    assert len(turns) == 8 and all(a == u + 1 for u, a in turns)


ROUNDS = 10  # a new customer per round, all four processes at once


def _process_customer(db_url: str, model: str, n: int, start: Any) -> None:
    with Engine.load(model, n_ctx=256, slots=1) as engine, Store(db_url) as store:
        for r in range(ROUNDS):
            start.wait(60)  # a process that failed leaves the others waiting this long
            with ChatSession.open(
                store,
                conversation_id=f"new-customer-{r}",
                model=engine,
                settings={"max_tokens": 4, "temperature": 0.0},
            ) as chat:
                chat.send(f"message {n}")


def test_four_processes_open_one_new_conversation_at_once(
    db_url: str, tiny_llama3_path: Path
) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(4)
    workers = [
        context.Process(target=_process_customer, args=(db_url, str(tiny_llama3_path), n, start))
        for n in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    expected = [(f"new-customer-{r}",) for r in range(ROUNDS)]
    assert sorted(rows(db_url, "SELECT id FROM conversations")) == sorted(expected)
    for (cid,) in expected:
        messages = rows(
            db_url,
            "SELECT id, position, role, content FROM messages "
            f"WHERE conversation_id = '{cid}' ORDER BY position",
        )
        assert [m[1] for m in messages] == list(range(8))
        users = {m[0]: m[3] for m in messages if m[2] == "user"}
        assert sorted(users.values()) == [f"message {n}" for n in range(4)]
        # Each reply belongs to its own user message, whatever the interleaving.
        turns = rows(
            db_url,
            "SELECT user_message_id, assistant_message_id FROM turns "
            f"WHERE conversation_id = '{cid}'",
        )
        assert sorted(u for u, _ in turns) == sorted(users) and len({a for _, a in turns}) == 4


def test_closing_a_session_mid_stream_stores_what_the_client_read(
    tmp_path: Path, llama3_engine: Engine
) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    chat = ChatSession.open(url, conversation_id="c1", model=llama3_engine, settings=LONG)
    received: list[str] = []
    errors: list[BaseException] = []
    first = threading.Event()

    def client() -> None:
        try:
            for chunk in chat.stream("tell me a long story"):
                received.append(chunk)
                if len(received) >= 5:
                    first.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            first.set()

    reader = threading.Thread(target=client)
    reader.start()
    assert first.wait(30)
    chat.close()  # from another thread, the store owned by the session
    reader.join(30)
    assert errors == []
    stored = rows(url, "SELECT role, content, status FROM messages ORDER BY position")
    assert stored[0] == ("user", "tell me a long story", "complete")
    role, content, status = stored[1]
    assert role == "assistant" and status == "partial"
    assert content == "".join(received)  # the client read it all, and the store holds it
    assert rows(url, "SELECT stop_reason FROM turns") == [("interrupted",)]


def slow_database(store: Store) -> None:
    """Each write of a reply takes a while, as on a busy database server."""
    for name in ("record_reply", "add_turn"):
        write = getattr(store, name)

        def slow(*args: Any, _write: Any = write, **kwargs: Any) -> Any:
            time.sleep(0.3)
            return _write(*args, **kwargs)

        setattr(store, name, slow)


def test_closing_the_engine_mid_stream_stores_the_reply(
    tmp_path: Path, tiny_llama3_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    engine = Engine.load(tiny_llama3_path, n_ctx=1024, slots=2)
    received: list[str] = []
    started = threading.Event()
    with ChatSession.open(url, conversation_id="c1", model=engine, settings=LONG) as chat:
        slow_database(chat.store)

        def client() -> None:
            for chunk in chat.stream("go on"):
                received.append(chunk)
                started.set()

        reader = threading.Thread(target=client)
        reader.start()
        assert started.wait(30)
        engine.close()  # returns once the session stored the reply it ended
        stored = rows(url, "SELECT content, status FROM messages WHERE role = 'assistant'")
        reader.join(30)
    assert stored == [("".join(received), "partial")]
    assert rows(url, "SELECT stop_reason FROM turns") == [("closed",)]


def test_a_turn_that_cannot_be_recorded_leaves_no_half_turn(
    db_url: str, llama3_engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    from chatctx.store import _db

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("disk on fire")

    with ChatSession.open(
        db_url, conversation_id="c", model=llama3_engine, settings={"max_tokens": 8}
    ) as chat:
        monkeypatch.setattr(_db, "_add_turn", broken)  # the turn row, after the message
        caplog.set_level(logging.ERROR, logger="chatctx.session")
        with pytest.raises(StoreError) as raised:
            chat.send("hello there")
        generated = chat.engine.cached_tokens(chat.seq_id or 0)
    assert isinstance(raised.value.__cause__, RuntimeError)
    logged = [r for r in caplog.records if "not stored" in r.getMessage()]
    assert logged and "disk on fire" in logged[0].getMessage()
    assert generated  # something was generated, and its text is in the log
    text_logged = logged[0].getMessage().split("its text: ", 1)[1]
    assert len(text_logged) > 2
    # The user message is kept; no reply without its turn, no turn without its reply.
    assert rows(db_url, "SELECT role FROM messages") == [("user",)]
    assert rows(db_url, "SELECT count(*) FROM turns") == [(0,)]


def test_plan_shows_a_finished_background_summary_and_leaves_it_to_the_turn(
    db_url: str, tiny_llama3_path: Path
) -> None:
    with (
        Engine.load(tiny_llama3_path, n_ctx=1024, n_seq_max=2) as engine,
        ChatSession.open(
            db_url,
            model=engine,
            settings={"max_tokens": 2, "temperature": 0.0},
            context={"budget": 200, "reserve": 8, "summarizer": "llm", "summary_max_tokens": 16},
        ) as chat,
    ):
        summarizer = chat.builder().summarizer
        assert isinstance(summarizer, BackgroundSummarizer)
        for turn in range(20):
            chat.send(f"turn {turn}: " + "words " * 15)
            if summarizer.running():
                break
        assert summarizer.wait(60) and summarizer.ready(), "no background summary was written"
        pending = set(chat.store.context_state(chat.conversation_id).pending_ids)
        assert pending
        planned = chat.plan("and now?")
        # The plan shows it (the tiny model may have had nothing to add: the evicted
        # messages count as summarized all the same) ...
        assert set(planned.plan.summarized_ids) == pending
        assert summarizer.ready()  # ... and leaves it where it was
        reply = chat.send("and now?")
        assert reply.plan is not None and set(reply.plan.summarized_ids) == pending  # taken
        still = set(chat.store.context_state(chat.conversation_id).pending_ids)
        assert pending.isdisjoint(still)  # folded in, stored: not waiting any more


def test_a_stream_dropped_before_its_first_chunk_lets_summaries_go_on(
    db_url: str, llama3_engine: Engine
) -> None:
    with ChatSession.open(db_url, model=llama3_engine, settings={"max_tokens": 2}) as chat:
        stream = chat.stream("hello")
        assert not chat._turn_under_way.is_set()  # a background summary would wait now
        del stream
        gc.collect()
        assert chat._turn_under_way.is_set()  # the gate opened: no 30-second wait
        # and the slot came back: the next turn does not wait for it
        assert chat.send("again").turn is not None


def test_open_closes_the_engine_it_loaded_when_the_session_is_refused(
    db_url: str, tiny_llama3_path: Path
) -> None:
    with pytest.raises(ConfigError, match="not a slot"):
        ChatSession.open(db_url, model=tiny_llama3_path, seq_id=5)  # one slot: 0
    # The engine open() loaded is closed: its directory's lock is let go.
    assert live_directories(engines_dir()) == []


def test_waiting_for_a_slot_ends_when_the_session_closes(
    db_url: str, tiny_llama3_path: Path
) -> None:
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=1) as engine:
        held = engine.lease("someone else")
        # Room for a prompt: the turn builds its context while in line, then waits.
        chat = ChatSession.open(
            db_url, conversation_id="c", model=engine, settings={"max_tokens": 16}
        )
        outcome: list[BaseException] = []
        waiter = threading.Thread(
            target=lambda: _catch(outcome, lambda: chat.send("hi")), daemon=True
        )
        waiter.start()
        time.sleep(0.2)
        chat.close()
        waiter.join(5)
        assert not waiter.is_alive() and outcome and type(outcome[0]).__name__ == "ClosedError"
        engine.release(held)
    assert rows(db_url, "SELECT count(*) FROM messages") == [(0,)]


def test_a_session_closed_while_its_lease_is_on_the_way_gives_the_slot_back(
    db_url: str, tiny_llama3_path: Path
) -> None:
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=1) as engine:
        lease, entered, go = engine.lease, threading.Event(), threading.Event()

        def slow_lease(conversation: str, **kwargs: Any) -> Any:
            entered.set()
            go.wait(10)  # a swap-in under way, or a slot coming free
            return lease(conversation, **kwargs)

        engine.lease = slow_lease  # type: ignore[method-assign]
        chat = ChatSession.open(db_url, conversation_id="c", model=engine)
        outcome: list[BaseException] = []
        turn = threading.Thread(target=lambda: _catch(outcome, lambda: chat.send("hi")))
        turn.start()
        assert entered.wait(10)
        chat.close()  # ends the turn while its lease is still on its way
        go.set()
        turn.join(10)
        assert outcome and type(outcome[0]).__name__ == "ClosedError"
        engine.lease = lease  # type: ignore[method-assign]
        # The oracle: the engine's only slot is free for the next customer.
        engine.release(engine.lease("next customer", timeout=2.0))
    assert rows(db_url, "SELECT count(*) FROM messages") == [(0,)]


def _catch(into: list[BaseException], call: Any) -> None:
    try:
        call()
    except BaseException as exc:
        into.append(exc)


def test_a_plan_between_a_turns_build_and_its_save_does_not_hide_another_writer(
    db_url: str, llama3_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # Another process saves the conversation's context state while this turn is between its
    # build and its save, and a plan() on the same session reads that newer state. The turn
    # must still compare-and-set against the version it built from: it is refused, builds
    # again on the other writer's summary and keeps it. (The version used to be kept on the
    # session, where the plan overwrote it and the turn's save silently won.)
    with ChatSession.open(
        db_url,
        model=llama3_engine,
        settings={"max_tokens": 1, "temperature": 0.0},
        context={"budget": 160, "reserve": 8, "recall": False},
    ) as chat:
        cid = chat.conversation_id
        for turn in range(30):
            chat.record_turn(f"turn {turn}: my order NH-{4000 + turn} " + "words " * 8, "ok")
            if chat.store.context_state(cid).summary is not None:
                break
        else:
            pytest.fail("no summary was written")
        builder = chat.builder()
        build = builder.build
        builds: list[int] = []

        def interleaved(**kwargs: Any) -> Any:
            built = build(**kwargs)
            builds.append(1)
            if len(builds) == 1:
                with Store(db_url) as other:
                    state = other.context_state(cid)
                    other.save_context_state(
                        cid,
                        window_start=state.window_start,
                        new_summary=("Facts: FOREIGN-1", [], 5, built.fingerprint),
                        expected_version=state.version,
                    )
                chat.plan("just looking")  # reads the other writer's version
            return built

        builder.build = interleaved  # type: ignore[method-assign]
        caplog.set_level(logging.INFO, logger="chatctx.session")
        for turn in range(30, 60):
            chat.record_turn(f"turn {turn}: my order NH-{4000 + turn} " + "words " * 8, "ok")
            if builds and len(builds) > 2:
                break
        # The turn's save was refused (the oracle: the store's compare-and-set) ...
        assert "changed meanwhile: built again" in caplog.text
        # ... and the other writer's summary was built on, not overwritten.
        summary = chat.store.context_state(cid).summary
        assert summary is not None and "FOREIGN-1" in summary.content


def _timed_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """(start, end) of every context build, on the test's clock."""
    builds: list[tuple[float, float]] = []
    build = ConversationContext.build

    def timed(self: ConversationContext, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return build(self, *args, **kwargs)
        finally:
            builds.append((started, time.perf_counter()))

    monkeypatch.setattr(ConversationContext, "build", timed)
    return builds


def _wait_in_line(engine: Engine, waiting: int) -> float:
    """When ``waiting`` turns are in the pool's line and waiting (not away building)."""
    deadline = time.monotonic() + 20
    while sum(w.away_until is None for w in engine.pool._line) < waiting:
        assert time.monotonic() < deadline, "the turn never waited in line"
        time.sleep(0.002)
    return time.perf_counter()


def test_a_turn_builds_its_context_while_it_waits_for_a_slot(
    db_url: str, tiny_llama3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The oracle is the test's clock: the build must end while the slot is still held by
    # someone else (the old order built only once the slot was leased: never, here).
    builds = _timed_builds(monkeypatch)
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=1) as engine:
        engine.codec(), engine.embedder()  # loaded ahead, as a server does (``warm_up``)
        held = engine.lease("someone else")
        chat = ChatSession.open(
            db_url, conversation_id="c", model=engine, settings={"max_tokens": 4}
        )
        replies: list[Any] = []
        asking = threading.Thread(target=lambda: replies.append(chat.send("hi")), daemon=True)
        asking.start()
        seen = _wait_in_line(engine, 1)
        deadline = time.monotonic() + 20
        while not builds:
            assert time.monotonic() < deadline, "no build while the slot was held"
            time.sleep(0.002)
        time.sleep(0.2)
        given_back = time.perf_counter()
        engine.release(held)
        asking.join(30)
        chat.close()
    (reply,) = replies
    ((_, built),) = builds
    assert built < given_back
    assert reply.turn is not None and reply.turn.build_ms is not None
    # The wait counts from the request to the lease, the build in line included.
    assert reply.turn.queue_ms is not None and reply.turn.queue_ms >= (given_back - seen) * 1000
    assert reply.turn.build_ms <= reply.turn.queue_ms


def test_a_build_whose_summary_runs_on_the_slot_waits_for_it(
    db_url: str, tiny_llama3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No sequence for summaries (one sequence, all of it the slot): an LLM summary would
    # run on the turn's own slot, so the build waits in line for it first.
    builds = _timed_builds(monkeypatch)
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=1, n_seq_max=1) as engine:
        assert engine.side_room == 0
        engine.codec(), engine.embedder()  # loaded ahead: a build takes milliseconds
        held = engine.lease("someone else")
        chat = ChatSession.open(
            db_url,
            conversation_id="c",
            model=engine,
            settings={"max_tokens": 4},
            context={"summarizer": "llm"},
        )
        replies: list[Any] = []
        asking = threading.Thread(target=lambda: replies.append(chat.send("hi")), daemon=True)
        asking.start()
        _wait_in_line(engine, 1)
        time.sleep(0.2)
        given_back = time.perf_counter()
        engine.release(held)
        asking.join(30)
        chat.close()
    assert replies and len(builds) == 1
    ((_, built),) = builds
    assert built > given_back
