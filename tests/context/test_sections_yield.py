"""Optional sections give way before the newest message fails: recall first, then the summary,
and only then ContextBudgetError (or truncation). Token counts are the oracle's own: the
expected messages rendered with the codec."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chatctx.context import SUMMARY_HEADER, ContextBuilder, ContextState, ExtractiveSummarizer
from chatctx.errors import ContextBudgetError
from chatctx.model.codec import TiktokenCodec
from chatctx.settings import ContextSettings
from chatctx.store import Store

SYSTEM = "You are a helpful assistant."
SUMMARY = "User: my name is Maria, order NH-48213 is late, I live in Porto. " * 3


@pytest.fixture
def store() -> Iterator[Store]:
    with Store("sqlite://") as store:
        store.create_conversation("c")
        store.add_messages(
            "c",
            [
                {"role": "user", "content": "Remember that my dog is called Biscuit."},
                {"role": "assistant", "content": "Biscuit, what a lovely name for a dog."},
            ],
        )
        yield store


def make(codec: TiktokenCodec, store: Store | None = None, **settings: object) -> ContextBuilder:
    return ContextBuilder(
        codec,
        ContextSettings(**settings),  # type: ignore[arg-type]
        summarizer=ExtractiveSummarizer(codec.count),
        recall=(
            None
            if store is None
            else lambda q, before, k: store.search_messages(
                "c", q, before_position=before, limit=k, replies=True
            )
        ),
    )


def count(codec: TiktokenCodec, *messages: dict[str, str]) -> int:
    return len(codec.prompt_tokens(list(messages)))


def system() -> dict[str, str]:
    return {"role": "system", "content": SYSTEM}


def summary() -> dict[str, str]:
    return {"role": "system", "content": SUMMARY_HEADER + SUMMARY}


def state_with_summary(codec: TiktokenCodec) -> ContextState:
    return ContextState(window_start=2, summary=SUMMARY, summary_tokens=count(codec, summary()) - 1)


def test_message_that_fits_alone_is_sent_without_the_summary(
    llama3_codec: TiktokenCodec,
) -> None:
    new = {"role": "user", "content": "Here is my long story. " * 40}
    alone = count(llama3_codec, system(), new)
    with_summary = count(llama3_codec, system(), summary(), new)
    assert alone < with_summary
    budget = (alone + with_summary) // 2  # fits alone, not with the summary
    built = make(llama3_codec).build(
        system_prompt=SYSTEM,
        history=[],
        new_message=new["content"],
        budget=budget,
        state=state_with_summary(llama3_codec),
    )
    plan = built.plan
    assert built.messages == [system(), new]
    assert plan.prompt_tokens == alone == len(built.tokens)
    assert plan.summary_omitted and plan.yielded == ["summary"]
    assert plan.sections["summary"] == 0 and plan.history_start == plan.sections["system"]
    assert built.state.summary == SUMMARY  # left out of this prompt only, not forgotten
    # Next turn, with room again, the summary is back.
    roomy = make(llama3_codec).build(
        system_prompt=SYSTEM,
        history=[],
        new_message="short",
        budget=budget,
        state=built.state,
    )
    assert roomy.messages[1] == summary() and not roomy.plan.summary_omitted


def test_recall_gives_way_before_the_summary(llama3_codec: TiktokenCodec, store: Store) -> None:
    question = "What is my dog called again?"
    new = {"role": "user", "content": question}
    base = count(llama3_codec, system(), summary(), new)
    state = state_with_summary(llama3_codec)
    roomy = make(llama3_codec, store).build(
        system_prompt=SYSTEM, history=[], new_message=question, budget=base + 200, state=state
    )
    assert roomy.plan.recalled_ids and "Biscuit" in roomy.messages[-2]["content"]
    # Room for the summary and the message, not for recall: recall goes, the summary stays.
    tight = make(llama3_codec, store).build(
        system_prompt=SYSTEM, history=[], new_message=question, budget=base, state=state
    )
    assert tight.messages == [system(), summary(), new]
    assert tight.plan.prompt_tokens == base
    assert tight.plan.yielded == ["recall"] and not tight.plan.summary_omitted
    # Less room still: both give way, recall first.
    tighter = make(llama3_codec, store).build(
        system_prompt=SYSTEM, history=[], new_message=question, budget=base - 1, state=state
    )
    assert tighter.messages == [system(), new]
    assert tighter.plan.yielded == ["recall", "summary"]
    assert tighter.plan.prompt_tokens == count(llama3_codec, system(), new)


def test_message_that_does_not_fit_alone_raises_or_is_truncated(
    llama3_codec: TiktokenCodec,
) -> None:
    text = "word " * 400
    alone = count(llama3_codec, system(), {"role": "user", "content": text})
    budget = alone - 50
    with pytest.raises(ContextBudgetError, match="newest message does not fit") as info:
        make(llama3_codec).build(
            system_prompt=SYSTEM,
            history=[],
            new_message=text,
            budget=budget,
            state=state_with_summary(llama3_codec),
        )
    assert info.value.prompt_tokens == alone  # the figure without the summary it dropped
    cut = make(llama3_codec, truncate_oversized=True).build(
        system_prompt=SYSTEM,
        history=[],
        new_message=text,
        budget=budget,
        state=state_with_summary(llama3_codec),
    )
    assert cut.plan.truncated and cut.plan.summary_omitted
    assert cut.plan.prompt_tokens == count(llama3_codec, *cut.messages) <= budget
    assert cut.messages[0] == system() and len(cut.messages) == 2
