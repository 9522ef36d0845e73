"""LlamaServerBackend at its edges: streams closed before they start, summaries queued past
their deadline, /slots refused, a slot changing hands under forget(), close() racing new
replies, and tokens the server never streams (a character split over several tokens)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from chatctx import ChatSession, ClosedError, DeadlineExceeded
from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess
from chatctx.backends.llama_server._http import sse_event
from chatctx.backends.llama_server._stream import ServerStream
from chatctx.errors import GenerationError
from chatctx.settings import GenerationSettings
from chatctx.store import Store

pytestmark = pytest.mark.slow

SHORT = GenerationSettings(max_tokens=4, temperature=0.0, repeat_penalty=1.0)
LONG = GenerationSettings(max_tokens=600, temperature=0.0, repeat_penalty=1.0)
ESSAY = "Write a very long essay about the history of wifi routers, with many details."


@pytest.fixture
def fresh(server: LlamaServerProcess, smollm2_path: Path) -> Iterator[LlamaServerBackend]:
    """A backend of its own on the shared server: its slot pool starts empty."""
    with LlamaServerBackend(
        server.url, model=smollm2_path, slot_save_path=server.slot_save_path
    ) as backend:
        yield backend


def slots(url: str) -> dict[int, dict[str, Any]]:
    return {int(s["id"]): s for s in httpx.get(f"{url}/slots", timeout=30).json()}


def prompt_of(backend: LlamaServerBackend, text: str) -> list[int]:
    return backend.prompt_tokens([{"role": "user", "content": text}])


# streams closed before they start -------------------------------------------------------


def test_a_stream_closed_before_it_started_lets_its_slot_go(
    backend: LlamaServerBackend,
) -> None:
    lease = backend.lease("closed-unstarted")
    try:
        stream = backend.generate(prompt_of(backend, "Hello."), seq_id=lease.seq_id, settings=SHORT)
        stream.close()
        assert list(stream) == [] and stream.result is None
        with pytest.raises(GenerationError, match="closed before it started"):
            stream.wait()
        backend.clear(lease.seq_id)  # no generation runs on the slot: it may be cleared
    finally:
        backend.release(lease)


def test_a_cancelled_summary_leaves_the_summary_slot_free(backend: LlamaServerBackend) -> None:
    assert backend.summary_seq is not None
    cancel = threading.Event()
    backend.cancel_side(cancel)
    with pytest.raises(GenerationError, match="cancelled"):
        backend.side_generate(prompt_of(backend, "Summarize: hi."), settings=SHORT, cancel=cancel)
    backend.clear(backend.summary_seq)  # no stream left behind on the summary slot


def test_a_summary_queued_behind_another_raises_at_its_deadline(
    backend: LlamaServerBackend,
) -> None:
    first_cancel = threading.Event()
    first: list[BaseException | str] = []

    def run_first() -> None:
        try:
            first.append(
                backend.side_generate(prompt_of(backend, ESSAY), settings=LONG, cancel=first_cancel)
            )
        except BaseException as exc:
            first.append(exc)

    runner = threading.Thread(target=run_first)
    runner.start()
    # Stops the first summary whatever happens below, so the test never waits for 600 tokens.
    stopper = threading.Timer(8.0, backend.cancel_side, args=(first_cancel,))
    stopper.start()
    try:
        started = time.monotonic()
        while backend._side_running is None:  # the first summary holds the summary slot
            assert time.monotonic() - started < 30, "the first summary never started"
            time.sleep(0.01)
        queued = time.monotonic()
        with pytest.raises(DeadlineExceeded) as caught:
            backend.side_generate(
                prompt_of(backend, "Summarize: the router was replaced."),
                settings=SHORT,
                deadline=queued + 0.5,
            )
        waited = time.monotonic() - queued
        assert caught.value.what == "summary"
        assert waited < 3.0, f"the queued summary waited {waited:.1f} s past its deadline"
        assert runner.is_alive()  # the first summary was still running meanwhile
    finally:
        backend.cancel_side(first_cancel)
        stopper.cancel()
        runner.join(30)
    assert not runner.is_alive()
    assert len(first) == 1 and isinstance(first[0], GenerationError)


# /slots refused ----------------------------------------------------------------------------


class RefusingSlots(httpx.BaseTransport):
    """The real server behind it, but ``GET /slots`` answers 403 (a proxy that hides it):
    no llama-server build answers /slots with a 4xx itself."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.refused = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/slots":
            self.refused += 1
            return httpx.Response(
                403,
                json={"error": {"code": 403, "message": "forbidden", "type": "auth_error"}},
            )
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_a_refused_slots_endpoint_keeps_the_reply(fresh: LlamaServerBackend, db_url: str) -> None:
    transport = RefusingSlots()
    fresh._client.close()
    fresh._client = httpx.Client(base_url=fresh.url, transport=transport, timeout=60)
    with ChatSession.open(
        db_url, conversation_id="slots-refused", backend=fresh, settings=SHORT
    ) as chat:
        reply = chat.send("Say hello.")
    assert reply.text
    # The turn's record never asks /slots: its cells are those chatctx sent and received.
    assert transport.refused == 0
    assert reply.turn is not None and reply.turn.cells_used is not None
    assert reply.turn.cells_used[str(reply.turn.seq_id)] >= reply.usage.prompt_tokens
    assert fresh.kv_usage() == {}  # a read refused, nothing read before: no figures
    assert transport.refused == 1
    with Store(db_url) as store:
        messages = store.messages("slots-refused")
    assert [(m.role, m.content) for m in messages] == [
        ("user", "Say hello."),
        ("assistant", reply.text),
    ]


