"""SIGTERM during eight streams: new requests get 503, every reply that began ends cleanly
for its client and is stored (complete, or partial at the drain deadline), one still waiting
for a slot at the deadline gets 503 and stores nothing, the process exits 0."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chatctx.errors import ConversationNotFound
from tests.serve.conftest import ServerProcess

STREAMS = 8


@pytest.mark.slow
def test_sigterm_drains_eight_streams(tiny_llama3_path: Path, start_server: Any) -> None:
    server: ServerProcess = start_server(
        tiny_llama3_path, "--n-ctx", "2048", "--slots", "4", "--drain-timeout", "2"
    )
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    received: dict[str, list[str]] = {}
    finishes: dict[str, str | None] = {}
    errors: dict[str, BaseException] = {}
    first_token = threading.Semaphore(0)

    def stream(n: int) -> None:
        conversation = f"drain-{n}"
        parts: list[str] = received.setdefault(conversation, [])
        try:
            chunks = client.chat.completions.create(
                model="chatctx",
                messages=[{"role": "user", "content": f"Tell me a long story number {n}"}],
                # A few short ones finish within the drain; the rest are cut at its deadline.
                max_tokens=6 if n % 4 == 0 else 1500,
                stream=True,
                extra_body={"conversation": conversation},
            )
            for i, chunk in enumerate(chunks):
                if i == 0:
                    first_token.release()
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    finishes[conversation] = chunk.choices[0].finish_reason or finishes.get(
                        conversation
                    )
        except BaseException as exc:  # a client that saw anything but a clean end
            errors[conversation] = exc

    threads = [threading.Thread(target=stream, args=(n,), daemon=True) for n in range(STREAMS)]
    short = [t for n, t in enumerate(threads) if n % 4 == 0]
    for thread in short:  # the short ones hold slots before the long ones come
        thread.start()
    for _ in short:
        assert first_token.acquire(timeout=120)
    for thread in threads:
        if thread not in short:
            thread.start()
    for _ in range(4 - len(short)):  # every slot is answering; the other four wait for one
        assert first_token.acquire(timeout=120)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    refused = None
    while time.monotonic() < deadline:
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "new"}], "max_tokens": 2},
            timeout=10,
        )
        if response.status_code == 503:
            refused = response
            break
        time.sleep(0.05)
    assert refused is not None, "no 503 while draining"
    assert refused.json()["error"]["code"] == "draining"
    assert refused.headers["retry-after"] == "1"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 503

    for thread in threads:
        thread.join(120)
    assert server.proc.wait(timeout=120) == 0, server.log()
    # A turn still waiting for a slot when the drain's deadline came was never begun: 503,
    # before any output, and nothing of it stored (the client may send it elsewhere).
    for conversation, exc in errors.items():
        assert isinstance(exc, openai.InternalServerError) and exc.status_code == 503, exc
        assert "shutting down" in str(exc) and received[conversation] == []
    assert len(errors) <= STREAMS - 4  # four had begun before the signal
    assert set(finishes.values()) <= {"stop", "length"}
    assert len(finishes) == STREAMS - len(errors)
    statuses = []
    with server.store() as store:
        for n in range(STREAMS):
            conversation = f"drain-{n}"
            if conversation in errors:
                # Refused before its turn began: answered 503 at the door once the drain
                # started (no conversation made), or cut while it waited for a slot (made,
                # nothing in it). Either way nothing of it is stored.
                with contextlib.suppress(ConversationNotFound):
                    assert store.messages(conversation) == [], conversation
                continue
            history = store.messages(conversation)
            assert [m.role for m in history] == ["user", "assistant"], conversation
            reply = history[1]
            assert reply.status in ("complete", "partial")
            assert reply.content == "".join(received[conversation])
            assert len(store.turns(conversation)) == 1
            statuses.append(reply.status)
    assert "partial" in statuses  # the long ones were cut at the deadline
    assert statuses.count("complete") >= 1  # a short one finished within the drain
    assert "draining" in server.log()
