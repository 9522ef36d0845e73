"""The append layout: from one prompt to the next, text is only deleted in whole spans or
added at the end, so a cache that walks its runs in order (llama-server's n_cache_reuse)
keeps everything but the end.

Oracles: the previous prompt's own messages (what may be kept, in what order), a walk of
the cache written here the way llama-server's update_slots does it, hand-computed blocks and
plans, and the same conversation in the summary-first layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatctx.context import (
    RECALL_HEADER,
    SUMMARY_HEADER,
    SUMMARY_MORE,
    BuildResult,
    ContextBuilder,
    ContextState,
    ExtractiveSummarizer,
)
from chatctx.context._layout import MAX_BLOCKS, next_blocks, render
from chatctx.model.codec import TiktokenCodec
from chatctx.model.kv import plan_in_order
from chatctx.settings import ContextSettings
from chatctx.store import Message
from tests.walk import cut_of, kept_in, server_walk

from .strategies import text

SYSTEM = "You are the support assistant. Never ask for card numbers."
CHUNK = 16  # an n_cache_reuse the append layout holds up under
ABRIDGE_CHUNK = 4  # the n_cache_reuse LlamaServerBackend sends


def is_summary(message: dict[str, Any]) -> bool:
    return message["role"] == "system" and message["content"].startswith(
        (SUMMARY_HEADER, SUMMARY_MORE)
    )


def is_recall(message: dict[str, Any]) -> bool:
    return message["role"] == "system" and message["content"].startswith(RECALL_HEADER)


def summary_text(messages: Sequence[dict[str, Any]]) -> str:
    parts = [m["content"] for m in messages if is_summary(m)]
    return "\n".join(
        p.removeprefix(SUMMARY_HEADER) if p.startswith(SUMMARY_HEADER) else p[len(SUMMARY_MORE) :]
        for p in parts
    )


def recent_search(history: list[Message]):
    """Recall stand-in: the most recent evicted messages (the builder's ranking is not
    what is tested here)."""

    def search(query: str, before: int, limit: int) -> list[tuple[Message, float]]:
        found = [m for m in reversed(history) if m.position < before][:limit]
        return [(m, 1.0 - i / 100) for i, m in enumerate(found)]

    return search


def user_text(turn: int, size: int) -> str:
    # A new identifier every few turns: most evictions have something to add to the summary.
    # Some in the middle of the message, where the abridge layout cuts around them.
    fact = f"My ticket is TK-{turn:04d}{size % 10}. " if turn % 3 == 0 else ""
    if turn % 4 == 1:
        return (
            f"{CHAT[turn % len(CHAT)]} My dog is called Rex{turn}. {CHAT[(turn + 1) % len(CHAT)]}"
        )
    return fact + " ".join(CHAT[(turn + i) % len(CHAT)] for i in range(size // 12 + 1))


CHAT = (
    "The weather was lovely today and we walked by the river for an hour.",
    "Work has been busy, lots of meetings about the quarterly plan.",
    "We are thinking about repainting the kitchen in a light green.",
    "The bakery on the corner has a new sourdough that is really good.",
    "I watched a documentary about volcanoes last night, quite fascinating.",
)


def converse(
    codec: TiktokenCodec,
    layout: str,
    turns: Sequence[tuple[int, int]],
    budget: int,
    *,
    recall: bool,
    max_summary: int,
    low: float = 0.6,
):
    """Yield (result, cached tokens before it, history before it) for each turn."""
    config = ContextSettings(
        low=low,
        recall=recall,
        recall_trigger="always",
        recall_budget=max(16, budget // 6),
    )
    history: list[Message] = []
    builder = ContextBuilder(
        codec,
        config,
        summarizer=ExtractiveSummarizer(codec.count, max_tokens=max_summary),
        recall=recent_search(history) if recall else None,
        layout=layout,
        lookup=lambda ids: [m for m in history if m.id in set(ids)],
        min_chunk=CHUNK if layout != "abridge" else ABRIDGE_CHUNK,
    )
    state = ContextState()
    cached: list[int] = []
    for number, (user_size, reply_size) in enumerate(turns):
        user, reply = user_text(number, user_size), text(reply_size, number + 50)
        result = builder.build(
            system_prompt=SYSTEM, history=history, new_message=user, budget=budget, state=state
        )
        yield result, cached, list(history)
        state = result.state
        for role, content in (("user", user), ("assistant", reply)):
            n = len(history)
            history.append(
                Message(id=n + 1, conversation_id="c", position=n, role=role, content=content)
            )
        # What the server holds after the turn: the prompt, the reply, its end of turn.
        cached = codec.prompt_tokens(
            [*result.messages, {"role": "assistant", "content": reply}],
            add_generation_prompt=False,
        )


def conversations(examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Random conversations (message and reply sizes), budgets, recall on or off, low
    watermarks."""
    cases = given(
        turns=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 120)), min_size=2, max_size=30),
        budget=st.integers(320, 900),
        recall=st.booleans(),
        low=st.floats(0.3, 0.8),
    )
    limits = settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    return lambda test: limits(cases(test))


