"""The official ``openai`` client against ``chatctx serve``: ten stateful turns sending only
the new message, streaming and not, sync and async; the database is the oracle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from chatctx.store import Message, Turn
from tests.serve.conftest import ServerProcess

SYSTEM = "You are a helpful support assistant. Answer in one short sentence."
QUESTIONS = [
    "Hello, my order 1234 has not arrived.",
    "It was supposed to come last Monday.",
    "The address is 12 Elm Street.",
    "Can you check the tracking number?",
    "It says the parcel is in the depot.",
    "How long will it take now?",
    "Can I get a refund instead?",
    "Please send the refund to my card.",
    "Thank you, what was my order number again?",
    "Goodbye!",
]


def _check_against_store(
    server: ServerProcess, conversation: str, received: list[str], usages: list[object]
) -> tuple[list[Message], list[Turn]]:
    with server.store() as store:
        history = store.messages(conversation)
        turns = store.turns(conversation)
        stored = store.get_conversation(conversation)
    assert stored.system_prompt == SYSTEM
    # Exactly what was sent and received, in order, nothing more (no history resent).
    expected = [
        (role, text)
        for question, reply in zip(QUESTIONS, received, strict=True)
        for role, text in (("user", question), ("assistant", reply))
    ]
    assert [(m.role, m.content) for m in history] == expected
    assert all(m.status == "complete" for m in history)
    # usage is the turn record's, turn by turn.
    assert len(turns) == len(QUESTIONS)
    for usage, turn in zip(usages, turns, strict=True):
        assert usage is not None
        assert usage.prompt_tokens == turn.prompt_tokens  # type: ignore[attr-defined]
        assert usage.completion_tokens == turn.generated_tokens  # type: ignore[attr-defined]
        details = usage.prompt_tokens_details  # type: ignore[attr-defined]
        assert details.cached_tokens == turn.reused_tokens
    # The server kept the KV cache warm: later turns reuse the conversation's prefix.
    assert all(t.reused_tokens > 0 for t in turns[1:])
    assert turns[-1].prompt_tokens > turns[0].prompt_tokens
    return history, turns


def _messages(turn: int, question: str) -> list[dict[str, str]]:
    new = [{"role": "user", "content": question}]
    return [{"role": "system", "content": SYSTEM}, *new] if turn == 0 else new


@pytest.mark.slow
def test_sync_client_ten_turns_stream_and_not(smollm2_path: Path, start_server: object) -> None:
    server: ServerProcess = start_server(smollm2_path, "--n-ctx", "2048", "--slots", "2")  # type: ignore[operator]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    received: list[str] = []
    usages: list[object] = []
    finishes: list[str] = []
    for turn, question in enumerate(QUESTIONS):
        extra = {"conversation": "cust-42"}
        if turn % 2 == 0:
            response = client.chat.completions.create(
                model="chatctx",
                messages=_messages(turn, question),  # type: ignore[arg-type]
                max_tokens=40,
                temperature=0,
                extra_body=extra,
            )
            received.append(response.choices[0].message.content or "")
            usages.append(response.usage)
            finishes.append(response.choices[0].finish_reason)
            assert response.model == "SmolLM2-135M-Instruct.Q4_1.gguf"
        else:
            stream = client.chat.completions.create(
                model="chatctx",
                messages=_messages(turn, question),  # type: ignore[arg-type]
                max_tokens=40,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            parts: list[str] = []
            usage = None
            finish = None
            for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                else:
                    usage = chunk.usage
            received.append("".join(parts))
            usages.append(usage)
            assert finish is not None
            finishes.append(finish)
    _, turns = _check_against_store(server, "cust-42", received, usages)
    # A reply that ended on the model's end-of-turn says "stop", one cut at 40 tokens "length".
    for finish, turn in zip(finishes, turns, strict=True):
        assert finish == ("stop" if turn.stop_reason == "eog" else "length")
    assert "stop" in finishes  # SmolLM2 ends short answers itself
    assert all(reply.strip() for reply in received)


def test_async_client_ten_turns_stream_and_not(
    tiny_llama3_path: Path, start_server: object
) -> None:
    server: ServerProcess = start_server(tiny_llama3_path, "--n-ctx", "1024", "--slots", "2")  # type: ignore[operator]

    async def chat() -> tuple[list[str], list[object]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        received: list[str] = []
        usages: list[object] = []
        for turn, question in enumerate(QUESTIONS):
            extra = {"conversation": "async-1"}
            if turn % 2 == 1:
                response = await client.chat.completions.create(
                    model="any",
                    messages=_messages(turn, question),  # type: ignore[arg-type]
                    max_tokens=12,
                    seed=turn,
                    extra_body=extra,
                )
                received.append(response.choices[0].message.content or "")
                usages.append(response.usage)
            else:
                stream = await client.chat.completions.create(
                    model="any",
                    messages=_messages(turn, question),  # type: ignore[arg-type]
                    max_tokens=12,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=extra,
                )
                parts: list[str] = []
                usage = None
                async for chunk in stream:
                    if chunk.choices:
                        parts.append(chunk.choices[0].delta.content or "")
                    else:
                        usage = chunk.usage
                received.append("".join(parts))
                usages.append(usage)
        await client.close()
        return received, usages

    received, usages = asyncio.run(chat())
    _check_against_store(server, "async-1", received, usages)
