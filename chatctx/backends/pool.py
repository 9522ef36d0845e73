"""The slot pool: conversations lease KV sequences of one engine.

A conversation leases a slot while it has a turn in flight; when it comes back it finds its
cache in the same slot unless another conversation needed one (the least recently used idle
slot goes). The loser's state is swapped out (``_swap``) and loaded into whichever slot it
gets next. The summary sequence is reserved and never leased.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from chatctx.backends.base import Lease
from chatctx.backends.swap import SwapHit
from chatctx.errors import ClosedError, ConfigError, DeadlineExceeded

__all__ = ["Lease", "SlotPool"]


# A waiter whose lease timed out keeps its place in the line this long: a caller that polls
# (``ChatSession`` asks again every half second, to notice a close) is not sent to the back
# of the line each time, behind conversations that came after it; nor is one that took its
# place, then built its context. (A first build that loads the codec and the sentence
# embedder takes longer on a small CPU: ``chatctx serve`` loads them before it is ready.)
AWAY_S = 2.0
# Between two of its calls (the moment a caller takes to ask again) a waiter still holds its
# place: a slot freed in that moment waits for it, so polling never costs a turn. One that
# has not asked again within this long holds no one up any more.
AWAY_GRACE_S = 0.1


@dataclass(eq=False)
class _Waiter:
    owner: str
    thread: int
    wake: threading.Condition  # on the pool's lock: notified when this waiter may go
    away_until: float | None = None  # set while its caller is between two lease calls
    away_since: float = 0.0  # time.monotonic() its last call timed out

    def holds_place(self, now: float) -> bool:
        return self.away_until is None or now - self.away_since < AWAY_GRACE_S


@dataclass
class _Slot:
    seq_id: int
    owner: str | None = None
    leased: bool = False
    pinned: bool = False
    last_use: float = 0.0  # time.monotonic()
    last_use_wall: str | None = None
    ticket: int = 0
    thread: int | None = None  # the thread holding the lease


class SlotPool:
    """``n`` slots (sequences ``0..n-1``). The engine provides the KV operations.

    ``swap_out(seq_id, owner)`` saves and clears a slot; ``swap_in(seq_id, owner)`` loads a
    saved state into an empty slot and says how it went. ``lease`` runs them outside the
    pool's lock, the slot and both owners marked as moving; ``pin`` (the expert option) under
    it. ``on_change`` (the slot table) is called outside the lock.
    """

    def __init__(
        self,
        n: int,
        *,
        swap_out: Callable[[int, str], None],
        swap_in: Callable[[int, str], tuple[SwapHit, float]],
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.slots = [_Slot(i) for i in range(n)]
        self._swap_out = swap_out
        self._swap_in = swap_in
        self._on_change = on_change
        # One lock; waiters in line each sleep on a condition of their own, woken when they
        # are the one who may go (``_notify``); other waits (``evict``, ``wait_released``)
        # sleep on ``_cv``.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._closed = False
        self._tickets = itertools.count(1)
        self._moving: set[str] = set()  # owners whose state is being saved or restored
        # Conversations waiting for a slot, in arrival order: a freed slot goes to the one
        # waiting longest, never to whichever thread wakes first or comes last.
        self._line: collections.deque[_Waiter] = collections.deque()

    def owner_of(self, seq_id: int) -> str | None:
        return self.slots[seq_id].owner if seq_id < len(self.slots) else None

    def slot_of(self, owner: str) -> _Slot | None:
        return next((s for s in self.slots if s.owner == owner), None)

    def lease(self, owner: str, *, timeout: float | None = None) -> Lease:
        """A slot for ``owner``'s turn: its own if still there, else a free or LRU idle one.

        While any wait, slots go in the order conversations asked: a returning conversation
        whose own slot is idle waits its turn too (its slot is the least recently used one the
        first in line takes), so a busy pool serves everyone alike instead of whoever comes
        back fastest.

        Waits while every slot is leased (or ``owner`` has a turn in flight, or its state is
        being moved); ``timeout`` seconds at most, then ``DeadlineExceeded``. Saving the
        loser's state and restoring ``owner``'s (disk reads, llama.cpp's state calls) run
        outside the pool's lock: other conversations lease and release meanwhile.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        victim: _Slot | None = None
        loser: str | None = None
        with self._cv:
            # Our place in the line, once we wait: kept from a call of this thread for this
            # owner that timed out a moment ago.
            turn = self._resume(owner)
            resumed = turn is not None
            try:
                while True:
                    self._check_open()
                    slot = self.slot_of(owner)
                    if owner in self._moving:
                        pass  # its state is being saved or restored: wait for it
                    elif slot is not None and slot.leased and slot.thread == threading.get_ident():
                        raise ConfigError(
                            f"conversation {owner!r} already has a turn in flight in this thread"
                        )
                    elif self._next_in_line(turn):
                        if slot is not None and not slot.leased:
                            self._take(slot)
                            lease = Lease(owner, slot.seq_id, ticket=slot.ticket)
                            break
                        if slot is None and (victim := self._victim()) is not None:
                            loser, victim.owner = victim.owner, owner
                            self._take(victim)
                            self._moving.update(o for o in (owner, loser) if o is not None)
                            break
                    if turn is None:
                        turn = _Waiter(
                            owner, threading.get_ident(), threading.Condition(self._lock)
                        )
                        self._line.append(turn)
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise DeadlineExceeded(
                            f"no slot free for conversation {owner!r} within {timeout} s",
                            what="slot",
                            seconds=timeout,
                        )
                    turn.wake.wait(self._pause(left))
            except DeadlineExceeded:
                # A caller that waited (or had waited) asks again soon: it keeps its place.
                # A mere try (timeout 0, not in line before) leaves none.
                if turn is not None and (resumed or (timeout or 0) > 0):
                    turn.away_since = time.monotonic()
                    turn.away_until = turn.away_since + AWAY_S
                    turn = None
                raise
            finally:
                if turn is not None:  # served or closed: the next in line goes
                    self._line.remove(turn)
                    self._notify()
                # One that timed out wakes no one: it was not the first who could take a
                # slot (that one is served before its deadline), so its going away lets no
                # one else go. (Waking every waiter at each poll of each waiter was the pool's
                # main cost with 28 turns in line.)
        if victim is None:
            self._on_change()
            return lease
        try:
            if loser is not None:
                self._swap_out(victim.seq_id, loser)
            hit, ms = self._swap_in(victim.seq_id, owner)
        except BaseException:
            with self._cv:
                victim.leased = False
                victim.thread = None
                victim.owner = None
                raise
        finally:
            with self._cv:
                self._moving.difference_update(o for o in (owner, loser) if o is not None)
                self._notify()
        self._on_change()
        if hit.entry is None:
            return Lease(owner, victim.seq_id, reprefill_reason=hit.reason, ticket=victim.ticket)
        return Lease(
            owner,
            victim.seq_id,
            swap_in=hit.where,
            swap_in_ms=ms,
            swap_in_bytes=hit.entry.size if hit.size is None else hit.size,
            ticket=victim.ticket,
        )

    def pin(self, owner: str, seq_id: int) -> None:
        """Give ``owner`` slot ``seq_id`` for good (the expert ``seq_id=`` option)."""
        with self._cv:
            self._check_open()
            if not 0 <= seq_id < len(self.slots):
                raise ConfigError(
                    f"sequence {seq_id} is not a slot: slots are 0..{len(self.slots) - 1}, "
                    "the rest are reserved for summaries"
                )
            slot = self.slots[seq_id]
            mine = self.slot_of(owner)
            if mine is not None and mine is not slot:
                if mine.leased or mine.pinned:
                    raise ConfigError(f"conversation {owner!r} already holds slot {mine.seq_id}")
                self._swap_out(mine.seq_id, owner)
                mine.owner = None
            if slot.owner not in (None, owner):
                if slot.leased or slot.pinned:
                    raise ConfigError(
                        f"slot {seq_id} is held by conversation {slot.owner!r}; "
                        "leave seq_id unset to lease a free one"
                    )
                self._swap_out(slot.seq_id, slot.owner)
            if slot.owner != owner:
                slot.owner = owner
                self._swap_in(slot.seq_id, owner)
            slot.pinned = True
        self._on_change()

    def unpin(self, owner: str) -> None:
        with self._cv:
            slot = self.slot_of(owner)
            if slot is not None:
                slot.pinned = False
                self._notify()
        self._on_change()

    def release(self, lease: Lease) -> None:
        with self._cv:
            slot = self.slots[lease.seq_id]
            if slot.owner == lease.owner and slot.leased and slot.ticket == lease.ticket:
                slot.leased = False
                slot.thread = None
                slot.last_use = time.monotonic()
                slot.last_use_wall = datetime.now(UTC).isoformat()
            self._notify()
        self._on_change()

    def forget(self, seq_id: int) -> None:
        """The slot's cache was cleared outside the pool: it belongs to no one now."""
        with self._cv:
            slot = self.slots[seq_id] if seq_id < len(self.slots) else None
            if slot is not None and not slot.leased and not slot.pinned:
                slot.owner = None
                self._notify()

    def evict(self, owner: str) -> bool:
        """Swap ``owner``'s cache out of its slot (the slot is free after); False when it
        holds none. Waits while its turn is in flight or its state is being moved."""
        with self._cv:
            while True:
                self._check_open()
                slot = self.slot_of(owner)
                if slot is None:
                    return False
                if not slot.leased and owner not in self._moving:
                    break
                self._cv.wait()
            if slot.pinned:
                raise ConfigError(f"conversation {owner!r} is pinned to slot {slot.seq_id}")
            slot.leased = True  # nobody takes it while its state is saved
            self._moving.add(owner)
        try:
            self._swap_out(slot.seq_id, owner)
        finally:
            with self._cv:
                slot.leased = False
                slot.owner = None
                self._moving.discard(owner)
                self._notify()
        self._on_change()
        return True

    def wait_released(self, timeout: float) -> bool:
        """Wait until no slot is leased (at most ``timeout`` seconds); True if none is."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while any(s.leased for s in self.slots):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            for waiting in self._line:
                waiting.wake.notify()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("engine")

    def _take(self, slot: _Slot) -> None:
        slot.leased = True
        slot.ticket = next(self._tickets)
        slot.thread = threading.get_ident()
        slot.last_use = time.monotonic()
        slot.last_use_wall = datetime.now(UTC).isoformat()

    def _resume(self, owner: str) -> _Waiter | None:
        """This thread's place in line for ``owner``, kept from a lease that timed out; the
        places of callers that did not come back in time are dropped."""
        now, thread = time.monotonic(), threading.get_ident()
        found = None
        for waiter in list(self._line):
            if waiter.away_until is None:
                continue
            if waiter.owner == owner and waiter.thread == thread and found is None:
                waiter.away_until = None
                found = waiter
            elif waiter.away_until < now:
                self._line.remove(waiter)
        return found

    def _next_in_line(self, turn: _Waiter | None) -> bool:
        """Whether the holder of ``turn`` (None: not in line yet) is the first in line who
        can take a slot now."""
        return self._first_ready() is turn

    def _first_ready(self) -> _Waiter | None:
        """The first in line who can take a slot now (None: no one); one away for a while
        holds no one up."""
        now = time.monotonic()
        return next((w for w in self._able() if w.holds_place(now)), None)

    def _able(self) -> Iterator[_Waiter]:
        """Those in line who could take a slot now, in order. One who cannot (its state is
        being moved, its own slot is busy with another of its turns, or no slot is free for
        it) holds no one up, such as the owner of an idle pinned slot, which no one else may
        take."""
        room = self._victim() is not None  # the same for every waiter without a slot
        for waiting in self._line:
            if waiting.owner in self._moving:
                continue
            slot = self.slot_of(waiting.owner)
            if not slot.leased if slot is not None else room:
                yield waiting

    def _notify(self) -> None:
        """After a change (under the lock): wake the other waits, and of the line only the
        one who may go now; it wakes the next as it leaves the line. (Waking the whole line
        at each lease and release, every woken turn looking at the line again, was a third
        of the pool's CPU time with 28 turns in line.) One between two calls is passed over,
        and the next woken too: it waits out the other's grace (``_pause``) and goes if that
        one has not come back."""
        self._cv.notify_all()
        for waiting in self._able():
            waiting.wake.notify()  # a no-op for one between two calls
            if waiting.away_until is None:
                return

    def _pause(self, left: float | None) -> float | None:
        """How long a waiter may sleep: ``left``, but no longer than until a waiter that is
        between two calls stops holding its place."""
        now = time.monotonic()
        ends = [
            w.away_since + AWAY_GRACE_S - now
            for w in self._line
            if w.away_until is not None and w.holds_place(now)
        ]
        if not ends:
            return left
        grace = max(0.0, min(ends))
        return grace if left is None else min(left, grace)

    def _victim(self) -> _Slot | None:
        free = [s for s in self.slots if s.owner is None and not s.leased and not s.pinned]
        if free:
            return free[0]
        idle = [s for s in self.slots if not s.leased and not s.pinned]
        return min(idle, key=lambda s: s.last_use) if idle else None


class PooledLeases:
    """``lease``, ``release``, ``pin`` and ``unpin`` of a backend whose slots are ``pool``
    (the engine's and the dry replay's)."""

    pool: SlotPool

    def _check_open(self) -> None:
        raise NotImplementedError

    def lease(self, conversation: str, *, timeout: float | None = None) -> Lease:
        """A slot for one turn of ``conversation``: its own cache if still there, else a free
        or least recently used idle slot (its owner is swapped out), restored from a swap
        when ``conversation`` had one. Waits while every slot is leased."""
        self._check_open()
        return self.pool.lease(conversation, timeout=timeout)

    def release(self, lease: Lease) -> None:
        self.pool.release(lease)

    def pin(self, conversation: str, seq_id: int) -> None:
        """Give ``conversation`` slot ``seq_id`` until ``unpin`` (the expert ``seq_id=``)."""
        self._check_open()
        self.pool.pin(conversation, seq_id)

    def unpin(self, conversation: str) -> None:
        self.pool.unpin(conversation)
