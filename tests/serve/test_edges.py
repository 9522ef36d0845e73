"""The edges of a turn through ``chatctx serve``: a client that hangs up, a turn cut by the
request timeout, a request that fails after its user message was stored, text a store
cannot keep.

The app runs in this process under uvicorn on a real engine (the tiny Llama 3) whose tokens
come slowly, as from a big model on a busy GPU, so that each edge lasts long enough to be
hit. The oracles are the store's rows, the HTTP answers and the time they took.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from chatctx.backends.engine import Engine
from chatctx.errors import BackendUnavailable, DeadlineExceeded, GenerationError
from chatctx.serve import Limits, ServeConfig, create_app
from chatctx.store import Store


class SlowStream:
    """A real engine's stream that waits ``delay`` seconds after each chunk, and ``prefill``
    seconds before the first (closing it cuts that wait short, as a real prefill stops)."""

    def __init__(
        self,
        stream: Any,
        delay: float,
        prefill: float,
        fail: Exception | None = None,
        fail_after: int = 0,
    ) -> None:
        self._stream = stream
        self.delay = delay
        self.prefill = prefill
        self.fail = fail  # raised after ``fail_after`` chunks: the model failed there
        self.fail_after = fail_after
        self._chunks = 0
        self._closed = threading.Event()
        self._started = False

    @property
    def result(self) -> Any:
        return self._stream.result

    @property
    def text(self) -> str:
        return str(self._stream.text)

    def __iter__(self) -> SlowStream:
        return self

    def __next__(self) -> str:
        if not self._started:
            self._started = True
            self._closed.wait(self.prefill)
        if self.fail is not None and self._chunks >= self.fail_after:
            if self._chunks == self.fail_after:  # fails here: what it generated still comes
                self._chunks += 1
                self._stream.close()
            try:
                return str(next(self._stream))
            except StopIteration:
                raise self.fail from None
        self._chunks += 1
        if self._closed.is_set():
            self._stream.close()
        chunk: str = next(self._stream)
        self._closed.wait(self.delay)
        return chunk

    def close(self) -> None:
        self._closed.set()
        self._stream.close()

    def wait(self, *, first_token_only: bool = False) -> Any:
        return self._stream.wait(first_token_only=first_token_only)


class SlowEngine:
    """An ``Engine`` whose generations are ``SlowStream``s; everything else is the engine's."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.delay = 0.0
        self.prefill = 0.0
        self.fail: Exception | None = None
        self.fail_after = 0
        self.started: list[SlowStream] = []

    def generate(self, prompt: Any, **kwargs: Any) -> SlowStream:
        inner = self._engine.generate(prompt, **kwargs)
        stream = SlowStream(inner, self.delay, self.prefill, self.fail, self.fail_after)
        self.started.append(stream)
        return stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class App:
    def __init__(self, url: str, app: Any, store: Store, engine: SlowEngine) -> None:
        self.url, self.app, self.store, self.engine = url, app, store, engine

    def post(self, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout)

    def hang_up_after(self, body: dict[str, Any], chunks: int) -> str:
        """Stream ``body`` and close the connection after ``chunks`` pieces of text."""
        seen, got = "", 0
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                seen += delta
                got += bool(delta)
                if got >= chunks:
                    break
        return seen


@pytest.fixture(scope="module")
def slow_engine(tiny_llama3_path: Path) -> Iterator[SlowEngine]:
    with Engine.load(tiny_llama3_path, n_ctx=2048, n_seq_max=3, n_threads=1) as engine:
        yield SlowEngine(engine)


