"""A turn's claim on its conversation in the store: one turn at a time across processes.

Within one process a conversation's turns already run one at a time (a backend leases its
slot to one turn). Bot workers in several processes or on several machines share only the
store: without a claim, two of them answering one conversation at once would each build
their prompt without the other's turn and store ``user, user, reply, reply``, so the next
prompt shows a reply under the wrong question. A ``ChatSession`` turn therefore claims the
conversation in the store (``Store.claim_turn``, one compare-and-set) before it reads the
history, renews the claim while it runs and lets it go once its reply is stored; a turn of
another process waits meanwhile. A claim whose process died runs out after ``CLAIM_TTL_S``,
or at once when the waiting turn runs where that process ran (the same kernel and process
namespace, so its process id means the same) and sees it gone: a worker that crashed and is
restarted goes on without the wait. ``chatctx serve`` claims its turns with ``try_claim``
too (its own loop: a 409 when the wait runs out).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from chatctx._process import running
from chatctx.errors import ChatctxError, ClosedError, ConfigError
from chatctx.store._db import Store

logger = logging.getLogger("chatctx.session")

CLAIM_TTL_S = 30.0  # a claim's life; renewed every third of it while its turn runs
CLAIM_POLL_S = 0.5  # the longest pause between tries while another turn holds the claim


def _pid_space() -> str:
    """Where this process's id is meaningful: this boot of this kernel, this pid namespace
    (two containers on one machine share the boot, not the namespace); "-" where unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return "-"
    return hashlib.sha256(f"{boot}/{namespace}".encode()).hexdigest()[:12]


_PID_SPACE = _pid_space()

# The claims this process holds, by (database, conversation): the thread that took each. A
# thread taking a second turn of a conversation its own unfinished turn holds would wait for
# itself forever; it is refused instead.
_HELD: dict[tuple[str, str], int] = {}
_HELD_LOCK = threading.Lock()


def new_owner() -> str:
    """A new claim owner: ``host:pid:pid space:nonce`` (``_gone`` reads it back)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_PID_SPACE}:{uuid.uuid4().hex[:12]}"


def _gone(owner: str) -> bool:
    """Whether ``owner``'s process is known to have ended: it ran in this pid space and no
    process (or only its unreaped remains) has its id now. Unknown means not gone."""
    parts = owner.rsplit(":", 3)
    if len(parts) != 4 or _PID_SPACE == "-" or parts[2] != _PID_SPACE:
        return False
    try:
        pid = int(parts[1])
    except ValueError:
        return False
    if pid == os.getpid() or pid <= 0:
        return False
    return running(pid) is False


def try_claim(store: Store, conversation_id: str, owner: str, ttl_s: float) -> bool:
    """One try at the conversation's turn: claim it (or renew ``owner``'s claim), or take
    over the claim of a process that is gone without waiting for it to run out."""
    if store.claim_turn(conversation_id, owner, ttl_s):
        return True
    held = store.turn_claim(conversation_id)
    if held is None or not _gone(held[0]):
        return False
    if not store.take_over_turn(conversation_id, owner, held[0], ttl_s):
        return False
    logger.info("took over the turn claim of %s from %s, gone", conversation_id, held[0])
    return True


class TurnClaim:
    """One turn's claim: ``take`` waits for it, ``release`` lets it go (once, any thread)."""

    def __init__(self, store: Store, conversation_id: str, *, ttl_s: float | None = None):
        self.store = store
        self.conversation_id = conversation_id
        self.ttl_s = CLAIM_TTL_S if ttl_s is None else ttl_s
        # One owner per turn, not per session: a session's second turn waits for its first.
        self.owner = new_owner()
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._held = False

    def take(self, check: Callable[[], None]) -> None:
        """Claim the conversation's turn, waiting while another turn holds it.

        ``check`` runs between tries and raises to stop waiting (the session was closed, the
        turn's reader left); the claim is then not taken.
        """
        key = self._key()
        with _HELD_LOCK:
            if _HELD.get(key) == threading.get_ident():
                raise ConfigError(
                    f"conversation {self.conversation_id!r} already has a turn in flight in "
                    "this thread"
                )
        pause = 0.01
        while True:
            check()
            if self._released.is_set():
                raise ClosedError("chat session")
            if try_claim(self.store, self.conversation_id, self.owner, self.ttl_s):
                break
            time.sleep(pause)
            pause = min(pause * 2, CLAIM_POLL_S)
        with self._lock:
            late = self._released.is_set()  # released while the claim was on its way
            self._held = not late
            if not late:
                with _HELD_LOCK:
                    _HELD[key] = threading.get_ident()
        if late:
            self._let_go()
            check()
            raise ClosedError("chat session")
        threading.Thread(target=self._renew, name="chatctx-turn-claim", daemon=True).start()

    def release(self) -> None:
        """Let the claim go; the next turn (of any process) may start."""
        with self._lock:
            if self._released.is_set():
                return
            self._released.set()
            held, self._held = self._held, False
            if held:
                with _HELD_LOCK:
                    _HELD.pop(self._key(), None)
        if held:
            self._let_go()

    def _key(self) -> tuple[str, str]:
        url = self.store.url
        if url in ("sqlite://", "sqlite:///:memory:"):  # a database of this store alone
            url = f"{url}#{id(self.store)}"
        return (url, self.conversation_id)

    def _renew(self) -> None:
        while not self._released.wait(self.ttl_s / 3):
            try:
                if not self.store.renew_turn(self.conversation_id, self.owner, self.ttl_s):
                    if self._released.is_set():  # let go while this renewal was on its way
                        return
                    logger.warning(
                        "the turn claim of %s ran out and another turn took it",
                        self.conversation_id,
                    )
            except ChatctxError as exc:  # the next try may get through; the turn goes on
                logger.warning(
                    "renewing the turn claim of %s failed: %s", self.conversation_id, exc
                )

    def _let_go(self) -> None:
        if self.store.closed:
            return
        with contextlib.suppress(ChatctxError):
            self.store.release_turn(self.conversation_id, self.owner)
