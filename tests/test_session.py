import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chatctx import ChatSession, ContextBudgetError, Engine, GenerationSettings, Store
from chatctx.errors import ConfigError
from tests.llama_counters import counted, prime_counters


@pytest.mark.slow
def test_two_turns_with_smollm2_then_reopen_in_a_new_process(
    db_url: str, smol_engine: Engine
) -> None:
    prime_counters(smol_engine)
    # llama.cpp's count of the tokens it evaluated during each turn, read when it is recorded.
    counts = [counted(smol_engine)]
    with ChatSession.open(
        db_url,
        conversation_id="cust-42",
        model=smol_engine,
        system_prompt="You are a helpful support agent.",
        settings={"max_tokens": 24, "seed": 7},
        on_turn=lambda _turn: counts.append(counted(smol_engine)),
    ) as chat:
        first = chat.send("Hi! My order 1234 has not arrived.")
        second = chat.send("Can you check it again?")
    assert first.text.strip() and second.text.strip()
    code = f"""
from chatctx import ChatSession
with ChatSession.open({db_url!r}, conversation_id="cust-42") as chat:
    print(len(chat.history()), chat.settings.max_tokens, repr(chat.system_prompt))
    reply = chat.send("Thanks, bye.")
    print(len(chat.history()), bool(reply.text.strip()))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert out == ["4 24 'You are a helpful support agent.'", "6 True"]
    with Store(db_url) as store:
        roles = [m.role for m in store.messages("cust-42")]
        turns = store.turns("cust-42")
    assert roles == ["user", "assistant"] * 3
    assert len(turns) == 3
    # Each in-process turn: llama.cpp evaluated the turn's evaluated tokens, then fed back
    # every generated token but one sampled at the length limit.
    for turn, before, after in zip(turns[:2], counts[:2], counts[1:], strict=True):
        decoded = turn.generated_tokens - (turn.stop_reason == "length")
        assert after - before == turn.evaluated_tokens + decoded
    # The second prompt extends the first: all of the first was taken from the cache.
    assert second.usage.prompt_tokens - turns[1].evaluated_tokens >= first.usage.prompt_tokens


def test_interrupted_stream_keeps_user_and_partial_reply(
    db_url: str, llama3_engine: Engine
) -> None:
    with ChatSession.open(
        db_url,
        conversation_id="c",
        model=llama3_engine,
        settings={"max_tokens": 50, "temperature": 0.0},
    ) as chat:
        stream = chat.stream("Tell me a long story")
        next(stream)
        stream.close()
        history = chat.history()
        assert chat.last_reply is not None
        assert chat.last_reply.stop_reason == "interrupted"
    assert [(m.role, m.status) for m in history] == [("user", "complete"), ("assistant", "partial")]
    assert history[0].content == "Tell me a long story"
    assert history[1].content


def test_user_message_is_committed_before_generation(db_url: str, llama3_engine: Engine) -> None:
    with ChatSession.open(
        db_url, conversation_id="c", model=llama3_engine, settings={"max_tokens": 5}
    ) as chat:
        stream = chat.stream("first")
        next(stream)
        with Store(db_url) as other:  # a second connection sees it mid-stream
            assert [m.content for m in other.messages("c")] == ["first"]
        for _ in stream:
            pass


def test_history_that_does_not_fit_raises_and_stores_nothing(
    db_url: str, tiny_llama3_path: Path
) -> None:
    with (
        Engine.load(tiny_llama3_path, n_ctx=256) as engine,
        ChatSession.open(
            db_url, conversation_id="c", model=engine, settings={"max_tokens": 64}
        ) as chat,
    ):
        with pytest.raises(ContextBudgetError, match="budget 192") as info:
            chat.send("word " * 300)
        prompt = engine.prompt_tokens([{"role": "user", "content": "word " * 300}])
        assert info.value.budget == 192 and info.value.prompt_tokens == len(prompt)
        assert chat.history() == []


def test_settings_and_system_prompt_are_stored(db_url: str, llama3_engine: Engine) -> None:
    with ChatSession.open(
        db_url,
        conversation_id="c",
        model=llama3_engine,
        system_prompt="sys",
        settings=GenerationSettings(max_tokens=3),
    ):
        pass
    with ChatSession.open(db_url, conversation_id="c", model=llama3_engine) as chat:
        assert chat.settings.max_tokens == 3
        assert chat.system_prompt == "sys"
        reply = chat.send("hi")
        # The random-weight model never samples an end of turn here: the limit stops it.
        assert (reply.stop_reason, reply.usage.generated_tokens) == ("length", 3)
        assert chat.plan("next").messages[0] == {"role": "system", "content": "sys"}


def test_bad_input(db_url: str, llama3_engine: Engine) -> None:
    with pytest.raises(ConfigError, match="generation settings"):
        ChatSession.open(db_url, model=llama3_engine, settings={"max_tokens": 0})
    with ChatSession.open(db_url, model=llama3_engine) as chat:
        with pytest.raises(ConfigError, match="empty"):
            chat.send("   ")
        assert chat.history() == []


def test_astream_runs_before_in_its_worker_thread_ahead_of_the_turn(
    db_url: str, llama3_engine: Engine
) -> None:
    import asyncio
    import threading

    threads: list[str] = []

    def add_earlier() -> None:
        threads.append(threading.current_thread().name)
        chat.store.add_messages(
            "c", [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}]
        )

    def refuse() -> None:
        raise ConfigError("refused before the turn")

    async def turn(text: str, before: Any) -> str:
        return "".join([chunk async for chunk in chat.astream(text, before=before)])

    with ChatSession.open(
        db_url, conversation_id="c", model=llama3_engine, settings={"max_tokens": 3}
    ) as chat:
        text = asyncio.run(turn("now", add_earlier))
        # What ``before`` stored comes ahead of the turn's user message; it ran off the loop.
        assert [m.content for m in chat.history()] == ["earlier", "ok", "now", text]
        assert threads == ["chatctx-astream"]
        with pytest.raises(ConfigError, match="refused before the turn"):
            asyncio.run(turn("never", refuse))
        assert [m.content for m in chat.history()] == ["earlier", "ok", "now", text]
        # The refused turn took no slot and left nothing in flight: the next one goes on.
        assert asyncio.run(turn("again", None)) == chat.history()[-1].content


def test_settings_given_with_a_turn_sample_it_and_are_stored_with_its_message(
    db_url: str, llama3_engine: Engine
) -> None:
    # Oracles: the reply's own token count (max_tokens 2), the stored conversation read back
    # through a second Store, and the transactions the turn committed (SQLAlchemy events).
    from sqlalchemy import event

    with ChatSession.open(
        db_url, conversation_id="c", model=llama3_engine, settings={"max_tokens": 6}
    ) as chat:
        chat.send("first")  # the stored settings: max_tokens 6
        commits: list[int] = []
        event.listen(chat.store.engine, "commit", lambda conn: commits.append(1))
        plain = len(commits)
        chat.send("second")
        plain = len(commits) - plain
        before = len(commits)
        reply = chat.send("third", settings={"max_tokens": 2, "seed": 7})
        assert reply.usage.generated_tokens <= 2
        # The new settings cost no transaction of their own: they went with the message.
        assert len(commits) - before == plain
        with Store(db_url) as other:
            stored = other.get_conversation("c").settings
        assert stored["generation"]["max_tokens"] == 2 and stored["generation"]["seed"] == 7
        # A turn refused before it starts stores neither its message nor its settings.
        count = len(chat.history())
        with pytest.raises(ConfigError, match="no room"):
            chat.send("fourth", settings={"max_tokens": llama3_engine.n_ctx})
        assert len(chat.history()) == count
        with Store(db_url) as other:
            assert other.get_conversation("c").settings["generation"]["max_tokens"] == 2
        with pytest.raises(ConfigError, match="generation settings"):
            chat.send("fifth", settings={"temperature": -1})
