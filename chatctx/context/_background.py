"""Summaries off the critical path: a slow summarizer runs in a thread between turns.

The evicting turn goes out at once with the previous summary (and recall); the new summary
takes effect at the first turn after it is done. It starts writing once that turn is under
way (``gate``): started earlier, its first prompt chunk holds the model while the customer's
prompt waits behind it. Only summarizers that can report partial
progress (a ``fold`` method, as ``LLMSummarizer`` has) are run this way.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from chatctx.store import Message

logger = logging.getLogger("chatctx.context")

RUNNING = "the summary is being written in the background"
GATE_TIMEOUT_S = 30.0  # a gate never opened (a turn that died) holds a summary this long

Fold = Callable[..., tuple[str | None, list[int], str | None]]


@dataclass(slots=True)
class _Job:
    base: str | None  # the summary it extends
    ids: list[int]
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[str | None, list[int], str | None] | None = None
    error: str | None = None
    seconds: float = 0.0


class BackgroundSummarizer:
    """Wraps a folding summarizer so that ``fold`` never blocks a turn.

    ``fold(previous, messages)`` returns the finished result of an earlier job when that job
    started from ``previous``; otherwise it starts a job over ``messages`` (if none is
    running) and reports no progress, so the messages stay pending. ``ready()`` tells the
    builder a result is waiting, so it can take it at the next turn even without an eviction.
    Calling the object directly (``summarizer(previous, messages)``) runs synchronously.
    ``gate(timeout)``, when given, is waited for before a job starts writing: the session
    opens it once the turn that started the job has its first token.
    """

    def __init__(
        self, inner: Fold, *, timeout_s: float, gate: Callable[[float], bool] | None = None
    ) -> None:
        self._fold = inner
        self.timeout_s = timeout_s
        self._gate = gate
        self._lock = threading.Lock()
        self._job: _Job | None = None
        self.last_job_seconds: float | None = None
        self._peeking = threading.local()  # set by peeking(): look, take and start nothing

    @contextlib.contextmanager
    def peeking(self) -> Iterator[None]:
        """In this block (this thread), ``fold`` shows a finished result without taking it
        and starts nothing: what ``ChatSession.plan`` needs to show a turn and change none."""
        self._peeking.on = True
        try:
            yield
        finally:
            self._peeking.on = False

    def __call__(self, previous: str | None, messages: Sequence[Message]) -> str:
        text, _, _ = self._fold(
            previous, list(messages), deadline=time.monotonic() + self.timeout_s
        )
        return text or ""

    def ready(self) -> bool:
        job = self._job
        return job is not None and job.done.is_set() and job.error is None

    def running(self) -> bool:
        job = self._job
        return job is not None and not job.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the running job (if any) is done; for tests and orderly shutdown."""
        job = self._job
        return True if job is None else job.done.wait(timeout)

    def fold(
        self,
        previous: str | None,
        messages: Sequence[Message],
        *,
        deadline: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> tuple[str | None, list[int], str | None]:
        asked = {m.id for m in messages}
        peek = getattr(self._peeking, "on", False)
        with self._lock:
            job = self._job
            if peek:
                if job is not None and job.done.is_set() and job.error is None:
                    result = job.result
                    if result is not None and job.base == previous:
                        text, covered, stopped = result
                        return text, [i for i in covered if i in asked], stopped
                return previous, [], RUNNING
            if job is not None and job.done.is_set():
                self._job = None
                self.last_job_seconds = job.seconds
                if job.error is None and job.result is not None and job.base == previous:
                    text, covered, stopped = job.result
                    return text, [i for i in covered if i in asked], stopped
                if job.error is not None:
                    logger.warning("background summary failed: %s", job.error)
            if self._job is None and messages:
                self._start(previous, list(messages))
        return previous, [], RUNNING

    def _start(self, previous: str | None, messages: list[Message]) -> None:
        job = _Job(base=previous, ids=[m.id for m in messages], started=time.monotonic())
        self._job = job

        def run() -> None:
            try:
                if self._gate is not None:
                    self._gate(GATE_TIMEOUT_S)
                job.result = self._fold(
                    previous, messages, deadline=time.monotonic() + self.timeout_s
                )
            except Exception as exc:  # reported at the next fold; the chat goes on
                job.error = f"{type(exc).__name__}: {exc}"
            finally:
                job.seconds = time.monotonic() - job.started
                job.done.set()

        threading.Thread(target=run, name="chatctx-summary", daemon=True).start()
