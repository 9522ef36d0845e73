"""One reply of a ``ChatSession`` as the HTTP side sees it: deltas, stop strings, cuts.

``TurnRun`` drives ``ChatSession.astream``. It holds back text that may begin a stop string
and ends the reply at one (the stored message is then cut there too, status complete). A
deadline (the request timeout) or the drain signal cuts the reply where it is: the session
stores it as ``partial`` and the client gets what was written, with finish_reason
``length``. Leaving early (a client that hung up) ends it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

from chatctx.session import Ask, ChatSession, Reply
from chatctx.settings import GenerationSettings

logger = logging.getLogger("chatctx.serve")


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


class Cut:
    """Set when the server drains: the turn's reply is cut where it is.

    Setting it wakes the turn's wait for its next chunk directly, so that no task per chunk
    has to wait on an event beside it (a reply of N chunks used to start 2N tasks).
    """

    __slots__ = ("_set", "_wake")

    def __init__(self) -> None:
        self._set = False
        self._wake: Callable[[], None] | None = None

    def set(self) -> None:
        self._set = True
        if self._wake is not None:
            self._wake()

    def is_set(self) -> bool:
        return self._set

    @contextlib.contextmanager
    def waking(self, wake: Callable[[], None]) -> Iterator[None]:
        """Within the block, setting it calls ``wake`` too."""
        self._wake = wake
        try:
            yield
        finally:
            self._wake = None


class TurnRun:
    """A reply being generated: ``await next_delta()`` until None, then ``await finish()``."""

    def __init__(
        self,
        session: ChatSession,
        text: str | Ask,
        *,
        stops: list[str],
        deadline: float,
        cancel: Cut,
        before: Callable[[], None] | None = None,
        settings: GenerationSettings | None = None,
    ) -> None:
        self.session = session
        self.stops = stops
        self.deadline = deadline  # loop.time() when the reply is cut
        self.cancel = cancel  # set when the server drains
        self._before = session.last_reply
        self._before_user = session.last_user
        self.handed_at: float | None = None  # perf_counter() when the session took the turn

        def handed() -> None:
            self.handed_at = time.perf_counter()
            if before is not None:
                before()

        # ``before`` (storing what the request adds) runs in the turn's own worker thread;
        # the request's sampling is stored with its user message
        self._stream: AsyncIterator[str] = session.astream(text, before=handed, settings=settings)
        self.raw = ""  # what the model wrote (for a stop: up to it)
        self.sent = 0  # characters of ``raw`` handed out
        self.cut: str | None = None  # "stop" | "timeout" | "drain" | "gone"
        self.started = False  # a first delta was asked for
        self.finished = False
        self.reply: Reply | None = None

    async def next_delta(self) -> str | None:
        """The next text to send (never empty), None at the end.

        The first call raises what the session raises before any output (a
        ``ContextBudgetError``, a closed store ...), so the caller can still answer an error.
        """
        self.started = True
        while not self.finished:
            chunk = await self._next_chunk()
            if chunk is None:
                await self._end()
                tail = self.raw[self.sent :]
                self.sent = len(self.raw)
                return tail or None
            self.raw += chunk
            out = self._ready()
            if self.cut == "stop":
                await self._end()
                return out or None
            if out:
                return out
        return None

    def _ready(self) -> str:
        """Text that can go out now; a stop string found ends the reply before it."""
        if self.stops:
            start = max(0, self.sent - max(len(s) for s in self.stops))
            found = [i for i in (self.raw.find(s, start) for s in self.stops) if i >= 0]
            if found:
                end = min(found)
                self.cut = "stop"
                self.raw = self.raw[:end]
            else:
                end = len(self.raw) - _held_back(self.raw, self.stops)
        else:
            end = len(self.raw)
        out = self.raw[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    async def _next_chunk(self) -> str | None:
        loop = asyncio.get_running_loop()
        if self.cancel.is_set() or loop.time() >= self.deadline:
            self.cut = "drain" if self.cancel.is_set() else "timeout"
            return None
        # The deadline, or the drain through ``cancel``, cancels the wait for the chunk: the
        # session then ends the reply (stored as partial) and lets go of its slot before the
        # wait returns.
        try:
            async with asyncio.timeout_at(self.deadline) as timeout:

                def wake() -> None:
                    if not timeout.expired():
                        timeout.reschedule(loop.time())

                with self.cancel.waking(wake):
                    chunk: str = await anext(self._stream)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:  # the client hung up: the reply has ended, go
            self.cut = "gone"
            raise
        except Exception as exc:
            if not timeout.expired():
                raise
            if not isinstance(exc, TimeoutError):
                logger.warning("a cut reply ended with %s: %s", type(exc).__name__, exc)
            self.cut = "drain" if self.cancel.is_set() else "timeout"
            return None
        return chunk

    async def _end(self) -> None:
        if self.finished:
            return
        self.finished = True
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()  # a stop string: the session stores the reply (then cut below)
        reply = self.session.last_reply
        self.reply = reply if reply is not self._before else None
        if self.reply is None:
            return
        if self.cut == "stop":
            if self.reply.message_id is not None:
                await asyncio.to_thread(
                    self.session.store.update_message,
                    self.reply.message_id,
                    content=self.raw,
                    status="complete",
                )
        elif self.reply.text.startswith(self.raw):
            # What the model wrote after the last chunk read here (a cut) goes out too, so
            # the client has what is stored.
            self.raw = self.reply.text

    async def close(self) -> None:
        """End the reply if it is still going (a client gone, an error); idempotent."""
        if self.finished:
            return
        if self.cut is None:
            self.cut = "gone"
        with contextlib.suppress(Exception):
            await self._end()

    @property
    def stored_user(self) -> bool:
        """Whether this turn stored its user message (then it must not be sent again)."""
        return self.session.last_user is not self._before_user

    @property
    def finish_reason(self) -> str:
        if self.cut == "stop":
            return "stop"
        if self.cut is not None or self.reply is None:
            return "length"
        if self.reply.tool_calls:
            return "tool_calls"
        return "stop" if self.reply.stop_reason == "eog" else "length"

    @property
    def stop_reason(self) -> str:
        """chatctx's own reason: eog, length, stop (a stop string), timeout, drain ..."""
        if self.cut is not None:
            return self.cut
        return self.reply.stop_reason if self.reply is not None else "interrupted"
