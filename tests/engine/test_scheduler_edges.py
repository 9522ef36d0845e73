"""The scheduler at its edges: refused submits, cancelled prefills, inserts, deadlines.

Oracles: llama.cpp's own evaluated-token counters, the decode calls llama.cpp was asked to
make (recorded around ``decode_many``) with their wall-clock times, and a watchdog thread.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from chatctx import (
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    Engine,
    GenerationError,
    GenerationSettings,
)
from chatctx.backends.base import Lease
from chatctx.backends.engine._scheduler import PREFILL_CHUNK
from chatctx.backends.pool import AWAY_GRACE_S, SlotPool
from chatctx.backends.swap import SwapHit
from tests.llama_counters import counted, prime_counters

GREEDY = GenerationSettings(temperature=0.0, max_tokens=400, repeat_penalty=1.0)


def record_decodes(engine: Engine) -> list[tuple[dict[int, int], float, float]]:
    """Every decode llama.cpp is asked for: (sequence -> tokens, start, end perf_counter)."""
    calls: list[tuple[dict[int, int], float, float]] = []
    decode_many = engine.context.decode_many

    def recording(parts: Any) -> list[int]:
        start = time.perf_counter()
        try:
            return decode_many(parts)
        finally:
            calls.append(
                ({seq: len(tokens) for seq, tokens, _, _ in parts}, start, time.perf_counter())
            )

    engine.context.decode_many = recording  # type: ignore[method-assign]
    return calls


def test_a_refused_submit_leaves_nothing_for_close_to_wait_for(tiny_llama3_path: Path) -> None:
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=1) as engine:
        running = engine.generate([128000, 5, 6], seq_id=0, settings=GREEDY)
        next(iter(running))
        second = engine.generate([128000, 7, 8], seq_id=0, settings=GREEDY)
        with pytest.raises(ConfigError, match="busy"):
            next(second)  # the sequence has a generation: refused
        closer = threading.Thread(target=second.close, daemon=True)
        closer.start()
        closer.join(1.0)  # the watchdog: close() must not wait for a job nobody runs
        assert not closer.is_alive()
        running.close()


def test_a_stream_closed_before_it_started_can_be_closed_again(tiny_llama3_path: Path) -> None:
    # Two threads ending one turn (its reader gone, the session closing) both close it.
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=1) as engine:
        unstarted = engine.generate([128000, 5, 6], seq_id=0, settings=GREEDY)
        unstarted.close()
        closer = threading.Thread(target=unstarted.close, daemon=True)
        closer.start()
        closer.join(1.0)  # the watchdog: nothing was submitted, nothing to wait for
        assert not closer.is_alive()
        assert unstarted.result is None
        with pytest.raises(StopIteration):
            next(unstarted)
        with pytest.raises(GenerationError, match="closed before it started"):
            unstarted.wait()  # was an AssertionError (gone under python -O)


def test_a_cancelled_prefill_records_what_llama_cpp_evaluated(tiny_llama3_path: Path) -> None:
    with Engine.load(tiny_llama3_path, n_ctx=2048, slots=1) as engine:
        prime_counters(engine)
        calls = record_decodes(engine)
        prompt = [128000, *range(1000, 1000 + 6 * PREFILL_CHUNK)]
        before = counted(engine)
        generation = engine.generate(prompt, seq_id=0, settings=GREEDY)
        stop = threading.Thread(
            target=lambda: (_wait_for(lambda: len(calls) >= 2), generation.close()), daemon=True
        )
        stop.start()
        result = generation.wait()
        stop.join()
        assert result.stop_reason == "interrupted"
        decoded = counted(engine) - before
        assert 0 < decoded < len(prompt)  # stopped in the middle of the prefill
        assert result.usage.evaluated_tokens == decoded
        assert len(engine.cached_tokens(0)) == decoded  # the mirror holds what is cached


def _wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_changed_summary_goes_in_chunks_beside_a_running_stream(tiny_llama3_path: Path) -> None:
    # One customer streams while another's changed summary (700 tokens) is inserted in front
    # of its kept turns. Before, the insert was one decode inside admission: the stream
    # stood still for all of it.
    insert = 700
    with Engine.load(tiny_llama3_path, n_ctx=2048, slots=2, n_batch=1024) as engine:
        system = list(range(300, 340))
        kept = list(range(2000, 2000 + 300))
        engine.prefill([128000, *system, *range(5000, 5000 + 200), *kept], seq_id=1)
        calls = record_decodes(engine)
        stream = engine.generate([128000, *range(700, 760)], seq_id=0, settings=GREEDY)
        chunks = iter(stream)
        next(chunks)
        summary = list(range(9000, 9000 + insert))
        prompt = [128000, *system, *summary, *kept, *range(7000, 7020)]
        turn = engine.generate(
            prompt, seq_id=1, settings=GenerationSettings(max_tokens=1), history_start=41 + insert
        )
        reader = threading.Thread(target=lambda: [None for _ in chunks], daemon=True)
        reader.start()
        result = turn.wait()
        stream.close()
        reader.join()
    assert result.kv is not None and result.kv.fallback is None  # the kept turns moved
    assert result.usage.reused_tokens == 1 + len(system) + len(kept)
    assert result.usage.evaluated_tokens == insert + 20
    # The other customer's prompt went in chunks, each decoded alone, none across a multiple
    # of PREFILL_CHUNK of its positions ...
    mine = [(i, c[1]) for i, (c, _, _) in enumerate(calls) if 1 in c]
    assert sum(n for _, n in mine) == insert + 20
    assert all(len(calls[i][0]) == 1 and n <= PREFILL_CHUNK for i, n in mine)
    # ... and the stream advanced between any two of them: it waited one chunk at most.
    # Counted in the order of the decode calls, not timed (a loaded machine cannot break it).
    streaming = {i for i, (c, _, _) in enumerate(calls) if c == {0: 1}}
    for (a, _), (b, _) in itertools.pairwise(mine):
        assert any(a < i < b for i in streaming), (a, b)


def test_a_summary_deadline_holds_while_it_steps_aside(smollm2_path: Path) -> None:
    # A background side generation steps aside while a customer's prompt is evaluated; its
    # deadline used to be checked only when it produced a token, so it waited the whole
    # prefill out, and then raised the builtin TimeoutError.
    with Engine.load(smollm2_path, n_ctx=2048, slots=1) as engine:
        calls = record_decodes(engine)
        long_prompt = [1, *range(1000, 1000 + 1900)]
        customer = engine.generate(long_prompt, seq_id=0, settings=GenerationSettings(max_tokens=1))
        chunks = iter(customer)
        done = threading.Thread(target=lambda: [None for _ in chunks], daemon=True)
        done.start()
        _wait_for(lambda: customer._job.state in ("prefill", "decode", "done"))
        deadline = time.perf_counter() + 0.3
        with pytest.raises(DeadlineExceeded):
            engine.side_generate(
                [1, *range(3000, 3064)],
                settings=GenerationSettings(max_tokens=32),
                background=True,
                deadline=time.monotonic() + 0.3,
            )
        raised = time.perf_counter()
        still_prefilling = customer.result is None
        done.join()
        assert customer.result is not None
    assert still_prefilling, "the customer's prefill was too short to test stepping aside"
    # Stopped within a step or two of its deadline (the lock is taken between steps, and a
    # step is one prompt chunk here), long before the customer's prefill ended: counted in
    # the customer's chunks llama.cpp evaluated, not in seconds (a loaded machine stretches
    # every chunk alike).
    prefill = [(start, end) for parts, start, end in calls if parts.get(0, 0) > 1]
    after = [(start, end) for start, end in prefill if start >= deadline and end <= raised]
    assert len(after) <= 2 < len(prefill) - len(after), (len(after), len(prefill))


def test_swapping_in_runs_outside_the_pool_lock() -> None:
    # A restore from disk takes its time; other customers' leases and releases must not
    # wait for it (they did: swaps ran under the pool's lock).
    restoring = threading.Event()

    def slow_swap_in(seq_id: int, owner: str) -> tuple[SwapHit, float]:
        if owner == "slow":
            restoring.set()
            time.sleep(0.5)
        return SwapHit(None, None, None), 0.0

    pool = SlotPool(2, swap_out=lambda seq, owner: None, swap_in=slow_swap_in)
    fast = pool.lease("fast")
    pool.release(fast)
    waiter = threading.Thread(target=lambda: pool.release(pool.lease("slow")), daemon=True)
    waiter.start()
    assert restoring.wait(5)
    started = time.monotonic()
    pool.release(pool.lease("fast"))  # its own slot, while "slow" is being restored
    assert time.monotonic() - started < 0.2
    waiter.join()


def _pool(n: int) -> SlotPool:
    return SlotPool(n, swap_out=lambda seq, owner: None, swap_in=lambda seq, owner: (NO_SWAP, 0.0))


NO_SWAP = SwapHit(None, None, None)


def _wait_for_line(pool: SlotPool, length: int) -> None:
    deadline = time.monotonic() + 5
    while len(pool._line) < length:
        assert time.monotonic() < deadline, "a waiter never got in line"
        time.sleep(0.005)


def test_a_freed_slot_goes_to_the_longest_waiting_conversation() -> None:
    # The oracle is the order the customers asked in (each one is in line before the next
    # asks). Before, every waiter was woken and the first thread to run took the slot.
    pool = _pool(1)
    first = pool.lease("a")
    served: list[str] = []

    def customer(name: str) -> None:
        lease = pool.lease(name, timeout=10)
        served.append(name)
        time.sleep(0.01)  # the others wake meanwhile and find the slot taken
        pool.release(lease)

    threads = []
    for k, name in enumerate(["b", "c", "d", "e", "f"], start=1):
        threads.append(threading.Thread(target=customer, args=(name,), daemon=True))
        threads[-1].start()
        _wait_for_line(pool, k)
    pool.release(first)
    for thread in threads:
        thread.join(10)
    assert served == ["b", "c", "d", "e", "f"]


@pytest.mark.parametrize("barger", ["newcomer", "a"])
def test_no_one_takes_the_slot_a_waiting_conversation_is_owed(barger: str) -> None:
    # "a" is the slot's own conversation coming straight back: with someone in line it
    # waits its turn too (its idle slot is what the first in line takes).
    pool = _pool(1)
    first = pool.lease("a")
    got: list[Lease] = []
    waiter = threading.Thread(target=lambda: got.append(pool.lease("b", timeout=10)))
    waiter.start()
    _wait_for_line(pool, 1)
    pool.release(first)
    # Straight after the release, before "b" has woken: the barger waits its turn.
    with pytest.raises(DeadlineExceeded):
        pool.lease(barger, timeout=0.3)
    waiter.join(10)
    assert [lease.owner for lease in got] == ["b"]
    # With no one in line, the owner of an idle slot takes it at once (no swap). (The barger
    # that gave up holds its place for AWAY_GRACE_S, in case it was only between two polls.)
    pool.release(got[0])
    time.sleep(AWAY_GRACE_S)
    assert pool.lease("b", timeout=0).seq_id == 0


def test_a_waiter_that_gives_up_holds_no_one_up() -> None:
    pool = _pool(1)
    first = pool.lease("a")
    with pytest.raises(DeadlineExceeded):
        pool.lease("impatient", timeout=0.05)
    pool.release(first)
    assert pool.lease("next", timeout=1).owner == "next"
    # A mere try (timeout 0) leaves no place in line at all.
    with pytest.raises(DeadlineExceeded):
        pool.lease("try", timeout=0)
    assert [w.owner for w in pool._line] == ["impatient"]  # away, dropped after AWAY_S


def test_a_polling_waiter_keeps_its_place_in_line() -> None:
    # ChatSession asks for a slot in half-second polls (to notice a close). The oracle is the
    # arrival order: "early" polls from before "late" asks, so it is served first. Before,
    # each poll that timed out sent it to the back of the line, behind "late".
    pool = _pool(1)
    first = pool.lease("a")
    served: list[str] = []
    stop = threading.Event()

    def polling() -> None:
        while not stop.is_set():
            try:
                lease = pool.lease("early", timeout=0.02)
            except DeadlineExceeded:
                continue
            served.append("early")
            pool.release(lease)
            return

    def waiting() -> None:
        lease = pool.lease("late", timeout=10)
        served.append("late")
        pool.release(lease)

    early = threading.Thread(target=polling, daemon=True)
    early.start()
    _wait_for_line(pool, 1)
    time.sleep(0.1)  # several polls of "early" time out
    late = threading.Thread(target=waiting, daemon=True)
    late.start()
    _wait_for_line(pool, 2)
    time.sleep(0.1)  # and several more, with "late" in line behind it
    pool.release(first)
    early.join(10)
    late.join(10)
    stop.set()
    assert served == ["early", "late"]


def test_a_slot_freed_while_a_polling_waiter_is_between_two_calls_waits_for_it() -> None:
    # The arrival order is the oracle: "early" was in line before "late". Its poll times out
    # and the slot is freed before it asks again: the slot is still its own, not "late"'s.
    pool = _pool(1)
    first = pool.lease("a")
    with pytest.raises(DeadlineExceeded):
        pool.lease("early", timeout=0.05)  # in line, now between two calls
    served: list[str] = []
    late = threading.Thread(target=lambda: served.append(pool.lease("late", timeout=10).owner))
    late.start()
    _wait_for_line(pool, 2)
    pool.release(first)
    time.sleep(0.03)  # "late" is awake by now (within the grace), and must not take it
    assert served == []
    lease = pool.lease("early", timeout=1)
    assert lease.owner == "early"
    pool.release(lease)
    late.join(10)
    assert served == ["late"]


def test_a_waiter_that_does_not_come_back_holds_no_one_up_after_the_grace() -> None:
    pool = _pool(1)
    first = pool.lease("a")
    with pytest.raises(DeadlineExceeded):
        pool.lease("gone", timeout=0.05)
    pool.release(first)
    started = time.monotonic()
    assert pool.lease("next", timeout=5).owner == "next"
    assert time.monotonic() - started < 5  # served once the grace ran out, not at the timeout


def test_one_waiting_behind_a_waiter_that_left_is_woken_after_the_grace() -> None:
    # "next" is asleep in line behind "gone", whose poll timed out and who never comes back.
    # A release wakes only the one who may go: "gone" is passed over, and "next" must be
    # woken to wait out its grace, not left asleep until its own timeout (10 s).
    pool = _pool(1)
    first = pool.lease("a")
    with pytest.raises(DeadlineExceeded):
        pool.lease("gone", timeout=0.05)
    served: list[float] = []
    nxt = threading.Thread(
        target=lambda: served.append(pool.lease("next", timeout=10) and time.monotonic()),
        daemon=True,
    )
    nxt.start()
    _wait_for_line(pool, 2)
    time.sleep(AWAY_GRACE_S)  # "gone" is past its grace before the release
    released = time.monotonic()
    pool.release(first)
    nxt.join(10)
    assert served and served[0] - released < 2.0


def test_a_release_wakes_the_next_in_line_not_the_whole_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each time a waiter wakes it looks at the line (``_next_in_line``): the oracle is the
    # count of those looks. Waking all 12 waiters at each lease and release (notify_all) was
    # most of the pool's CPU time with a long line; only the one who may go needs to wake.
    pool = _pool(1)
    looks: list[str] = []
    look = SlotPool._next_in_line

    def counted_look(self: SlotPool, turn: Any) -> bool:
        looks.append(turn.owner if turn is not None else "")
        return look(self, turn)

    monkeypatch.setattr(SlotPool, "_next_in_line", counted_look)
    held = pool.lease("a")
    got: list[Lease] = []

    def wait_in_line(n: int) -> None:
        with contextlib.suppress(ClosedError):  # the pool closed under it: the test failed
            got.append(pool.lease(f"c{n:02d}"))

    try:
        for n in range(12):
            threading.Thread(target=wait_in_line, args=(n,), daemon=True).start()
            _wait_for_line(pool, n + 1)
        for turn in range(12):
            looks.clear()
            pool.release(held)
            deadline = time.monotonic() + 5
            while len(got) < turn + 1:
                assert time.monotonic() < deadline, "no one took the freed slot"
                time.sleep(0.005)
            time.sleep(0.02)  # the rest of the line would have woken by now
            held = got[turn]
            assert held.owner == f"c{turn:02d}"  # first come, first served
            assert looks == [held.owner]  # it alone woke
    finally:
        pool.close()  # wakes whoever is still in line


def test_the_owner_of_an_idle_pinned_slot_never_waits_in_line() -> None:
    # No one else may take a pinned slot, so a conversation waiting for a slot holds its
    # owner up for nothing.
    pool = _pool(2)
    pool.pin("pinned", 0)
    busy = pool.lease("busy")  # slot 1
    waiter = threading.Thread(target=lambda: pool.release(pool.lease("waiting", timeout=10)))
    waiter.start()
    _wait_for_line(pool, 1)
    assert pool.lease("pinned", timeout=0.5).seq_id == 0
    pool.release(busy)
    waiter.join(10)
    assert not waiter.is_alive()