@pytest.fixture
def start_app(slow_engine: SlowEngine, tmp_path: Path) -> Iterator[Any]:
    servers: list[uvicorn.Server] = []

    def start(
        limits: Limits | None = None,
        *,
        delay: float = 0.0,
        prefill: float = 0.0,
        fail: Exception | None = None,
        fail_after: int = 0,
    ) -> App:
        slow_engine.delay, slow_engine.prefill, slow_engine.fail = delay, prefill, fail
        slow_engine.fail_after = fail_after
        store = Store(f"sqlite:///{tmp_path / f'serve{len(servers)}.db'}")
        app = create_app(ServeConfig(limits=limits or Limits()), backend=slow_engine, store=store)  # type: ignore[arg-type]
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        servers.append(server)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    return App(url, app, store, slow_engine)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("the app did not get ready")

    yield start
    for server in servers:
        server.should_exit = True
    time.sleep(0.5)


def test_a_reply_cut_by_a_hang_up_is_stored_before_the_conversation_goes_on(
    start_app: Any,
) -> None:
    app = start_app(delay=0.3)
    talk = {"conversation": "c1", "stream": True, "max_tokens": 200}
    seen = app.hang_up_after({**talk, "messages": [{"role": "user", "content": "one"}]}, 2)
    # The next request of the same conversation, at once: it adds earlier messages too.
    earlier = [
        {"role": "user", "content": "earlier question"},
        {"role": "assistant", "content": "earlier answer"},
        {"role": "user", "content": "two"},
    ]
    response = app.post({"conversation": "c1", "max_tokens": 4, "messages": earlier})
    assert response.status_code == 200, response.text
    rows = [(m.role, m.content, m.status) for m in app.store.messages("c1")]
    # The cut reply sits right after its own user message, before anything the next request
    # added: the conversation stayed locked until it was stored.
    assert [r[:2] for r in rows[:1]] == [("user", "one")]
    assert rows[1][0] == "assistant" and rows[1][2] == "partial"
    assert rows[1][1].startswith(seen)
    assert [r[1] for r in rows[2:5]] == ["earlier question", "earlier answer", "two"]
    assert rows[5][0] == "assistant" and len(rows) == 6


def test_hanging_up_stateless_streams_does_not_use_up_the_keys_turns(start_app: Any) -> None:
    app = start_app(Limits(max_concurrent_turns=2), delay=0.2)
    body = {"stream": True, "max_tokens": 200}
    for n in range(4):
        app.hang_up_after({**body, "messages": [{"role": "user", "content": f"hello {n}"}]}, 1)
    # Two turns may run at once for this key: four hang-ups later, a turn still gets in.
    response = app.post({"max_tokens": 2, "messages": [{"role": "user", "content": "still?"}]})
    assert response.status_code == 200, response.text


def test_a_request_still_waiting_for_its_conversation_when_the_drain_begins_is_refused(
    start_app: Any,
) -> None:
    app = start_app(delay=0.2)
    service = app.app.state.service
    answers: dict[str, httpx.Response] = {}

    def ask(name: str, max_tokens: int) -> None:
        answers[name] = app.post(
            {
                "conversation": "d1",
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": name}],
            }
        )

    first = threading.Thread(target=ask, args=("first", 8))
    first.start()
    deadline = time.monotonic() + 10
    while not service.cancels and time.monotonic() < deadline:  # the first turn runs
        time.sleep(0.02)
    second = threading.Thread(target=ask, args=("second", 300))
    second.start()
    time.sleep(0.5)  # the second request waits for the conversation's lock
    service.draining = True  # what SIGTERM's drain sets; it then waits for turns in flight
    first.join(30)
    second.join(30)
    # The drain saw one turn in flight and let it finish. The second came in before the
    # drain and got the lock after it began: refused, safe to retry, nothing of it stored.
    assert answers["first"].status_code == 200, answers["first"].text
    assert answers["second"].status_code == 503, answers["second"].text
    assert answers["second"].json()["error"]["code"] == "draining"
    assert answers["second"].headers.get("x-should-retry") is None
    assert [m.content for m in app.store.messages("d1") if m.role == "user"] == ["first"]
    assert not service.cancels


