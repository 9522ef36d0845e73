"""``ChatSession``'s asyncio side: a turn runs in a worker thread and its chunks cross to the
event loop; a reader that leaves early stops the turn and waits until its reply is stored.

Mixed into ``ChatSession`` (``chatctx.session``), which owns what is declared here.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any

from chatctx.session._turn import Reply, TurnInFlight
from chatctx.settings import GenerationSettings


class AsyncTurns:
    """``ChatSession``'s bridge from its turn threads to asyncio (mixed in)."""

    _turns: set[TurnInFlight]
    _turns_changed: threading.Condition

    if TYPE_CHECKING:  # defined by the class this is mixed into

        def _open_stream(
            self,
            text: str,
            replies: list[Reply] | None,
            sampling: GenerationSettings | None = None,
            *,
            cut: threading.Event | None = None,
        ) -> Generator[str, None, None]: ...

    async def _astream(
        self,
        text: str,
        replies: list[Reply] | None,
        before: Callable[[], None] | None = None,
        settings: GenerationSettings | None = None,
    ) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        stop = threading.Event()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(chunks.put_nowait, (kind, value))

        def work() -> None:
            try:
                if before is not None:
                    before()
                stream = self._open_stream(text, replies, settings, cut=stop)
                try:
                    for chunk in stream:
                        put("chunk", chunk)
                        if stop.is_set():
                            break
                finally:
                    stream.close()
            except BaseException as exc:  # handed to the awaiting task
                put("error", exc)
            finally:
                put("end", None)

        worker = threading.Thread(target=work, name="chatctx-astream", daemon=True)
        worker.start()
        ended = False
        try:
            while True:
                kind, value = await chunks.get()
                if kind == "chunk":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    ended = True
                    break
        finally:
            stop.set()
            if not ended:
                # Left early (a reader gone, a timeout): the turn stops where it is, even in
                # its prefill, and the worker stores what it has. This waits for that even
                # when the task was cancelled: a caller that goes on at once (a server taking
                # the conversation's next request) must find the reply stored.
                await _outlast_cancellation(asyncio.to_thread(self._cut, stop, worker))

    def _cut(self, cut: threading.Event, worker: threading.Thread) -> None:
        """Stop the turn whose reader left (``cut`` is set) and wait for its thread to end.

        Closing the backend's stream stops a prefill under way too; the turn's own thread
        then stores what was generated (``partial``), as when the reader closes the stream.
        """
        with self._turns_changed:
            turns = [t for t in self._turns if t.cut is cut]
        for turn in turns:
            with turn.lock:  # a user message being written, a generation being started
                stream = turn.stream
            if stream is not None:
                stream.close()
        worker.join()


async def _outlast_cancellation(awaitable: Awaitable[None]) -> None:
    """Await ``awaitable`` to its end even if the awaiting task is cancelled meanwhile; the
    cancellation is raised afterwards.

    A task cancelled by asyncio is told once; one inside an anyio cancel scope (Starlette's
    response to a client that hung up) is told again at every await, unless shielded.
    """
    future = asyncio.ensure_future(awaitable)
    cancelled: asyncio.CancelledError | None = None
    with _shield():
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError as exc:
                cancelled = exc
    future.result()
    if cancelled is not None:
        raise cancelled


def _shield() -> contextlib.AbstractContextManager[Any]:
    try:
        import anyio
    except ImportError:  # no anyio: nothing cancels through its scopes either
        return contextlib.nullcontext()
    return anyio.CancelScope(shield=True)
