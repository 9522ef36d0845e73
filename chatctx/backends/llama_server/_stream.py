"""One streamed ``POST /completion`` on a llama-server slot: a ``chatctx.backends.base.Stream``.

A worker thread reads the server's events (``data: {...}`` lines) and queues the text; the
reader iterates the queue. ``close()`` may come from any thread: it shuts the socket down,
which wakes the worker even in the middle of a long prefill, and llama-server stops the slot
once it sees the connection gone. The result then has stop reason ``interrupted`` and all the
text generated so far; the reader still gets that text before the end. A stream closed before
it started sent nothing and has no result.

A server that dies mid-reply ends the stream with ``BackendUnavailable(reason=
"disconnected")``, raised from the reader's ``next()`` after the text already received; the
result is set before (stop reason ``error``), so a ``ChatSession`` stores the partial reply.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from chatctx.backends.base import GenerationResult, KVReport, Timings, Usage
from chatctx.backends.llama_server._http import (
    check,
    error_of,
    raise_error,
    sse_event,
    sse_lines,
    translated,
)
from chatctx.errors import GenerationError

logger = logging.getLogger("chatctx.backends.llama_server")

CLOSE_WAIT_S = 10.0  # close() waits this long for the worker to let go of the connection

# llama-server's stop_type, as chatctx's stop reasons.
STOP_REASONS = {"eos": "eog", "word": "eog", "limit": "length"}

_END = object()


class ServerStream:
    """A generation on a llama-server slot; starts when first iterated (or waited on)."""

    def __init__(
        self,
        client: httpx.Client,
        backend: str,
        body: dict[str, Any],
        *,
        prompt: Sequence[int],
        n_ctx: int,
        report: Callable[[int, int], KVReport],
        done: Callable[[ServerStream], None],
        asked: int = 0,
    ) -> None:
        self.result: GenerationResult | None = None
        self.text = ""
        self.slot: int | None = None  # the id_slot the server answered from
        self._client = client
        self._backend = backend
        self._body = body
        self._prompt = list(prompt)
        self._n_ctx = n_ctx
        self._report = report  # (cache_n, prompt_n) -> the KV report of this turn
        self._asked = asked  # tokens evaluated for this turn before it (its prompt brought back)
        self._done = done  # called once the worker has let go (the backend forgets it)
        self._out: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._started = False
        self._ended = False  # the reader got the end
        self._stopping: str | None = None  # "interrupted" | "closed": close() was called
        self._network: Any = None  # the connection's network stream, once connected
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        # What the worker saw, folded into the result at the end.
        self._text = ""
        self._tokens: list[int] = []
        self._known: int | None = None  # tokens received before the first one never sent
        self._last: dict[str, Any] = {}
        self._t0 = 0.0
        self._t_first: float | None = None

    # the Stream protocol ------------------------------------------------------------------

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        self._start()
        if self._ended:
            raise StopIteration
        item = self._out.get()
        if isinstance(item, str):
            self.text += item
            return item
        self._ended = True
        error, self._error = self._error, None  # raised once
        if error is not None:
            raise error
        raise StopIteration

    def close(self, *, reason: str = "interrupted") -> None:
        """Stop the reply and return once the connection is let go (from any thread)."""
        with self._lock:
            unstarted = not self._started
            if unstarted:
                self._started = self._ended = True
            elif self._stopping is None and self.result is None:
                self._stopping = reason
            network = self._network
        if unstarted:  # never ran: no result, and the backend forgets it now
            self._done(self)
            return
        if network is not None:
            _shut_down(network)
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(CLOSE_WAIT_S)
            if worker.is_alive():
                logger.warning("llama-server stream on %s did not stop", self._backend)

    def wait(self, *, first_token_only: bool = False) -> GenerationResult:
        """Run to the end and return the result."""
        for _ in self:
            pass
        if self.result is None:
            raise GenerationError("the generation was closed before it started")
        return self.result

    # the worker ---------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            self._t0 = time.perf_counter()
            self._worker = threading.Thread(
                target=self._run, name="chatctx-llama-server-stream", daemon=True
            )
            # Started under the lock: a close() from another thread never finds a worker it
            # cannot join yet.
            self._worker.start()

    def _run(self) -> None:
        try:
            self._read()
        except BaseException as exc:
            if self._stopping is None:
                self._error = exc
        finally:
            with self._lock:
                self._network = None
                self.result = self._result()
            self._out.put(_END)
            self._done(self)

    def _read(self) -> None:
        what = f"completion on slot {self._body.get('id_slot')}"
        with (
            translated(self._backend, what),
            self._client.stream(
                "POST", "/completion", json=self._body, extensions={"trace": self._trace}
            ) as response,
        ):
            if response.status_code >= 400:
                response.read()
                check(response, self._backend, what)
            for line in sse_lines(response.iter_bytes()):
                event = sse_event(line)
                if event is None:
                    continue
                error = error_of(event)
                if error is not None:
                    raise_error(self._backend, what, int(error.get("code") or 500), error)
                self._take(event)
                if event.get("stop"):
                    return
            if self._stopping is None:
                raise httpx.RemoteProtocolError("the stream ended before its last event")

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        # httpcore's connection events: the socket is known from the moment it connects,
        # long before llama-server sends its headers (after the prefill and first token).
        if event != "connection.connect_tcp.complete":
            return
        with self._lock:
            self._network = info.get("return_value")
            stopping = self._stopping is not None
        if stopping:
            _shut_down(self._network)

    def _take(self, event: dict[str, Any]) -> None:
        tokens = event.get("tokens") or []
        if (tokens or event.get("content")) and self._t_first is None:
            self._t_first = time.perf_counter()
        # llama-server sends a token only once the text so far is whole UTF-8: the first
        # tokens of a character split over several are never sent. Each event's predicted_n
        # (timings_per_token) counts the tokens sampled so far, which shows the gap.
        sampled = (event.get("timings") or {}).get("predicted_n")
        if (
            tokens
            and self._known is None
            and isinstance(sampled, int)
            and sampled > len(self._tokens) + len(tokens)
        ):
            self._known = len(self._tokens)
        self._tokens += [int(t) for t in tokens]
        self._last = event
        if isinstance(event.get("id_slot"), int) and event["id_slot"] >= 0:
            self.slot = event["id_slot"]
        content = event.get("content") or ""
        if content:
            self._text += content
            self._out.put(content)

    def _result(self) -> GenerationResult:
        t_end = time.perf_counter()
        last = self._last
        timings = last.get("timings") or {}
        prompt_n = int(timings.get("prompt_n") or 0)
        cache_n = int(timings.get("cache_n") or 0)
        if not timings:  # ended before the server said anything: nothing was reused
            prompt_n, cache_n = 0, 0
        eos = last.get("stop_type") == "eos"
        sampled = int(timings.get("predicted_n") or 0)
        if self._known is None and sampled > len(self._tokens):
            self._known = len(self._tokens)  # the last character's tokens never came
        if self._known is not None:
            # Tokens went unsent: ``tokens`` keeps those known in order (the reply's first
            # ones), the count is the server's, less the end-of-generation token it counts.
            self._tokens = self._tokens[: self._known]
            generated = max(sampled - (1 if eos else 0), len(self._tokens))
        else:
            if eos and self._tokens:
                # The server sends the end-of-generation token it sampled; chatctx's replies
                # (the engine's) never count it, and it is not in the slot's cache.
                self._tokens.pop()
            generated = len(self._tokens)
        if self._error is not None:
            stop = "error"
        elif self._stopping is not None and not last.get("stop"):
            stop = self._stopping
        else:
            stop = STOP_REASONS.get(str(last.get("stop_type")), "length")
            if stop == "length" and cache_n + prompt_n + generated >= self._n_ctx - 1:
                stop = "context_full"
        decode_ms = float(timings.get("predicted_ms") or 0.0)
        per_s = timings.get("predicted_per_second")
        first = self._t_first
        return GenerationResult(
            text=self._text,
            tokens=tuple(self._tokens),
            usage=Usage(
                prompt_tokens=len(self._prompt),
                reused_tokens=cache_n,
                evaluated_tokens=prompt_n + self._asked,
                generated_tokens=generated,
            ),
            timings=Timings(
                prefill_ms=float(timings.get("prompt_ms") or 0.0),
                ttft_ms=(first - self._t0) * 1000 if first is not None else None,
                engine_ttft_ms=(first - self._t0) * 1000 if first is not None else None,
                decode_ms=decode_ms,
                decode_tokens_per_s=float(per_s) if per_s and generated > 1 else None,
                total_ms=(t_end - self._t0) * 1000,
            ),
            stop_reason=stop,
            kv=self._report(cache_n, prompt_n) if timings else None,
            started_at=self._t0,
            slot=self.slot,
        )


def _shut_down(network: Any) -> None:
    """Wake a thread blocked on this connection: shut its socket down (closing it alone may
    leave a blocked ``recv`` waiting); the server sees the peer gone and stops the slot."""
    sock = network.get_extra_info("socket") if network is not None else None
    if isinstance(sock, socket.socket):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            logger.debug("shutting a llama-server connection down failed", exc_info=True)
