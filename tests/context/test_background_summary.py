"""A slow summary never blocks a turn: it is written in the background and taken later.

Oracle: a fake folding summarizer gated by an event, so the test decides when the summary is
"written", and records exactly which messages it was given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from chatctx import ChatSession, Engine
from chatctx.context import BackgroundSummarizer, ContextBuilder, ContextState
from chatctx.context._background import RUNNING
from chatctx.store import Message


class GatedFold:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[list[int]] = []

    def __call__(
        self,
        previous: str | None,
        messages: Sequence[Message],
        *,
        deadline: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> tuple[str | None, list[int], str | None]:
        self.calls.append([m.id for m in messages])
        self.gate.wait(30)
        return f"{previous or ''}[summary of {len(messages)}]", [m.id for m in messages], None


def message(i: int, role: str, text: str) -> Message:
    return Message(id=i, conversation_id="c", position=i - 1, role=role, content=text)


def chat(turns: int) -> list[Message]:
    out = []
    for t in range(turns):
        out.append(message(2 * t + 1, "user", f"question {t} " + "word " * 30))
        out.append(message(2 * t + 2, "assistant", f"answer {t} " + "word " * 30))
    return out


def test_evicting_turn_does_not_wait_and_the_summary_arrives_later(
    llama3_engine: Engine,
) -> None:
    fold = GatedFold()
    background = BackgroundSummarizer(fold, timeout_s=30)
    history = chat(12)
    by_id = {m.id: m for m in history}
    builder = ContextBuilder(
        llama3_engine.codec(),
        summarizer=background,
        lookup=lambda ids: [by_id[i] for i in ids],
    )
    state = ContextState()
    built = builder.build(
        system_prompt="sys", history=history, new_message="next", budget=400, state=state
    )
    plan = built.plan
    assert plan.evicted and not plan.summary_changed
    assert plan.summary_stopped == RUNNING
    evicted = set(plan.evicted_ids)
    assert set(built.state.pending_ids) == evicted  # waiting, not lost
    assert built.state.summary is None
    # The next turn, before the summary is written: still no summary, nothing blocks.
    window = [m for m in history if m.position >= built.state.window_start]
    again = builder.build(
        system_prompt="sys", history=window, new_message="more", budget=400, state=built.state
    )
    assert not again.plan.summary_changed and again.state.summary is None
    fold.gate.set()
    assert background.wait(30)
    # The first turn after it is done takes it, without an eviction of its own.
    taken = builder.build(
        system_prompt="sys", history=window, new_message="and more", budget=400, state=again.state
    )
    assert taken.plan.summary_changed and not taken.plan.evicted
    assert taken.state.summary == f"[summary of {len(evicted)}]"
    assert set(taken.plan.summarized_ids) == evicted
    assert taken.state.pending_ids == ()
    assert fold.calls == [sorted(evicted)]  # one job, over exactly the evicted messages
    assert "[summary of" in taken.messages[1]["content"]


@contextmanager
def llm_session(db_url: str, engine: Engine) -> Iterator[ChatSession]:
    """A session whose LLM summaries come early: a 200-token budget, 16-token summaries."""
    with ChatSession.open(
        db_url,
        model=engine,
        settings={"max_tokens": 2, "temperature": 0.0},
        context={"budget": 200, "reserve": 8, "summarizer": "llm", "summary_max_tokens": 16},
    ) as session:
        yield session


def test_llm_summaries_of_a_session_run_in_the_background(
    db_url: str, tiny_llama3_path: Path
) -> None:
    with (
        Engine.load(tiny_llama3_path, n_ctx=1024, n_seq_max=2) as engine,
        llm_session(db_url, engine) as session,
    ):
        builder = session.builder()
        assert isinstance(builder.summarizer, BackgroundSummarizer)
        plans = []
        for turn in range(14):
            reply = session.send(f"turn {turn}: " + "words " * 15)
            assert reply.plan is not None
            plans.append(reply.plan)
            summarizer = session.builder().summarizer
            assert isinstance(summarizer, BackgroundSummarizer)
            summarizer.wait(60)  # let the job finish before the next turn
        evicting = [i for i, p in enumerate(plans) if p.evicted]
        assert evicting and evicting[0] < len(plans) - 1, "no turn evicted early enough"
        for i in evicting:
            # An evicting turn never waited for the model's summary ...
            assert plans[i].summary_stopped == RUNNING and not plans[i].summarized_ids
            if i + 1 < len(plans):
                # ... the next turn took it (the tiny model may have had nothing to add).
                assert set(plans[i].evicted_ids) <= set(plans[i + 1].summarized_ids)
        if evicting[-1] < len(plans) - 1:
            assert session.store.context_state(session.conversation_id).pending_ids == ()
        spare = engine.spare_seq
        assert spare is not None and engine.kv_cells(spare) == 0


def test_closing_a_session_stops_its_background_summary(
    db_url: str, tiny_llama3_path: Path
) -> None:
    # A summary still being written when the session closes would keep the engine's spare
    # sequence busy for nobody: the next conversation could not clear it (replaying many
    # logged chats with --summarizer llm stopped at the second one).
    with Engine.load(tiny_llama3_path, n_ctx=1024, n_seq_max=2) as engine:
        spare = engine.spare_seq
        assert spare is not None
        with ChatSession.open(
            db_url,
            model=engine,
            settings={"max_tokens": 2, "temperature": 0.0},
            context={
                "budget": 200,
                "reserve": 8,
                "summarizer": "llm",
                "summary_max_tokens": 400,  # a summary of seconds on the tiny model
            },
        ) as session:
            summarizer = session.builder().summarizer
            assert isinstance(summarizer, BackgroundSummarizer)
            for turn in range(14):
                session.send(f"turn {turn}: " + "words " * 15)
                if summarizer.running():
                    break
            assert summarizer.running(), "no background summary started"
            for _ in range(2000):  # until llama.cpp holds the summary's prompt
                if engine.kv_cells(spare) > 0 or not summarizer.running():
                    break
                threading.Event().wait(0.005)
        # Closed: the summary was stopped and its sequence emptied, read from llama.cpp.
        assert not summarizer.running()
        assert engine.kv_cells(spare) == 0
        engine.clear()  # refused while a generation holds a sequence
        assert all(cells == 0 for cells in engine.kv_usage().values())


def test_a_background_summary_starts_after_its_turns_first_token(
    db_url: str, tiny_llama3_path: Path
) -> None:
    # Started while the turn was being prepared, the summary's first prompt chunk held the
    # model and the customer's prompt waited behind it (on two cores, 100-250 ms of a turn's
    # 120 ms). Oracle: the order in which the engine was handed the two generations, and the
    # turn's first token as the engine timed it.
    with (
        Engine.load(tiny_llama3_path, n_ctx=1024, n_seq_max=2) as engine,
        llm_session(db_url, engine) as session,
    ):
        submitted: list[tuple[bool, float]] = []
        submit = engine._submit

        def recording(job: Any) -> None:
            submitted.append((job.background, time.perf_counter()))
            submit(job)

        engine._submit = recording  # type: ignore[method-assign]
        checked = 0
        for turn in range(14):
            submitted.clear()
            reply = session.send(f"turn {turn}: " + "words " * 15)
            summarizer = session.builder().summarizer
            assert isinstance(summarizer, BackgroundSummarizer)
            summarizer.wait(60)
            assert reply.plan is not None and reply.timings.engine_ttft_ms is not None
            side = [t for background, t in submitted if background]
            if not (reply.plan.evicted and side):
                continue
            checked += 1
            turn_at = next(t for background, t in submitted if not background)
            # The engine counts the turn's TTFT from its submission: the first token came
            # at turn_at + TTFT at the earliest; the summary was handed over after it.
            assert side[0] >= turn_at + reply.timings.engine_ttft_ms / 1000
        assert checked, "no evicting turn started a background summary"
