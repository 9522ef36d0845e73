"""The builder inside ChatSession: evictions, persisted summaries, failures, truncation."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from chatctx import ChatSession, ContextBudgetError, Engine, Store
from chatctx.cli import cli
from chatctx.context import SUMMARY_HEADER, SUMMARY_MORE
from chatctx.store import Message
from tests.llama_counters import counted, prime_counters

SMALL = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture
def engine(tiny_llama3_path: Path):
    with Engine.load(tiny_llama3_path, n_ctx=512, n_threads=1) as engine:
        yield engine


def chat_many(chat: ChatSession, n: int, start: int = 0) -> list:
    return [
        chat.send(f"Order NH-{5000 + i}: my router AX{i}00 drops wifi, case {i}.")
        for i in range(start, start + n)
    ]


def test_long_chat_evicts_and_persists_across_reopen(db_url: str, engine: Engine) -> None:
    with ChatSession.open(
        db_url,
        conversation_id="c",
        model=engine,
        system_prompt="Support.",
        settings=SMALL,
        context={"budget": 300},
    ) as chat:
        replies, recounts = [], []
        for i in range(25):
            replies += chat_many(chat, 1, start=i)
            assert chat.last_build is not None
            # Recounted with llama.cpp's tokenizer (the builder counts with tiktoken).
            recounts.append(len(engine.prompt_tokens(chat.last_build.messages)))
    evictions = [r for r in replies if r.plan.evicted]
    assert evictions, "a 25-turn chat at budget 300 must evict"
    assert [r.plan.prompt_tokens for r in replies] == recounts
    assert [r.usage.prompt_tokens for r in replies] == recounts
    assert max(recounts) <= 300
    with Store(db_url) as store:
        state = store.context_state("c")
        assert len(store.messages("c")) == 50  # the store keeps everything
        summaries = store.summaries("c")
        assert "NH-5000" in summaries[0].content  # the first eviction's facts
        assert state.summary is not None and state.summary.id == summaries[-1].id
        assert "NH-50" in state.summary.content  # bounded: the oldest facts go first
        turns = store.turns("c")
        assert [t.plan["prompt_tokens"] for t in turns] == [r.plan.prompt_tokens for r in replies]
    with ChatSession.open(db_url, conversation_id="c", model=engine) as chat:  # a restart
        plan = chat.plan("and one more question").plan
        assert plan.window_start == state.window_start
        summary_messages = [
            m for m in chat.plan("x").messages if m["content"].startswith(SUMMARY_HEADER)
        ]
        assert summary_messages == [
            {"role": "system", "content": SUMMARY_HEADER + state.summary.content}
        ]


def test_prefix_is_reused_between_evictions(db_url: str, engine: Engine) -> None:
    # llama.cpp's own count of the tokens it evaluated, read as each turn is recorded.
    prime_counters(engine)
    counts = [counted(engine)]
    with ChatSession.open(
        db_url,
        conversation_id="c",
        model=engine,
        settings=SMALL,
        context={"budget": 300},
        on_turn=lambda _turn: counts.append(counted(engine)),
    ) as chat:
        replies = chat_many(chat, 20)
    evaluated = [
        after - before - (r.usage.generated_tokens - (r.stop_reason == "length"))
        for r, before, after in zip(replies, counts[:-1], counts[1:], strict=True)
    ]
    assert [r.usage.evaluated_tokens for r in replies] == evaluated
    assert any(r.plan.evicted for r in replies)
    for before, after, n in zip(replies, replies[1:], evaluated[1:], strict=False):
        if not after.plan.evicted:
            # everything the previous turn prefilled came from the cache
            assert after.usage.prompt_tokens - n >= before.usage.prompt_tokens


def test_failing_summarizer_keeps_previous_summary(db_url: str, engine: Engine) -> None:
    calls: list[int] = []

    def flaky(previous: str | None, messages: Sequence[Message]) -> str:
        calls.append(len(messages))
        if len(calls) == 2:
            raise RuntimeError("model server exploded")
        return (previous or "") + f" [{len(messages)} msgs: {messages[0].content[:20]}]"

    with ChatSession.open(
        db_url,
        conversation_id="c",
        model=engine,
        settings=SMALL,
        context={"budget": 300},
        summarizer=flaky,
    ) as chat:
        replies = chat_many(chat, 30)
    plans = [r.plan for r in replies if r.plan.evicted]
    assert len(plans) >= 3
    failed = [p for p in plans if p.summary_error]
    assert len(failed) == 1 and "model server exploded" in failed[0].summary_error
    with Store(db_url) as store:
        summaries = store.summaries("c")
    assert all("exploded" not in s.content for s in summaries)
    # The failed eviction's messages were folded in by the next summary.
    failed_ids = set(failed[0].evicted_ids)
    after = plans[plans.index(failed[0]) + 1]
    assert failed_ids <= set(after.summarized_ids)
    assert len(summaries) == len(plans) - 1


def test_token_counts_are_cached_in_the_store(db_url: str, engine: Engine) -> None:
    with ChatSession.open(
        db_url, conversation_id="c", model=engine, settings=SMALL, context={"budget": 300}
    ) as chat:
        chat_many(chat, 14)
        fingerprint = chat.builder().codec.fingerprint
        ids = [m.id for m in chat.history()]
        messages = [m.to_openai() for m in chat.history()]
    with Store(db_url) as store:
        counts = store.get_token_counts(fingerprint, ids)
    # Recounted with llama.cpp's tokenizer: what each message adds to the rendered chat.
    lengths = [
        len(engine.prompt_tokens(messages[:n], add_generation_prompt=False))
        for n in range(len(messages) + 1)
    ]
    recount = dict(zip(ids, [b - a for a, b in itertools.pairwise(lengths)], strict=True))
    assert counts  # the messages counted so far (evicted turns, the latest replies)
    assert counts == {i: recount[i] for i in counts}
    assert fingerprint.startswith("tt-")


def test_oversized_message_raises_or_is_truncated(db_url: str, engine: Engine) -> None:
    huge = "alpha " * 2000 + "THE END"
    with ChatSession.open(
        db_url, conversation_id="c", model=engine, settings=SMALL, context={"budget": 300}
    ) as chat:
        with pytest.raises(ContextBudgetError, match="newest message does not fit"):
            chat.send(huge)
        assert chat.history() == []
    with ChatSession.open(
        db_url,
        conversation_id="c",
        model=engine,
        context={"budget": 300, "truncate_oversized": True},
    ) as chat:
        reply = chat.send(huge)
        assert reply.plan.truncated and reply.plan.prompt_tokens <= 300
        sent = chat.plan("next").messages  # the stored message stays whole
        assert chat.history()[0].content == huge
        assert all("THE END" not in m["content"] or "removed to fit" in m["content"] for m in sent)


def test_inspect_shows_plan_and_evictions(db_url: str, engine: Engine) -> None:
    with ChatSession.open(
        db_url, conversation_id="c", model=engine, settings=SMALL, context={"budget": 300}
    ) as chat:
        chat_many(chat, 15)
    result = CliRunner().invoke(cli, ["inspect", "c", "--db", db_url, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["current_plan"]["budget"] == 300
    assert report["evictions"] and report["evictions"][0]["reason"].startswith("prompt ")
    assert report["summary"]["content"]
    text = CliRunner().invoke(cli, ["inspect", "c", "--db", db_url])
    assert "current plan" in text.output and "evictions" in text.output
    missing = CliRunner().invoke(cli, ["inspect", "nope", "--db", db_url])
    assert missing.exit_code == 1 and "no conversation" in missing.output


def test_inspect_shows_the_summary_parts_of_the_append_layout(db_url: str, engine: Engine) -> None:
    # The engine edits in place, so "append" is asked for by name here. The parts inspect
    # lists are the summary messages the next prompt holds, one each (14 turns: two
    # evictions extend the summary after the last compaction).
    with ChatSession.open(
        db_url,
        conversation_id="c",
        model=engine,
        settings=SMALL,
        context={"budget": 300, "layout": "append"},
    ) as chat:
        chat_many(chat, 14)
        sent = [
            m
            for m in chat.plan("x").messages
            if m["content"].startswith((SUMMARY_HEADER, SUMMARY_MORE))
        ]
    report = json.loads(CliRunner().invoke(cli, ["inspect", "c", "--db", db_url, "--json"]).output)
    assert report["current_plan"]["layout"] == "append"
    blocks = report["summary"]["blocks"]
    assert len(blocks) == len(sent) >= 2, blocks
    text = CliRunner().invoke(cli, ["inspect", "c", "--db", db_url]).output
    assert "layout append" in text
    assert f"{len(blocks)} parts in the append layout" in text


def test_a_state_another_writer_saved_meanwhile_is_built_on_not_lost(
    db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process saves this conversation's context state (a new summary) between this
    # session's read of it and its own save: the compare-and-set save refuses, the context
    # is built again on top of the other writer's state, and nothing it wrote is lost.
    fact = "Customer said: my spare order is NH-9999."
    with (
        ChatSession.open(
            db_url,
            conversation_id="c",
            model=engine,
            system_prompt="Support.",
            settings=SMALL,
            context={"budget": 300},
        ) as chat,
        Store(db_url) as other,
    ):
        turn = 0
        while not chat.plan(f"Order NH-{5000 + turn}: case {turn}.").plan.evicted:
            chat_many(chat, 1, start=turn)
            turn += 1
            assert turn < 40, "the chat never reached an eviction"
        read = chat.store.context_inputs
        raced: list[int] = []

        def racing(conversation_id: str):  # type: ignore[no-untyped-def]
            inputs = read(conversation_id)
            state = inputs.state
            if not raced:  # the other writer adds a fact to the summary
                raced.append(state.version)
                summary = f"{state.summary.content} {fact}" if state.summary else fact
                count = engine.codec().count(summary)
                assert chat.last_build is not None
                other.save_context_state(
                    conversation_id,
                    window_start=state.window_start,
                    pending_ids=state.pending_ids,
                    new_summary=(summary, [], count, chat.last_build.fingerprint),
                )
            return inputs

        monkeypatch.setattr(chat.store, "context_inputs", racing)
        reply = chat.send(f"Order NH-{5000 + turn}: case {turn}.")
        assert reply.plan.evicted and raced
        state = other.context_state("c")
        assert state.version == raced[0] + 2  # the other writer's save and this one
        assert state.summary is not None and "NH-9999" in state.summary.content
