"""Cancelling a reply, and a server dying under one: what the server and the store show."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from chatctx import BackendUnavailable, ChatSession
from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess
from chatctx.settings import GenerationSettings
from chatctx.store import Store
from tests.llama_server.conftest import start_server

pytestmark = pytest.mark.slow

LONG = GenerationSettings(max_tokens=600, temperature=0.0, repeat_penalty=1.0)
ESSAY = "Write a very long essay about the history of wifi routers, with many details."


def slot_state(url: str, seq: int) -> dict[str, Any]:
    slots = httpx.get(f"{url}/slots", timeout=30).json()
    state: dict[str, Any] = next(s for s in slots if s["id"] == seq)
    return state


def decoded(state: dict[str, Any]) -> int:
    return int(state.get("next_token", [{}])[0].get("n_decoded", 0))


def predicted_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total"):
            return float(line.split()[-1])
    raise AssertionError(f"no tokens_predicted_total in /metrics:\n{text}")


def test_closing_a_stream_from_another_thread_stops_the_slot(
    backend: LlamaServerBackend, server: LlamaServerProcess
) -> None:
    prompt = backend.prompt_tokens([{"role": "user", "content": ESSAY}])
    lease = backend.lease("cancel-me")
    try:
        stream = backend.generate(prompt, seq_id=lease.seq_id, settings=LONG)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 5:
                closer = threading.Thread(target=stream.close)
                closer.start()
                closer.join(10)
                assert not closer.is_alive()  # close() returned
        result = stream.result
        assert result is not None
        assert result.stop_reason == "interrupted"
        assert result.text == stream.text == "".join(chunks)
        assert 5 <= result.usage.generated_tokens < LONG.max_tokens
        assert result.usage.prompt_tokens == len(prompt)
        # The oracle is the server: the slot goes idle and stops decoding.
        deadline = time.monotonic() + 10
        while slot_state(server.url, lease.seq_id)["is_processing"]:
            assert time.monotonic() < deadline, "the slot kept processing"
            time.sleep(0.05)
        stopped = predicted_total(server.url)
        time.sleep(1.0)
        assert predicted_total(server.url) == stopped
        assert decoded(slot_state(server.url, lease.seq_id)) < LONG.max_tokens
    finally:
        backend.release(lease)


def test_closing_during_the_prefill_returns_at_once(backend: LlamaServerBackend) -> None:
    # A long prompt: the server sends nothing (not even its headers) until it is evaluated.
    text = " ".join(f"item {i} is a router" for i in range(120))
    prompt = backend.prompt_tokens([{"role": "user", "content": text}])
    lease = backend.lease("cancel-prefill")
    try:
        backend.clear(lease.seq_id)
        stream = backend.generate(prompt, seq_id=lease.seq_id, settings=LONG)
        reader = threading.Thread(target=lambda: list(stream))
        reader.start()
        time.sleep(0.05)
        started = time.monotonic()
        stream.close()
        assert time.monotonic() - started < 2.0
        reader.join(10)
        assert not reader.is_alive()
        assert stream.result is not None and stream.result.stop_reason == "interrupted"
        assert stream.result.text == ""
        # The server let the slot go without a reply (it notices between prompt batches).
        deadline = time.monotonic() + 20
        while slot_state(backend.url, lease.seq_id)["is_processing"]:
            assert time.monotonic() < deadline, "the slot kept processing"
            time.sleep(0.05)
        assert decoded(slot_state(backend.url, lease.seq_id)) == 0
    finally:
        backend.release(lease)


def test_a_stream_closed_before_it_started_has_no_result(backend: LlamaServerBackend) -> None:
    stream = backend.generate([1, 2, 3], seq_id=0, settings=LONG)
    stream.close()
    assert stream.result is None
    assert list(stream) == []


def test_a_server_killed_mid_reply_keeps_the_partial_reply(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path, db_url: str
) -> None:
    doomed = start_server(
        llama_server_binary, smollm2_path, tmp_path / "doomed", slots=2, n_ctx=1024
    )
    try:
        with LlamaServerBackend(doomed.url, model=smollm2_path) as backend:
            chat = ChatSession.open(
                db_url, conversation_id="doomed", backend=backend, settings=LONG
            )
            chunks: list[str] = []
            with pytest.raises(BackendUnavailable) as caught:
                for chunk in chat.stream(ESSAY):
                    chunks.append(chunk)
                    if len(chunks) == 8:
                        doomed.kill()  # SIGKILL: the server is gone mid-reply
            assert caught.value.reason == "disconnected"
            assert caught.value.backend == doomed.url
            chat.close()
            with pytest.raises(BackendUnavailable) as down:
                backend.health()
            assert down.value.reason == "refused"
    finally:
        doomed.stop()
    # The oracle is the store, read afresh: the user message and the partial reply.
    with Store(db_url) as store:
        messages = store.messages("doomed")
        assert [(m.role, m.status) for m in messages] == [
            ("user", "complete"),
            ("assistant", "partial"),
        ]
        assert messages[0].content == ESSAY
        assert messages[1].content == "".join(chunks)
        turns = store.turns("doomed")
        assert len(turns) == 1 and turns[0].stop_reason == "error"
