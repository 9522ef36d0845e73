"""``ChatSession``'s asyncio side: a turn runs in a worker thread and its chunks cross to the
event loop; a reader that leaves early stops the turn and waits until its reply is stored."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any


async def stream_in_thread(
    start: Callable[[threading.Event], Generator[str, None, None]],
    stop_turn: Callable[[threading.Event], None],
    before: Callable[[], None] | None = None,
) -> AsyncIterator[str]:
    """The chunks of ``start(cut)``'s stream, run in a worker thread, on the event loop.

    ``before`` runs first in that thread. A reader that leaves early sets ``cut`` and calls
    ``stop_turn(cut)`` (which closes the turn's backend stream, stopping even a prefill), then
    waits for the worker to store what it has, even when the task is cancelled.
    """
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cut = threading.Event()

    def put(kind: str, value: Any) -> None:
        loop.call_soon_threadsafe(chunks.put_nowait, (kind, value))

    def work() -> None:
        try:
            if before is not None:
                before()
            stream = start(cut)
            try:
                for chunk in stream:
                    put("chunk", chunk)
                    if cut.is_set():
                        break
            finally:
                stream.close()
        except BaseException as exc:  # handed to the awaiting task
            put("error", exc)
        finally:
            put("end", None)

    def stop() -> None:
        stop_turn(cut)
        worker.join()

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
        cut.set()
        if not ended:
            # Left early (a reader gone, a timeout): the turn stops where it is, even in its
            # prefill, and the worker stores what it has. This waits for that even when the
            # task was cancelled: a caller that goes on at once (a server taking the
            # conversation's next request) must find the reply stored.
            await _outlast_cancellation(asyncio.to_thread(stop))


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
