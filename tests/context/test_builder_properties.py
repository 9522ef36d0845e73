"""The trimming rules as properties, each checked over at least 1,000 generated histories."""

from __future__ import annotations

import copy
import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatctx.context import (
    SUMMARY_HEADER,
    BuildResult,
    ContextBuilder,
    ContextState,
    ExtractiveSummarizer,
)
from chatctx.errors import ContextBudgetError
from chatctx.model.codec import TiktokenCodec
from chatctx.settings import ContextSettings
from chatctx.store import Message

from .strategies import histories, sizes, text

EXAMPLES = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
SYSTEM = "You are the support assistant. Never ask for card numbers."


def make_builder(
    codec: TiktokenCodec,
    policy: str,
    summarize: bool,
    budget: int,
    low: float = 0.6,
    keep: int | None = None,
) -> ContextBuilder:
    # The turn rules are checked with tool results never cleared (``keep`` None); clearing
    # has its own properties below.
    config = ContextSettings(
        policy=policy,
        low=low,
        summarizer="extractive" if summarize else "none",
        tool_results_keep=keep,
    )
    summarizer = (
        ExtractiveSummarizer(codec.count, max_tokens=max(16, budget // 4)) if summarize else None
    )
    return ContextBuilder(codec, config, summarizer=summarizer)


@EXAMPLES
@given(
    history=histories(),
    budget=st.integers(8, 6000),
    new_size=sizes,
    policy=st.sampled_from(["watermarks", "trim-every-turn"]),
    summarize=st.booleans(),
    system=st.booleans(),
    low=st.floats(0.1, 1.0),
)
def test_single_build_invariants(
    llama3_codec: TiktokenCodec,
    history: list[Message],
    budget: int,
    new_size: int,
    policy: str,
    summarize: bool,
    system: bool,
    low: float,
) -> None:
    codec = llama3_codec
    builder = make_builder(codec, policy, summarize, budget, low)
    snapshot = copy.deepcopy(history)
    new_text = text(new_size, 999)
    head = [{"role": "system", "content": SYSTEM}] if system else []
    try:
        result = builder.build(
            system_prompt=SYSTEM if system else None,
            history=history,
            new_message=new_text,
            budget=budget,
        )
    except ContextBudgetError:
        # Rule 3: raised only when the system prompt and the newest message alone do not fit
        # (counted here by rendering just those two).
        alone = len(codec.prompt_tokens([*head, {"role": "user", "content": new_text}]))
        assert alone > budget
        assert history == snapshot
        return
    plan = result.plan
    # Exact, recounted: the chosen messages rendered and encoded again are the prompt sent,
    # and it fits the budget.
    assert codec.prompt_tokens(result.messages) == result.tokens
    assert len(result.tokens) == plan.prompt_tokens <= budget
    # Where the engine is told the kept turns begin: after the system prompt and summary,
    # as rendering just those messages gives.
    n_fixed = len(head) + (1 if builder_summary(result) else 0)
    fixed = len(codec.prompt_tokens(result.messages[:n_fixed], add_generation_prompt=False))
    assert plan.history_start == fixed  # BOS included when the template opens with it
    # The high watermark (1.0 of the budget here): nothing is evicted while everything fits;
    # an eviction goes down to the low one, when the newest message leaves room for that.
    everything = [*head, *(m.to_openai() for m in history), {"role": "user", "content": new_text}]
    full = len(codec.prompt_tokens(everything))
    assert plan.evicted == (full > budget)
    low_limit = budget if policy == "trim-every-turn" else math.floor(low * budget)
    if plan.evicted:
        floor = len(codec.prompt_tokens([*head, {"role": "user", "content": new_text}]))
        # The summary written for the evicted turns comes on top (bounded by the budget).
        unsummarized = [m for m in result.messages if not is_summary(m)]
        assert len(codec.prompt_tokens(unsummarized)) <= low_limit or floor > low_limit
    # Rule 1: the system prompt comes first, intact.
    if system:
        assert result.messages[0] == {"role": "system", "content": SYSTEM}
    # Rule 3: the newest user message is last and whole.
    assert result.messages[-1] == {"role": "user", "content": new_text}
    # Rule 2 and order: kept messages are a suffix of whole turns, in stored order.
    ids = [m.id for m in history]
    kept = plan.kept_ids
    assert kept == ids[len(ids) - len(kept) :]
    by_id = {m.id: m for m in history}
    if plan.evicted and kept:
        assert by_id[kept[0]].role == "user"
    sent_history = result.messages[len(head) + (1 if builder_summary(result) else 0) : -1]
    assert sent_history == [by_id[i].to_openai() for i in kept]
    kept_calls = {c["id"] for i in kept for c in (by_id[i].tool_calls or [])}
    for i in kept:
        if by_id[i].role == "tool":
            assert by_id[i].tool_call_id in kept_calls
    assert sorted(kept + plan.evicted_ids) == ids
    # Rule 4: the stored history is untouched.
    assert history == snapshot
    # The naive policy keeps as much as fits: one more turn would not.
    if policy == "trim-every-turn" and not summarize and plan.evicted and plan.evicted_ids:
        back = ids.index(kept[0]) if kept else len(ids)
        start = back - 1
        while start > 0 and by_id[ids[start]].role != "user":
            start -= 1
        more = [by_id[i].to_openai() for i in ids[start:]]
        assert (
            len(codec.prompt_tokens([*head, *more, {"role": "user", "content": new_text}])) > budget
        )


def is_summary(message: dict[str, Any]) -> bool:
    return message["role"] == "system" and message["content"].startswith(SUMMARY_HEADER)


def builder_summary(result: BuildResult) -> bool:
    return any(is_summary(m) for m in result.messages)


@EXAMPLES
@given(
    turns=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 160)), min_size=2, max_size=14),
    budget=st.integers(200, 1500),
    summarize=st.booleans(),
    high=st.floats(0.7, 1.0),
    low=st.floats(0.2, 0.7),
)
def test_prefix_stability_between_evictions(
    llama3_codec: TiktokenCodec,
    turns: list[tuple[int, int]],
    budget: int,
    summarize: bool,
    high: float,
    low: float,
) -> None:
    # Rule 5: between evictions, each prompt extends the previous prompt plus its reply.
    codec = llama3_codec
    config = ContextSettings(high=high, low=low, summarizer="extractive" if summarize else "none")
    builder = ContextBuilder(
        codec,
        config,
        summarizer=ExtractiveSummarizer(codec.count, max_tokens=budget // 4) if summarize else None,
    )
    history: list[Message] = []
    state = ContextState()
    previous: list[int] | None = None
    head = {"role": "system", "content": SYSTEM}
    for number, (user_size, reply_size) in enumerate(turns):
        user, reply = text(user_size, number), text(reply_size, number + 50)
        new = {"role": "user", "content": user}
        try:
            result = builder.build(
                system_prompt=SYSTEM, history=history, new_message=user, budget=budget, state=state
            )
        except ContextBudgetError:
            # Only when the system prompt and the new message alone do not fit.
            assert len(codec.prompt_tokens([head, new])) > budget
            return
        plan = result.plan
        if previous is not None and not plan.evicted:
            assert result.tokens[: len(previous)] == previous
        assert len(codec.prompt_tokens(result.messages)) == plan.prompt_tokens <= budget
        # The high watermark, recounted: what would be sent without evicting anything now
        # (the summary so far, every message since the window start, the new message).
        summary = (
            [{"role": "system", "content": SUMMARY_HEADER + state.summary}] if state.summary else []
        )
        window = [m.to_openai() for m in history if m.position >= state.window_start]
        full = len(codec.prompt_tokens([head, *summary, *window, new]))
        high_limit = math.floor(high * budget)
        assert plan.evicted == (full > high_limit), (full, high_limit)
        if plan.evicted:
            # Down to the low watermark when the new message leaves room for that; a summary
            # that grew on this eviction comes on top of it.
            floor = len(codec.prompt_tokens([head, *summary, new]))
            kept = [m for m in result.messages if not is_summary(m)]
            kept[1:1] = summary
            assert len(codec.prompt_tokens(kept)) <= math.floor(low * budget) or floor > math.floor(
                low * budget
            )
        state = result.state
        for role, content in (("user", user), ("assistant", reply)):
            n = len(history)
            history.append(
                Message(id=n + 1, conversation_id="c", position=n, role=role, content=content)
            )
        # What the model cached: the prompt, then the reply and the template's end of turn.
        previous = codec.prompt_tokens(
            [*result.messages, {"role": "assistant", "content": reply}], add_generation_prompt=False
        )


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    history=histories(),
    budget=st.integers(200, 4000),
    new_size=sizes,
    keep=st.integers(0, 3),
    low=st.floats(0.2, 0.9),
)
def test_old_tool_results_are_cleared_before_whole_turns_go(
    llama3_codec: TiktokenCodec,
    history: list[Message],
    budget: int,
    new_size: int,
    keep: int,
    low: float,
) -> None:
    codec = llama3_codec
    builder = make_builder(codec, "watermarks", False, budget, low, keep=keep)
    new_text = text(new_size, 999)
    try:
        result = builder.build(
            system_prompt=SYSTEM, history=history, new_message=new_text, budget=budget
        )
    except ContextBudgetError:
        return
    plan = result.plan
    by_id = {m.id: m for m in history}
    cleared = set(result.state.cleared_ids)
    results = [m for m in history if m.role == "tool"]
    newest = {m.id for m in results[len(results) - keep :]} if keep else set()
    minimum = ContextSettings().tool_result_clear_min
    # Only old tool results, never the newest `keep`, never short ones, never another role.
    for i in cleared:
        assert by_id[i].role == "tool" and i not in newest
        alone = len(codec.prompt_tokens([{"role": "tool", "content": by_id[i].content}]))
        assert alone >= minimum // 2  # the stub would save little under the minimum
    # What is sent: the kept messages, a cleared result as a stub with its call id that
    # names the call and says nothing of the result; everything else as stored.
    sent = result.messages[1:-1]
    assert len(sent) == len(plan.kept_ids)
    for message, i in zip(sent, plan.kept_ids, strict=True):
        stored = by_id[i]
        if i in cleared:
            assert message["role"] == "tool" and message["tool_call_id"] == stored.tool_call_id
            assert str(stored.tool_call_id) in message["content"]
            assert stored.content not in message["content"]
        else:
            assert message == stored.to_openai()
    # The prompt, recounted, is what was sent, and it fits.
    assert codec.prompt_tokens(result.messages) == result.tokens
    assert len(result.tokens) <= budget
    # Whole turns go only once every old result still kept that could be cleared is.
    if plan.evicted:
        for i in plan.kept_ids:
            m = by_id[i]
            if m.role == "tool" and i not in newest and i not in cleared:
                alone = len(codec.prompt_tokens([{"role": "tool", "content": m.content}]))
                assert alone < minimum * 2  # short: never worth a stub
    # Nothing is cleared while the whole history fits under the high watermark.
    everything = [
        {"role": "system", "content": SYSTEM},
        *(m.to_openai() for m in history),
        {"role": "user", "content": new_text},
    ]
    if len(codec.prompt_tokens(everything)) <= budget:
        assert not cleared and not plan.evicted
