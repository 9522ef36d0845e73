"""Summaries under one overall deadline: progress is kept, the rest waits, nothing is lost
without being listed. A fake slow model runs on an injected clock: deterministic, no sleeps.

Oracle: what the fake model was actually asked and finished (its transcripts), not the
builder's bookkeeping."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from chatctx.context import BuildResult, ContextBuilder, ContextState, LLMSummarizer
from chatctx.context._builder import MAX_PENDING
from chatctx.model.codec import TiktokenCodec
from chatctx.settings import ContextSettings
from chatctx.store import Message, Store

TIMEOUT = 10.0
STEP = 4.0  # seconds one summary request takes on the fake clock


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowModel:
    """A summary model that takes STEP seconds of fake time per request.

    With ``timeout_s`` (a timed summarizer) it gives up when the request would run past it.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.finished: list[str] = []  # the "New messages" part of each finished request
        self.started: list[str] = []

    def __call__(self, messages: list[dict[str, Any]], timeout_s: float | None = None) -> str:
        request = messages[1]["content"]
        self.started.append(request)
        if timeout_s is not None and timeout_s < STEP:
            self.clock.now += timeout_s
            raise TimeoutError(f"summary not done after {timeout_s:.1f} s")
        self.clock.now += STEP
        self.finished.append(request)
        return f"summary v{len(self.finished)}"


def words(i: int) -> str:
    return f"message {i} " + " ".join(f"w{i}x{j}" for j in range(18))


@pytest.fixture
def store() -> Iterator[Store]:
    with Store("sqlite://") as store:
        store.create_conversation("c")
        yield store


def add(store: Store, n: int) -> list[Message]:
    start = len(store.messages("c"))
    return store.add_messages(
        "c",
        [
            {"role": "user" if i % 2 == 0 else "assistant", "content": words(i)}
            for i in range(start, start + n)
        ],
    )


def make(
    codec: TiktokenCodec, store: Store, clock: Clock, summarizer: Any, **settings: Any
) -> ContextBuilder:
    config = ContextSettings(summarizer="llm", summary_timeout_s=TIMEOUT, **settings)
    return ContextBuilder(
        codec, config, summarizer=summarizer, lookup=store.messages_by_ids, clock=clock
    )


def llm(model: SlowModel, *, timed: bool) -> LLMSummarizer:
    # Word counts keep the chunking easy to follow: about two messages per request.
    return LLMSummarizer(
        model, max_tokens=32, count=lambda t: len(t.split()), max_input_tokens=200, timed=timed
    )


def build(b: ContextBuilder, store: Store, state: ContextState, budget: int = 300) -> BuildResult:
    return b.build(
        system_prompt="Support.",
        history=store.messages("c", from_position=state.window_start),
        new_message="next question please",
        budget=budget,
        state=state,
    )


def covered_by(requests: Sequence[str], messages: Sequence[Message]) -> list[int]:
    return [m.id for m in messages if any(m.content in r for r in requests)]