# forget() while the slot changes hands -----------------------------------------------------


def test_forget_erases_the_slot_the_conversation_holds_when_it_leases(
    fresh: LlamaServerBackend, server: LlamaServerProcess
) -> None:
    prompt = prompt_of(fresh, "Count to three.")
    for owner in ("old", "b", "c"):  # every slot taken; "old" is the least recently used
        lease = fresh.lease(owner)
        fresh.generate(prompt, seq_id=lease.seq_id, settings=SHORT).wait()
        fresh.release(lease)
        time.sleep(0.01)
    old_slot = fresh.slot_of("old")
    assert old_slot is not None
    newcomer_prompt = prompt_of(fresh, "Name three fruits.")
    real_lease = fresh.pool.lease
    newcomer: dict[str, int] = {}

    def lease_after_a_newcomer(owner: str, *, timeout: float | None = None) -> Any:
        # Between forget()'s look at the slot and its lease, another conversation takes
        # "old"'s slot (the least recently used) and replies from it.
        if owner == "old" and not newcomer:
            taken = real_lease("new", timeout=timeout)
            newcomer["seq"] = taken.seq_id
            fresh.generate(newcomer_prompt, seq_id=taken.seq_id, settings=SHORT).wait()
            fresh.release(taken)
        return real_lease(owner, timeout=timeout)

    fresh.pool.lease = lease_after_a_newcomer  # type: ignore[method-assign]
    try:
        fresh.forget("old")
    finally:
        del fresh.pool.lease
    assert newcomer["seq"] == old_slot
    assert fresh.slot_of("new") == old_slot and fresh.slot_of("old") is None
    # The oracle is the server: the newcomer's cache is still in its slot, and reused.
    assert slots(server.url)[old_slot]["n_prompt_tokens"] >= len(newcomer_prompt)
    lease = fresh.lease("new")
    try:
        assert lease.seq_id == old_slot
        again = fresh.generate(newcomer_prompt, seq_id=lease.seq_id, settings=SHORT).wait()
    finally:
        fresh.release(lease)
    assert again.usage.reused_tokens == len(newcomer_prompt) - 1


# close() racing new replies ----------------------------------------------------------------


def test_a_reply_asked_for_while_the_backend_closes_is_refused(
    fresh: LlamaServerBackend,
) -> None:
    prompt = prompt_of(fresh, "Hello.")
    held = fresh.lease("held")  # close() waits for it to come back
    closer = threading.Thread(target=fresh.close)
    closer.start()
    late: ServerStream | None = None
    try:
        time.sleep(0.3)
        assert closer.is_alive()
        with pytest.raises(ClosedError):
            late = fresh.generate(prompt, seq_id=held.seq_id, settings=SHORT)
        with pytest.raises(ClosedError):
            fresh.side_generate(prompt, settings=SHORT)
    finally:
        if late is not None:
            late.close()
        fresh.release(held)
        closer.join(30)
    assert not closer.is_alive() and fresh.closed


