"""ChatSession end to end on a llama-server: send, stream, asyncio, close, recall, summaries."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from chatctx import ChatSession, ConfigError
from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess
from chatctx.settings import ContextSettings, GenerationSettings
from chatctx.store import Store
from tests.llama_server.conftest import SLOTS

pytestmark = pytest.mark.slow

GREEDY = GenerationSettings(max_tokens=16, temperature=0.0, repeat_penalty=1.0)


def test_send_stream_and_the_turn_record(
    backend: LlamaServerBackend,
    server: LlamaServerProcess,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []  # the paths chatctx read from the server
    get = backend._get

    def counted(path: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(path)
        return get(path, *args, **kwargs)

    monkeypatch.setattr(backend, "_get", counted)
    with ChatSession.open(
        db_url, conversation_id="e2e", backend=backend, system_prompt="Be brief.", settings=GREEDY
    ) as chat:
        first = chat.send("What colour is the sky?")
        streamed = "".join(chat.stream("And the grass?"))
        second = chat.last_reply
        assert second is not None and second.text == streamed
    assert first.turn is not None and second.turn is not None
    turn = second.turn
    # The record carries the server's own figures: reused + evaluated = the prompt.
    assert turn.reused_tokens + turn.evaluated_tokens == turn.prompt_tokens
    assert turn.reused_tokens > first.turn.prompt_tokens  # the first turn stayed cached
    assert turn.eviction_policy == "server"
    assert turn.model == backend.model_name and turn.n_ctx == backend.n_ctx
    assert turn.slot == turn.seq_id == first.turn.seq_id < SLOTS - 1
    assert turn.cells_used is not None
    slots = {s["id"]: s for s in httpx.get(f"{server.url}/slots", timeout=30).json()}
    assert turn.cells_used[str(turn.seq_id)] == slots[turn.seq_id]["n_prompt_tokens"]
    # ... known without asking: a turn waits for no GET /slots (the server's loop answers it
    # between two of its steps, the slot held idle meanwhile).
    assert "/slots" not in asked
    assert turn.prefill_ms is not None and turn.ttft_ms is not None and turn.ttft_ms > 0
    with Store(db_url) as store:
        stored = store.messages("e2e")
    assert [(m.role, m.content) for m in stored] == [
        ("user", "What colour is the sky?"),
        ("assistant", first.text),
        ("user", "And the grass?"),
        ("assistant", streamed),
    ]


def test_asend_and_astream_from_several_tasks(backend: LlamaServerBackend, db_url: str) -> None:
    async def one(name: str) -> tuple[str, str]:
        chat = ChatSession.open(db_url, conversation_id=name, backend=backend, settings=GREEDY)
        try:
            sent = await chat.asend("Say hi.")
            streamed = "".join([c async for c in chat.astream("Say bye.")])
            return sent.text, streamed
        finally:
            chat.close()

    async def main() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one(f"async-{i}") for i in range(3)))

    results = asyncio.run(main())
    # Not compared with each other: llama-server decodes the three in one batch and a slot's
    # cached prefix changes how a prompt is cut, and llama.cpp's logits (so greedy picks)
    # depend on both. The store holds what each task got.
    with Store(db_url) as store:
        for i, (sent, streamed) in enumerate(results):
            assert sent and streamed
            assert [(m.role, m.content) for m in store.messages(f"async-{i}")] == [
                ("user", "Say hi."),
                ("assistant", sent),
                ("user", "Say bye."),
                ("assistant", streamed),
            ]


def test_close_from_another_thread_stores_the_partial_reply(
    backend: LlamaServerBackend, db_url: str
) -> None:
    long = GenerationSettings(max_tokens=400, temperature=0.0, repeat_penalty=1.0)
    chat = ChatSession.open(db_url, conversation_id="closing", backend=backend, settings=long)
    seen: list[str] = []
    for chunk in chat.stream("Write a long story about a router."):
        seen.append(chunk)
        if len(seen) == 4:
            threading.Thread(target=chat.close).start()
    with Store(db_url) as store:
        messages = store.messages("closing")
        turns = store.turns("closing")
    assert [(m.role, m.status) for m in messages] == [
        ("user", "complete"),
        ("assistant", "partial"),
    ]
    assert messages[1].content == "".join(seen)
    assert turns[0].stop_reason == "interrupted"


def test_llm_summaries_run_on_the_summary_slot_and_recall_finds_evicted_turns(
    backend: LlamaServerBackend, server: LlamaServerProcess, db_url: str
) -> None:
    # A long summary deadline: on a loaded machine a summary prefill shares 2 cores with the
    # customer's turns (36 s for 234 + 48 tokens was seen).
    context = ContextSettings(
        budget=220,
        summarizer="llm",
        summary_max_tokens=48,
        summary_timeout_s=600,
        recall=True,
        recall_search="words",
    )
    summary_before = httpx.get(f"{server.url}/slots", timeout=30).json()[SLOTS - 1]
    with ChatSession.open(
        db_url, conversation_id="long", backend=backend, settings=GREEDY, context=context
    ) as chat:
        chat.send("My order number is NH-48213 and it is a AX3000 router.")
        for i in range(8):
            chat.send(f"Question {i}: how do I reset the router's wifi settings?")
        # The summary is written off-turn and taken by the first turn after it is done.
        deadline = time.monotonic() + 300
        while not chat.store.summaries("long"):
            assert time.monotonic() < deadline, "no summary was written"
            time.sleep(1.0)
            chat.send("Is there any update?")
        reply = chat.send("What was my order number NH-48213 again?")
        plan = reply.plan
    assert plan is not None
    with Store(db_url) as store:
        summaries = store.summaries("long")
        turns = store.turns("long")
    assert any(t.evicted_tokens for t in turns if t.evicted_tokens is not None)
    assert summaries and summaries[-1].content.strip()
    assert plan.sections.get("recall")  # the evicted first message came back
    summary_after = httpx.get(f"{server.url}/slots", timeout=30).json()[SLOTS - 1]
    assert summary_after.get("id_task") != summary_before.get("id_task")  # summaries ran there


def test_open_refuses_model_and_backend_together(backend: LlamaServerBackend, db_url: str) -> None:
    with pytest.raises(ConfigError, match="model or backend"):
        ChatSession.open(db_url, model="x.gguf", backend=backend)
