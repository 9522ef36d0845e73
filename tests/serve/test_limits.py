"""Limits on turns: 409 for a conversation already answering, 429 past a tenant's turns in
flight, and a request timeout that cuts a reply (stored as partial, returned as sent)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.serve.conftest import ServerProcess


class Streaming(threading.Thread):
    """A streamed chat request read to its end in a thread; ``first`` is set at its first
    event (the turn is then in flight on the server)."""

    def __init__(
        self, server: ServerProcess, body: dict[str, Any], path: str = "/v1/chat/completions"
    ) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.path = path
        self.body = {**body, "stream": True}
        self.first = threading.Event()
        self.events: list[str] = []
        self.status: int | None = None

    def run(self) -> None:
        with httpx.stream(
            "POST", f"{self.server.url}{self.path}", json=self.body, timeout=120
        ) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()
        self.first.set()

    def text(self) -> str:
        chunks = [json.loads(e) for e in self.events if e != "[DONE]"]
        return "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )

    def final(self) -> dict[str, Any]:
        chunks = [json.loads(e) for e in self.events if e != "[DONE]"]
        last: dict[str, Any] = next(c for c in reversed(chunks) if c["choices"])
        return last


def ask(server: ServerProcess, conversation: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hello"}],
            "conversation": conversation,
            "max_tokens": 2,
            **extra,
        },
        timeout=120,
    )


def test_busy_conversation_409_tenant_429_and_timeout(
    tiny_llama3_path: Path, start_server: Any
) -> None:
    server: ServerProcess = start_server(
        tiny_llama3_path,
        "--n-ctx",
        "8192",
        "--slots",
        "2",
        "--max-concurrent-turns",
        "2",
        "--conversation-wait",
        "0.5",
        "--request-timeout",
        "4",
    )
    # Replies longer than the tiny model writes in 4 s on a fast CPU (1,500 tokens took less).
    longest = 8000
    long = {"messages": [{"role": "user", "content": "talk"}], "max_tokens": longest}
    first = Streaming(server, {**long, "conversation": "x"})
    first.start()
    assert first.first.wait(60) and first.status == 200

    started = time.monotonic()
    busy = ask(server, "x")
    waited = time.monotonic() - started
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"]["code"] == "conversation_busy"
    assert waited >= 0.5

    second = Streaming(server, {**long, "conversation": "y"})
    second.start()
    assert second.first.wait(60) and second.status == 200
    limited = ask(server, "z")
    assert limited.status_code == 429, limited.text
    assert limited.headers["retry-after"] == "1"
    assert limited.json()["error"]["type"] == "rate_limit_error"

    # Both long replies are cut at the request timeout: finish_reason length, stored partial,
    # the client holding exactly what is stored; the stream still ends with [DONE].
    first.join(60)
    second.join(60)
    with server.store() as store:
        for stream, conversation in ((first, "x"), (second, "y")):
            assert stream.events[-1] == "[DONE]"
            final = stream.final()
            assert final["choices"][0]["finish_reason"] == "length"
            assert final["chatctx"]["stop_reason"] == "timeout"
            assert final["chatctx"]["partial"] is True
            reply = store.messages(conversation)[-1]
            assert reply.role == "assistant" and reply.status == "partial"
            assert reply.content == stream.text() and reply.content
            turn = store.turns(conversation)[-1]
            assert 0 < turn.generated_tokens < longest  # cut before its limit
    # Freed: the conversation and the tenant take turns again.
    assert ask(server, "x").status_code == 200
    assert ask(server, "z").status_code == 200


def test_a_client_gone_mid_reply_ends_it_stored_as_partial(
    tiny_llama3_path: Path, start_server: Any
) -> None:
    server: ServerProcess = start_server(tiny_llama3_path, "--n-ctx", "2048", "--slots", "1")
    body = {
        "messages": [{"role": "user", "content": "talk"}],
        "conversation": "gone",
        "max_tokens": 1500,
        "stream": True,
    }
    seen = ""
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if seen:
                break  # hang up after the first text: the connection is closed
    # The server notices, ends the reply where it is and stores it as partial with its turn.
    deadline = time.monotonic() + 60
    with server.store() as store:
        while time.monotonic() < deadline:
            messages = store.messages("gone")
            if len(messages) == 2:
                break
            time.sleep(0.2)
        user, reply = store.messages("gone")
        assert user.content == "talk" and reply.role == "assistant"
        assert reply.status == "partial" and reply.content.startswith(seen)
        turn = store.turns("gone")[-1]
        assert turn.assistant_message_id == reply.id and 0 < turn.generated_tokens < 1500
    # The conversation's lock and the only slot are free again.
    assert ask(server, "gone").status_code == 200
    assert ask(server, "other").status_code == 200


def test_responses_have_the_same_limits(tiny_llama3_path: Path, start_server: Any) -> None:
    # /v1/responses goes through the turn limits of chat completions: 413 past the body
    # limit, 429 past the tenant's turns in flight, a reply cut at the request timeout.
    limits = {"--max-concurrent-turns": 1, "--request-timeout": 3, "--max-body-bytes": 4096}
    options = [str(x) for pair in limits.items() for x in pair]
    server: ServerProcess = start_server(tiny_llama3_path, "--n-ctx", "8192", *options)
    url = f"{server.url}/v1/responses"
    too_big = httpx.post(url, json={"input": "x" * 5000}, timeout=60)
    assert too_big.status_code == 413, too_big.text
    assert too_big.json()["error"]["type"] == "invalid_request_error"

    long = Streaming(server, {"input": "talk", "max_output_tokens": 8000}, path="/v1/responses")
    long.start()
    assert long.first.wait(60) and long.status == 200
    limited = httpx.post(url, json={"input": "hello", "max_output_tokens": 2}, timeout=60)
    assert limited.status_code == 429, limited.text
    assert limited.json()["error"]["type"] == "rate_limit_error"
    long.join(60)
    last = json.loads(long.events[-1])
    assert last["type"] == "response.incomplete"
    response = last["response"]
    assert response["incomplete_details"] == {"reason": "interrupted"}
    assert response["chatctx"]["stop_reason"] == "timeout"
    stored = httpx.get(f"{url}/{response['id']}", timeout=60).json()
    assert stored["status"] == "incomplete"
    assert stored["output"][0]["content"][0]["text"] == response["output"][0]["content"][0]["text"]
    with server.store() as store:
        found = store.get_response(response["id"])
        assert found is not None
        reply = store.messages(found.conversation_id)[-1]
    assert reply.status == "partial" and reply.content == stored["output"][0]["content"][0]["text"]