def test_the_request_timeout_cuts_a_turn_in_its_prefill(start_app: Any) -> None:
    app = start_app(Limits(request_timeout_s=1.0), prefill=6.0)
    started = time.monotonic()
    body = {"conversation": "t1", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    response = app.post(body)
    took = time.monotonic() - started
    # Answered at the timeout, not after the 6 s prefill; the user message was stored by
    # the turn that began, so the client is told not to send it again.
    assert response.status_code == 504, response.text
    assert took < 4.0
    assert response.headers.get("x-should-retry") == "false"
    assert [m.content for m in app.store.messages("t1") if m.role == "user"] == ["hi"]


def test_a_turn_cut_while_waiting_for_a_slot_stores_nothing(start_app: Any) -> None:
    app = start_app(Limits(request_timeout_s=1.0))
    held = []  # every conversation slot, taken by other customers' turns
    while True:
        try:
            held.append(app.engine.lease(f"holder{len(held)}", timeout=0.2))
        except DeadlineExceeded:
            break
    try:
        started = time.monotonic()
        response = app.post(
            {
                "conversation": "late",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "anyone?"}],
            }
        )
        took = time.monotonic() - started
    finally:
        for lease in held:
            app.engine.release(lease)
    assert held and response.status_code == 504, response.text
    assert took < 3.0  # at the timeout, not whenever a slot comes free
    assert response.headers.get("x-should-retry") is None  # nothing stored: safe to retry
    assert [m.content for m in app.store.messages("late")] == []


@pytest.mark.parametrize("field", ["content", "name"])
@pytest.mark.parametrize("text", ["nul \x00 inside", "lone \ud800 surrogate"])
def test_text_no_store_can_keep_is_refused_with_400_and_nothing_stored(
    start_app: Any, text: str, field: str
) -> None:
    app = start_app()
    message = {"role": "user", "content": "hello", field: text}
    body = {"conversation": "bad", "max_tokens": 2, "messages": [message]}
    response = httpx.post(
        f"{app.url}/v1/chat/completions",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    # (pydantic itself refuses a lone surrogate in a plain string field first)
    assert response.json()["error"]["code"] in ("invalid_text", "string_unicode")
    assert not app.store.has_conversation("bad")


def test_a_reply_limit_too_large_is_refused_before_earlier_messages_are_stored(
    start_app: Any,
) -> None:
    app = start_app()
    assert (
        app.post(
            {"conversation": "big", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}]}
        ).status_code
        == 200
    )
    body = {
        "conversation": "big",
        "max_tokens": 1_000_000,
        "messages": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ],
    }
    for _ in range(2):
        assert app.post(body).status_code == 400
    assert [m.content for m in app.store.messages("big")][:1] == ["a"]
    assert len(app.store.messages("big")) == 2  # "a" and its reply: nothing of the refused


def test_a_conversation_deleted_elsewhere_is_made_again_on_first_use(start_app: Any) -> None:
    app = start_app()
    body = {"conversation": "gone", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}]}
    assert app.post(body).status_code == 200
    app.store.delete_conversation("gone")  # another process, or `chatctx delete`
    response = app.post({**body, "messages": [{"role": "user", "content": "b"}]})
    assert response.status_code == 200, response.text
    assert [m.content for m in app.store.messages("gone") if m.role == "user"] == ["b"]


def test_stateless_requests_that_open_alike_run_side_by_side(start_app: Any) -> None:
    app = start_app(delay=0.2)
    opening = [
        {"role": "system", "content": "You are the shop's assistant."},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ]
    answers: list[httpx.Response] = []

    def ask(n: int) -> None:
        body = {"max_tokens": 6, "messages": [*opening, {"role": "user", "content": f"q{n}"}]}
        answers.append(app.post(body))

    askers = [threading.Thread(target=ask, args=(n,)) for n in range(3)]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    assert [a.status_code for a in answers] == [200] * 3
    # They took both of the engine's conversation slots, not the first one's in turn.
    assert len({a.json()["chatctx"]["slot"] for a in answers}) == 2