def new_tail(codec: TiktokenCodec, result: BuildResult, before: Sequence[dict[str, Any]]) -> int:
    """Tokens of the messages at the end of the prompt that the cache cannot hold: those
    not in the previous prompt and its reply (a new summary block, recall, the message)."""
    messages = result.messages
    k = len(messages)
    while k > 0 and messages[k - 1] not in before:
        k -= 1
    return len(result.tokens) - len(codec.prompt_tokens(messages[:k], add_generation_prompt=False))


@conversations(300)
def test_append_layout_only_deletes_spans_and_appends(
    llama3_codec: TiktokenCodec,
    turns: list[tuple[int, int]],
    budget: int,
    recall: bool,
    low: float,
) -> None:
    codec = llama3_codec
    previous: list[dict[str, Any]] | None = None
    for number, (result, cached, history) in enumerate(
        converse(codec, "append", turns, budget, recall=recall, max_summary=budget // 3, low=low)
    ):
        plan = result.plan
        assert plan.layout == "append"
        assert len(codec.prompt_tokens(result.messages)) == plan.prompt_tokens <= budget
        assert sum(v for k, v in plan.sections.items() if k != "reserve") == plan.prompt_tokens
        if result.state.summary and not plan.summary_omitted:
            # The summary sent is the summary kept, whole.
            assert summary_text(result.messages) == result.state.summary
        if previous is None:
            previous = result.messages
            continue
        # Message level: what is kept comes from the previous prompt and its reply, in
        # order; what is not is at the end, closed by the new message.
        # (A recall section is sent anew each turn, even one that repeats the last one.)
        before = [m for m in [*previous, history[-1].to_openai()] if not is_recall(m)]
        # The last message is the new one, even where its text repeats an earlier message's
        # (kept_in matches by content).
        assert result.messages[-1] == {
            "role": "user",
            "content": user_text(number, turns[number][0]),
        }
        found = [*kept_in(result.messages[:-1], before), None]
        k = len(found)
        while k > 0 and found[k - 1] is None:
            k -= 1
        assert None not in found[:k], found
        assert result.messages[-1]["role"] == "user" and found[-1] is None
        # Token level: llama-server keeps all but that end, save kept runs shorter than its
        # chunk (the walk written above is the oracle, not chatctx's plan_in_order).
        kept = [j for j in found[:k] if j is not None]
        runs = 1 + sum(1 for a, b in itertools.pairwise(kept) if b != a + 1)
        tail = len(result.tokens) - len(
            codec.prompt_tokens(result.messages[:k], add_generation_prompt=False)
        )
        kept_tokens = server_walk(cached, result.tokens, CHUNK)
        assert kept_tokens >= len(result.tokens) - tail - CHUNK * runs - 1
        previous = result.messages


def test_append_keeps_kept_turns_where_summary_first_loses_them(
    llama3_codec: TiktokenCodec,
) -> None:
    # The same conversation both ways, walked as llama-server walks its cache: on every
    # eviction turn the summary-first prompt re-evaluates the kept turns behind the changed
    # summary; the append one evaluates its end only.
    codec = llama3_codec
    turns = [(30 + (7 * i) % 40, 20 + (11 * i) % 30) for i in range(40)]
    cost = {}
    evictions = {}
    for layout in ("summary-first", "append"):
        evaluated = evicting = 0
        for result, cached, _ in converse(codec, layout, turns, 800, recall=False, max_summary=150):
            evaluated += len(result.tokens) - server_walk(cached, result.tokens, CHUNK)
            evicting += result.plan.evicted
        cost[layout], evictions[layout] = evaluated, evicting
    assert evictions["append"] >= 3 and evictions["summary-first"] >= 3
    assert cost["append"] * 1.5 < cost["summary-first"], cost


def test_first_summary_goes_after_the_kept_turns(llama3_codec: TiktokenCodec) -> None:
    codec = llama3_codec
    turns = [(30, 30)] * 12
    for result, _, history in converse(codec, "append", turns, 500, recall=False, max_summary=150):  # noqa: B007
        if result.plan.evicted and result.state.summary:
            break
    else:
        pytest.fail("no eviction")
    messages = result.messages
    # system, the kept turns as stored, the summary block, the new message: hand-built.
    kept = [m.to_openai() for m in history if m.position >= result.state.window_start]
    assert kept
    assert messages == [
        {"role": "system", "content": SYSTEM},
        *kept,
        {"role": "system", "content": SUMMARY_HEADER + result.state.summary},
        messages[-1],
    ]
    assert result.state.summary_blocks == ((0, history[-1].position),)
    # history_start: where the first kept turn begins (no summary in front of it yet).
    front = codec.prompt_tokens([messages[0]], add_generation_prompt=False)
    assert result.plan.history_start == len(front)


def test_blocks_extend_then_start_over() -> None:
    # Hand-computed block lists.
    assert next_blocks(None, (), "Facts: A", 9) == ((0, 9),)
    assert next_blocks("Facts: A", ((0, 9),), "Facts: A\nUser: b", 15) == ((0, 9), (8, 15))
    # A summary from the summary-first layout (no blocks) is one block up front.
    assert next_blocks("Facts: A", (), "Facts: A\nUser: b", 15) == ((0, -1), (8, 15))
    # A rewrite is one block where it was written.
    assert next_blocks("Facts: A\nUser: b", ((0, 9), (8, 15)), "Facts: A; C", 30) == ((0, 30),)
    full = tuple((i, i * 10) for i in range(MAX_BLOCKS))
    assert next_blocks("x" * MAX_BLOCKS, full, "x" * MAX_BLOCKS + "\ny", 99) == ((0, 99),)
    assert next_blocks("a", ((0, 3),), "", 5) == ()
    summary = "Facts: A\nUser: b"
    assert render(summary, ((0, 9), (8, 15)), "append") == [
        (9, SUMMARY_HEADER + "Facts: A"),
        (15, SUMMARY_MORE + "User: b"),
    ]
    assert render(summary, ((0, 9), (8, 15)), "summary-first") == [(-1, SUMMARY_HEADER + summary)]


def test_plan_in_order_matches_the_server_walk() -> None:
    # Hand-computed: a deleted span is stepped over, inserted text stops the walk.
    cached = list(range(100))
    deleted = [*range(10), *range(40, 100), 500, 501]
    plan = plan_in_order(cached, deleted, min_chunk=16)
    assert (plan.prefix, plan.chunks, plan.dest) == (10, ((40, 100),), 10)
    assert plan.moves() == [(40, 100, -30)]
    inserted = [*range(10), 700, *range(40, 100), 500]
    assert plan_in_order(cached, inserted, min_chunk=16).chunks == ()
    short = [*range(10), *range(40, 50), 500]  # a run under the chunk size
    assert plan_in_order(cached, short, min_chunk=16).chunks == ()
    assert plan_in_order(cached, short, min_chunk=8).chunks == ((40, 50),)
    assert plan_in_order(cached, deleted, min_chunk=0).chunks == ()
    # The prompt's last token is always evaluated.
    same = plan_in_order(cached, cached, min_chunk=16)
    assert same.prefix + same.chunk_len == 99
    tail = [*range(10), *range(40, 100)]
    walked = plan_in_order(cached, tail, min_chunk=16)
    assert walked.prefix + walked.chunk_len == len(tail) - 1 == server_walk(cached, tail, 16)


@conversations(120)
def test_abridge_layout_only_deletes_text(
    llama3_codec: TiktokenCodec,
    turns: list[tuple[int, int]],
    budget: int,
    recall: bool,
    low: float,
) -> None:
    codec = llama3_codec
    previous: list[dict[str, Any]] | None = None
    omitted = False
    for result, cached, history in converse(
        codec, "abridge", turns, budget, recall=recall, max_summary=budget // 3, low=low
    ):
        plan = result.plan
        assert plan.layout == "abridge" and not any(is_summary(m) for m in result.messages)
        assert len(codec.prompt_tokens(result.messages)) == plan.prompt_tokens <= budget
        if previous is None or omitted:
            # (A prompt with no room for the summary left the cuts out: they come back.)
            previous, omitted = result.messages, plan.summary_omitted
            continue
        omitted = plan.summary_omitted
        said = [m.to_openai() for m in history]
        before = [m for m in [*previous, said[-1]] if not is_recall(m)]
        # Each message is one the cache held, or one of the history cut down, up to the end.
        old = [
            m in before
            or any(m["role"] == h["role"] and cut_of(m["content"], h["content"]) for h in said)
            for m in result.messages[:-1]
        ]
        k = len(old)
        while k > 0 and not old[k - 1]:
            k -= 1
        assert all(old[:k])
        tail = len(result.tokens) - len(
            codec.prompt_tokens(result.messages[:k], add_generation_prompt=False)
        )
        # Token level, with llama-server's walk written apart (the oracle): all of it kept.
        assert server_walk(cached, result.tokens, ABRIDGE_CHUNK) >= len(result.tokens) - tail - 1
        previous = result.messages
