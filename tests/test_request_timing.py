"""Time to first token counts from the request: building, storing and summarizing included.

Oracles: the wall clock around ``stream()`` measured here, and a summarizer that sleeps a
known time on the evicting turn.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from chatctx import ChatSession, Engine
from chatctx.store import Message

SLEEP_S = 0.3


def slow_summarizer(previous: str | None, messages: Sequence[Message]) -> str:
    time.sleep(SLEEP_S)
    return (previous or "") + f" {len(messages)} messages."


def test_ttft_is_measured_from_the_request(db_url: str, tiny_llama3_path: Path) -> None:
    with (
        Engine.load(tiny_llama3_path, n_ctx=512, n_seq_max=2) as engine,
        ChatSession.open(
            db_url,
            model=engine,
            settings={"max_tokens": 4, "temperature": 0.0},
            context={"budget": 160, "reserve": 8},
            summarizer=slow_summarizer,
        ) as chat,
    ):
        evicting = None
        for turn in range(12):
            t0 = time.perf_counter()
            stream = chat.stream(f"message {turn}: " + "words " * 20)
            first = None
            for _ in stream:
                first = first or time.perf_counter()
            t_end = time.perf_counter()
            reply = chat.last_reply
            assert reply is not None and reply.plan is not None
            t = reply.timings
            assert t.ttft_ms is not None and t.engine_ttft_ms is not None
            # Everything the session did before the engine's first token is inside TTFT ...
            assert t.ttft_ms >= t.build_ms + t.store_ms + t.engine_ttft_ms - 1.0
            # ... and TTFT never exceeds the wall time this test saw for the whole call.
            assert t.ttft_ms <= (t_end - t0) * 1000 + 1.0
            if first is not None:
                assert t.ttft_ms <= (first - t0) * 1000 + 1.0
            if reply.plan.evicted and reply.plan.summary_changed:
                evicting = reply
        assert evicting is not None, "no turn evicted: lower the budget"
        t = evicting.timings
        assert t.summary_ms >= SLEEP_S * 1000
        assert t.ttft_ms >= SLEEP_S * 1000  # the summary delayed the first token
        assert t.engine_ttft_ms is not None and t.engine_ttft_ms < t.ttft_ms - SLEEP_S * 900
        stored = chat.store.turns(chat.conversation_id)[-1]
        assert stored.build_ms is not None and stored.engine_ttft_ms is not None
