"""SIGTERM and SIGINT as exceptions, so an interrupted reply ends through its ``finally`` blocks.

Python's default SIGTERM ends the process at once: a streaming reply would be lost. Inside
``interruptible()`` SIGTERM raises ``Terminated`` and SIGINT raises ``KeyboardInterrupt``
wherever the main thread is; ``ChatSession.stream``'s generator is then closed and stores the
partial reply as ``partial``. Only the first signal raises: while that interruption unwinds
(storing the reply), later ones are held back, so they cannot abort the store write; ``rearm()``
re-enables them (raising a held-back one). ``Terminated`` leaving the block exits with status
128 + SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, so ``except Exception`` does not swallow it."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


class Interrupts:
    """The installed handler: raises on the first signal, holds back the rest until rearmed."""

    def __init__(self) -> None:
        self.armed = True
        self.held: int | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False
            raise _exception(signum)
        if self.held is None or signum == signal.SIGTERM:
            self.held = signum  # SIGTERM wins: it ends the process

    def rearm(self) -> None:
        """The last interruption is handled: raise a held-back signal, or wait for the next."""
        held, self.held = self.held, None
        if held is not None:
            raise _exception(held)
        self.armed = True


@contextmanager
def interruptible() -> Iterator[Interrupts]:
    """Turn SIGTERM and SIGINT into exceptions in this block (main thread only).

    ``Terminated`` leaving the block becomes ``SystemExit(128 + signum)``; the previous
    handlers are restored on the way out. Ignored signals stay ignored.
    """
    handler = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield handler  # signal handlers can only be set from the main thread
        return
    # A signal the process was told to ignore (a background job's SIGINT) stays ignored.
    previous = {
        signum: signal.signal(signum, handler)
        for signum in _SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield handler
    except Terminated as exc:
        raise SystemExit(128 + exc.signum) from None
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
