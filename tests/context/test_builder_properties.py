"""The trimming rules as properties, each checked over at least 1,000 generated histories."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatctx.config import ContextSettings
from chatctx.context import ContextBuilder, ContextState, ExtractiveSummarizer
from chatctx.engine._codec import TiktokenCodec
from chatctx.errors import ContextBudgetError
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
    codec: TiktokenCodec, policy: str, summarize: bool, budget: int, low: float = 0.6
) -> ContextBuilder:
    config = ContextSettings(
        policy=policy, low=low, summarizer="extractive" if summarize else "none"
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
        # Rule 3: raised only when the system prompt and the newest message alone cannot fit
        # (plus, with summaries, the summary that replaced the evicted turns).
        alone = len(codec.prompt_tokens([*head, {"role": "user", "content": new_text}]))
        assert alone > budget or summarize
        assert history == snapshot
        return
    plan = result.plan
    # Exact: the plan's count is the rendered prompt's length, within the budget.
    assert len(result.tokens) == plan.prompt_tokens <= budget
    assert codec.prompt_tokens(result.messages) == result.tokens
    assert sum(v for k, v in plan.sections.items() if k != "reserve") == plan.prompt_tokens
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


def builder_summary(result: object) -> bool:
    messages = result.messages  # type: ignore[attr-defined]
    return any(
        m["role"] == "system" and m["content"].startswith("Summary of the earlier")
        for m in messages
    )


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
    for number, (user_size, reply_size) in enumerate(turns):
        user, reply = text(user_size, number), text(reply_size, number + 50)
        try:
            result = builder.build(
                system_prompt=SYSTEM, history=history, new_message=user, budget=budget, state=state
            )
        except ContextBudgetError:
            return
        plan = result.plan
        if previous is not None and not plan.evicted:
            assert result.tokens[: len(previous)] == previous
        if plan.evicted:
            assert plan.prompt_tokens <= budget
        else:
            assert plan.prompt_tokens <= int(high * budget) or plan.prompt_tokens <= budget
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