def test_deadline_keeps_finished_chunks_and_the_rest_waits(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    clock = Clock()
    model = SlowModel(clock)
    b = make(llama3_codec, store, clock, llm(model, timed=True))
    add(store, 24)
    first = build(b, store, ContextState())
    plan = first.plan
    evicted = store.messages_by_ids(plan.evicted_ids)
    assert len(model.started) > len(model.finished) >= 2  # stopped part-way
    done = covered_by(model.finished, evicted)
    assert plan.summarized_ids == done and done == [m.id for m in evicted[: len(done)]]
    assert list(first.state.pending_ids) == [m.id for m in evicted if m.id not in done]
    assert first.state.summary == f"summary v{len(model.finished)}"  # progress kept
    assert plan.summary_changed and plan.summary_error is None
    assert plan.summary_stopped is not None and "TimeoutError" in plan.summary_stopped
    assert clock.now == TIMEOUT  # one deadline for the whole summary
    # The next eviction starts where the last one stopped, from the summary it reached.
    model.finished.clear()
    model.started.clear()
    add(store, 12)
    second = build(b, store, first.state)
    pending = store.messages_by_ids(first.state.pending_ids)
    assert model.started[0].startswith(f"Summary so far:\n{first.state.summary}\n")
    assert pending[0].content in model.started[0]
    assert set(second.plan.summarized_ids) <= set(first.state.pending_ids) | set(
        second.plan.evicted_ids
    )
    assert set(second.plan.summarized_ids) & set(first.state.pending_ids)


def test_one_deadline_for_all_chunks_not_one_per_chunk(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    clock = Clock()
    model = SlowModel(clock)
    b = make(llama3_codec, store, clock, llm(model, timed=False))
    add(store, 24)
    built = build(b, store, ContextState())
    # Requests start at 0, 4 and 8 s; at 12 s the 10 s deadline has passed: no fourth one,
    # although each request alone took less than the timeout.
    assert len(model.finished) == 3 and clock.now == 3 * STEP
    stopped = built.plan.summary_stopped
    assert stopped is not None and stopped.startswith("deadline reached after 3 of ")
    evicted = store.messages_by_ids(built.plan.evicted_ids)
    assert built.plan.summarized_ids == covered_by(model.finished, evicted)
    assert built.state.pending_ids


def test_a_finished_summary_is_kept_however_long_it_took(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    clock = Clock()

    def slow(previous: str | None, messages: Sequence[Message]) -> str:
        clock.now += 9 * TIMEOUT
        return f"{len(messages)} messages summarized"

    add(store, 24)
    built = build(make(llama3_codec, store, clock, slow), store, ContextState())
    n = len(built.plan.evicted_ids)
    assert built.state.summary == f"{n} messages summarized"
    assert built.plan.summary_error is None and built.state.pending_ids == ()
    assert built.plan.summarized_ids == built.plan.evicted_ids
    assert built.plan.summary_ms == 9 * TIMEOUT * 1000


@pytest.mark.parametrize("previous", [None, "what we know so far"])
def test_nothing_new_to_add_is_not_a_failure(
    llama3_codec: TiktokenCodec, store: Store, previous: str | None
) -> None:
    calls: list[int] = []

    def nothing_new(prev: str | None, messages: Sequence[Message]) -> str:
        calls.append(len(messages))
        return prev or ""

    add(store, 24)
    b = make(llama3_codec, store, Clock(), nothing_new)
    state = ContextState(summary=previous, summary_tokens=5 if previous else 0)
    built = build(b, store, state)
    assert built.plan.summary_error is None and not built.plan.summary_changed
    assert built.state.summary == previous and built.state.pending_ids == ()
    assert built.plan.summarized_ids == built.plan.evicted_ids
    add(store, 12)
    again = build(b, store, built.state)
    assert calls[1] == len(again.plan.evicted_ids)  # nothing retried


def test_messages_over_the_pending_limit_are_listed_as_dropped(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    def failing(previous: str | None, messages: Sequence[Message]) -> str:
        raise RuntimeError("model server exploded")

    old = add(store, MAX_PENDING - 3)
    add(store, 24)
    state = ContextState(window_start=old[-1].position + 1, pending_ids=tuple(m.id for m in old))
    built = build(make(llama3_codec, store, Clock(), failing), store, state)
    waiting = [m.id for m in old] + built.plan.evicted_ids  # oracle: all that waited
    assert len(waiting) > MAX_PENDING
    assert built.plan.summary_error == "RuntimeError: model server exploded"
    assert built.plan.dropped_ids == waiting[: len(waiting) - MAX_PENDING]
    assert built.plan.dropped_reason is not None and str(MAX_PENDING) in built.plan.dropped_reason
    assert list(built.state.pending_ids) == waiting[-MAX_PENDING:]


def test_without_a_summarizer_evicted_messages_are_listed_as_dropped(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    add(store, 24)
    b = ContextBuilder(llama3_codec, ContextSettings(summarizer="none"))
    built = build(b, store, ContextState())
    assert built.plan.evicted_ids and built.plan.dropped_ids == built.plan.evicted_ids
    assert built.plan.dropped_reason == "no summarizer"


def test_llm_fold_keeps_progress_when_a_later_chunk_fails() -> None:
    messages = [
        Message(id=i + 1, conversation_id="c", position=i, role="user", content=words(i))
        for i in range(8)
    ]
    seen: list[str] = []

    def flaky(request: list[dict[str, Any]]) -> str:
        seen.append(request[1]["content"])
        if len(seen) == 2:
            raise RuntimeError("boom")
        return f"v{len(seen)}"

    summarizer = LLMSummarizer(
        flaky, max_tokens=32, count=lambda t: len(t.split()), max_input_tokens=200
    )
    text, covered, stopped = summarizer.fold("old", messages)
    assert text == "v1" and stopped is not None and "boom" in stopped
    assert covered == [m.id for m in messages if m.content in seen[0]]
    seen.clear()
    with pytest.raises(RuntimeError, match="boom"):  # nothing finished: a failure
        LLMSummarizer(
            lambda r: (_ for _ in ()).throw(RuntimeError("boom")),
            max_tokens=32,
            count=lambda t: len(t.split()),
        ).fold(None, messages)