def test_a_client_that_sends_the_whole_history_each_turn_has_it_stored_once(
    start_app: Any,
) -> None:
    app = start_app()
    sent: list[dict[str, str]] = [{"role": "system", "content": "Be brief."}]
    for question in ("where is my parcel?", "and the invoice?", "thanks"):
        sent.append({"role": "user", "content": question})
        body = {"conversation": "full", "max_tokens": 3, "messages": sent}
        answer = app.post(body).json()["choices"][0]["message"]["content"]
        sent.append({"role": "assistant", "content": answer})
    stored = [(m.role, m.content) for m in app.store.messages("full")]
    assert stored == [(m["role"], m["content"]) for m in sent[1:]]
    # Messages the conversation does not end with are new: they are stored.
    other = [
        {"role": "user", "content": "an older question"},
        {"role": "assistant", "content": "an older answer"},
        {"role": "user", "content": "next"},
    ]
    app.post({"conversation": "full", "max_tokens": 3, "messages": other})
    stored = [m.content for m in app.store.messages("full")]
    assert stored[len(sent) - 1 : len(sent) + 2] == [m["content"] for m in other]


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        (GenerationError("the model failed"), 500),
        (BackendUnavailable("the server went away", backend="gpu1", reason="down"), 503),
    ],
)
def test_a_failure_after_the_user_message_was_stored_is_not_retried_by_the_client(
    start_app: Any, failure: Exception, status: int
) -> None:
    app = start_app(fail=failure)
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused")  # retries 5xx twice
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(
            model="chatctx",
            messages=[{"role": "user", "content": "where is my parcel?"}],
            max_tokens=4,
            extra_body={"conversation": "once"},
        )
    assert failed.value.status_code == status
    assert failed.value.response.headers.get("x-should-retry") == "false"
    # One request reached the server, and its user message is stored once.
    assert [m.content for m in app.store.messages("once")] == ["where is my parcel?"]


@pytest.mark.parametrize(
    "failure", [GenerationError("the model failed"), RuntimeError("a bug in a backend")]
)
def test_a_stream_that_fails_midway_ends_with_an_error_event(
    start_app: Any, failure: Exception
) -> None:
    app = start_app(fail=failure, fail_after=2)
    body = {"conversation": f"mid-{type(failure).__name__}", "stream": True, "max_tokens": 50}
    body["messages"] = [{"role": "user", "content": "tell me everything"}]
    with httpx.stream("POST", f"{app.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    # The text so far, then an OpenAI-style error event and [DONE]: a clean end to parse.
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    stored = app.store.messages(body["conversation"])
    assert stored[-1].role == "assistant" and stored[-1].status == "partial"
    assert stored[-1].content == text


def test_a_turn_that_waited_for_a_slot_shows_its_wait_on_the_cache_page(start_app: Any) -> None:
    # The test's own clock is the oracle: the request was in the pool's line at `seen` and
    # could not start before the slots were given back at `given_back`.
    app = start_app()
    held = []
    while True:
        try:
            held.append(app.engine.lease(f"holder{len(held)}", timeout=0.2))
        except DeadlineExceeded:
            break
    body = {
        "conversation": "queued",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    answers: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: answers.append(app.post(body)), daemon=True)
    try:
        asking.start()
        deadline = time.monotonic() + 10
        # (the last holder's try that timed out keeps an away place in line too)
        while not [w for w in app.engine.pool._line if not w.owner.startswith("holder")]:
            assert time.monotonic() < deadline, "the request never got in line"
            time.sleep(0.005)
        seen = time.perf_counter()
        time.sleep(0.3)
        given_back = time.perf_counter()
    finally:
        for lease in held:
            app.engine.release(lease)
    asking.join(30)
    assert answers and answers[0].status_code == 200, answers
    least = (given_back - seen) * 1000
    (turn,) = app.store.turns("queued")
    assert turn.queue_ms is not None and turn.queue_ms >= least
    page = httpx.get(f"{app.url}/v1/cache", timeout=10).json()
    (recent,) = [t for t in page["recent_turns"] if t["conversation"] == "queued"]
    assert recent["queue_ms"] >= turn.queue_ms  # the server's own wait comes on top
    assert page["summary"]["queue_p50_ms"] >= least