# close() from another thread while the stream starts ---------------------------------------


def test_close_while_the_stream_starts_its_worker(
    backend: LlamaServerBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = threading.Thread
    closer_errors: list[BaseException] = []
    stream: ServerStream | None = None

    def close_stream() -> None:
        assert stream is not None
        try:
            stream.close()
        except BaseException as exc:
            closer_errors.append(exc)

    class CloseFirst(original):  # type: ignore[misc, valid-type]
        def start(self) -> None:
            if self.name == "chatctx-llama-server-stream":
                # Another thread closes the stream at the moment its worker is about to
                # start; waits up to 0.5 s for it (it may be held off until the start).
                closer = original(target=close_stream)
                closer.start()
                closer.join(0.5)
                self.closer = closer
            super().start()

    lease = backend.lease("close-at-start")
    try:
        stream = backend.generate(prompt_of(backend, ESSAY), seq_id=lease.seq_id, settings=LONG)
        monkeypatch.setattr(threading, "Thread", CloseFirst)
        chunks = list(stream)
        monkeypatch.undo()
        worker = stream._worker
        assert worker is not None
        worker.closer.join(15)  # type: ignore[attr-defined]
        assert not worker.closer.is_alive()  # type: ignore[attr-defined]
    finally:
        monkeypatch.undo()
        backend.release(lease)
    assert closer_errors == []
    assert stream.result is not None and stream.result.stop_reason == "interrupted"
    assert stream.result.text == "".join(chunks)


# tokens the server never streams -----------------------------------------------------------


def test_tokens_of_split_characters_are_counted(
    backend: LlamaServerBackend, server: LlamaServerProcess
) -> None:
    # Each 😀 is three SmolLM2 tokens: llama-server streams only the one that completes it.
    prompt = prompt_of(backend, "Repeat: 😀😀😀😀😀😀😀😀😀😀😀😀")
    settings = GenerationSettings(max_tokens=40, temperature=0.0, repeat_penalty=1.0)
    lease = backend.lease("emoji")
    try:
        backend.clear(lease.seq_id)
        result = backend.generate(prompt, seq_id=lease.seq_id, settings=settings).wait()
        mirror = list(backend._mirror[lease.seq_id])
    finally:
        backend.release(lease)
    # The oracles are the server's: the same completion unstreamed gives every token, and
    # the slot holds the prompt and the reply (less the last token of a length stop).
    whole = httpx.post(
        f"{server.url}/completion",
        json={
            "prompt": prompt,
            "n_predict": settings.max_tokens,
            "temperature": 0.0,
            "repeat_penalty": 1.0,
            "return_tokens": True,
            "cache_prompt": False,
            "id_slot": backend.summary_seq,
        },
        timeout=120,
    ).json()
    tokens = [int(t) for t in whole["tokens"]]
    # (Unstreamed, the last, unfinished character comes as U+FFFD; streamed, it never comes.)
    assert "😀" in result.text and whole["content"].startswith(result.text)
    assert result.stop_reason == "length"
    assert result.usage.generated_tokens == len(tokens) == settings.max_tokens
    held = slots(server.url)[lease.seq_id]["n_prompt_tokens"]
    assert held == len(prompt) + result.usage.generated_tokens - 1
    # What chatctx keeps of the reply's tokens is right as far as it goes.
    assert list(result.tokens) == tokens[: len(result.tokens)]
    assert mirror == (prompt + tokens)[: len(mirror)] and len(prompt) <= len(mirror) <= held


def test_an_event_that_is_not_json_is_a_generation_error() -> None:
    # A proxy's error page, or a line cut short, in the middle of the event stream.
    with pytest.raises(GenerationError, match="not JSON"):
        sse_event("data: <html>502 Bad Gateway</html>")
    assert sse_event('data: {"content": "hi"}') == {"content": "hi"}
    assert sse_event("data: [DONE]") is None
