"""Conversation-affine routing over several backends: each conversation stays where its cache is.

A ``Router`` is a ``Backend`` over N backends of one model (in-process engines, llama-servers
or both). Each conversation is placed on one of them by rendezvous hashing with bounded load
and stays there; the placement is a row in the store, so every bot process on every machine
sends a conversation's turns to the same backend::

    router = Router([LlamaServerBackend(url, model=gguf) for url in urls], store=store)
    session = ChatSession.open(store, conversation_id="c1", backend=router)

A health thread watches the backends. One that fails (refused, loading, gone mid-reply) is
marked down and its conversations are placed elsewhere; the turn that found it down is
retried on the new backend when it had produced no text yet (the session does that), and
its record says why it prefilled again ("failover: ..."). A backend that comes back takes
new conversations. ``drain(name)`` moves a backend's conversations away, with their KV state
where both backends can move it (``export_state``/``import_state``), else to re-prefill.

Slots: the router's sequence ids are ``index * SEQ_STRIDE + slot`` so that a lease names its
backend; turn records keep the backend's name and its own slot.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from chatctx._resource import Closeable
from chatctx.backends.base import (
    CACHE_EDITS,
    Backend,
    Codec,
    GenerationResult,
    Lease,
    MemorySnapshot,
    ModelInfo,
    Stream,
    TextEmbedder,
)
from chatctx.environment import variable
from chatctx.errors import (
    BackendUnavailable,
    ChatctxError,
    ClosedError,
    ConfigError,
    DeadlineExceeded,
)

if TYPE_CHECKING:
    from chatctx.model.tools import CallGrammar
    from chatctx.settings import GenerationSettings
    from chatctx.store import Placement, Store

__all__ = ["SEQ_STRIDE", "BackendState", "Router", "backends_from_env"]

logger = logging.getLogger("chatctx.backends.router")

SEQ_STRIDE = 1000  # router sequence id = backend index * SEQ_STRIDE + the backend's slot
LOAD_FACTOR = 1.25  # a backend takes new conversations up to this times the mean load
HEALTH_INTERVAL_S = 2.0
WITH_STATE = "with its KV state"  # a move that took the cache along: no re-prefill


@dataclass
class BackendState:
    """What the router knows of one backend now."""

    name: str
    backend: Backend
    down: str | None = None  # why it is down, None when up
    draining: bool = False
    leased: int = 0  # slots this router holds leased there
    failovers: int = 0  # conversations this router moved off it because it was down

    @property
    def live(self) -> bool:
        return self.down is None and not self.draining


def _score(conversation: str, backend: str) -> int:
    digest = hashlib.blake2b(f"{backend}\x00{conversation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def backends_from_env() -> list[str]:
    """``CHATCTX_BACKENDS``: llama-server URLs separated by commas or spaces."""
    raw = variable("CHATCTX_BACKENDS") or ""
    return [url for url in raw.replace(",", " ").split() if url]


def backend_name(backend: Backend, index: int) -> str:
    """A backend's stable name: its own ``name`` (a llama-server's URL), else by position."""
    name = getattr(backend, "name", None)
    return name if isinstance(name, str) and name else f"backend-{index}"


class Router(Closeable):
    """A ``Backend`` that places each conversation on one of ``backends`` and keeps it there.

    ``backends``: a list (names from each backend's ``name``, else ``backend-<i>``) or a
    mapping name → backend. ``store``: where placements live (a ``Store`` or its URL);
    without one they are this process's only. ``own``: close the backends with the router.
    """

    def __init__(
        self,
        backends: Sequence[Backend] | Mapping[str, Backend],
        *,
        store: Store | str | None = None,
        load_factor: float = LOAD_FACTOR,
        health_interval: float | None = HEALTH_INTERVAL_S,
        own: bool = False,
    ) -> None:
        named = (
            dict(backends)
            if isinstance(backends, Mapping)
            else {backend_name(b, i): b for i, b in enumerate(backends)}
        )
        if not named:
            raise ConfigError("a router needs at least one backend")
        if len(named) != len(backends):
            raise ConfigError("two backends have the same name")
        if load_factor < 1.0:
            raise ConfigError(f"load_factor must be at least 1.0, not {load_factor}")
        self._own = own
        self._states = [BackendState(name, backend) for name, backend in named.items()]
        self._by_name = {state.name: state for state in self._states}
        first = self._states[0].backend
        for state in self._states[1:]:
            other = state.backend
            if other.codec().fingerprint != first.codec().fingerprint:
                raise ConfigError(
                    f"backend {state.name} runs another model or template than "
                    f"{self._states[0].name}: a router serves one model"
                )
            if other.n_ctx != first.n_ctx:
                raise ConfigError(
                    f"backend {state.name} holds {other.n_ctx} tokens per slot, "
                    f"{self._states[0].name} {first.n_ctx}: give them the same n_ctx"
                )
        self._store, self._own_store = _open_store(store)
        self._placed: dict[str, str] = {}  # without a store
        self._pending: dict[str, str] = {}  # conversation -> why its next turn re-prefills
        # conversation -> the move (backend, placed_at) whose reason was looked up already
        self._seen_moves: dict[str, tuple[str, datetime | None]] = {}
        self._sides: dict[int, BackendState] = {}  # id(cancel event) -> where it runs
        self._lock = threading.RLock()
        self._load_factor = load_factor
        self._closed = False
        self._stop = threading.Event()
        self._health: threading.Thread | None = None
        if health_interval is not None and health_interval > 0:
            self._health = threading.Thread(
                target=self._watch, args=(health_interval,), name="chatctx-router", daemon=True
            )
            self._health.start()

    # the backends ---------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [state.name for state in self._states]

    def backend(self, name: str) -> Backend:
        return self._state(name).backend

    def _state(self, name: str) -> BackendState:
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(f"no backend named {name!r}: {', '.join(self.names)}") from None

    def _live(self) -> list[BackendState]:
        return [state for state in self._states if state.live]

    def check(self) -> None:
        """Ask every backend whether it is up (what the health thread does each interval)."""
        for state in self._states:
            if self._closed:
                return
            try:
                _probe(state.backend)
            except ChatctxError as exc:  # one backend's answer never stops the round
                self.mark_down(state.name, _why(exc))
            else:
                if state.down is not None:
                    logger.info("backend %s is back: it takes new conversations", state.name)
                    state.down = None

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with contextlib.suppress(Exception):  # a failed check must not stop the watch
                self.check()

    def mark_down(self, name: str, reason: str) -> None:
        """Take ``name`` out of routing and place its conversations elsewhere."""
        state = self._state(name)
        with self._lock:
            was_down = state.down is not None
            state.down = reason
        if not was_down:
            logger.warning("backend %s is down (%s): its conversations move", name, reason)
            self._move_all(state, f"failover: moved from {name}, down ({reason})", failover=True)

    def failed(self, name: str, exc: BackendUnavailable | ClosedError) -> ChatctxError:
        """What a request's failure on ``name`` means, as the error to raise for it.

        A server that let one request time out but answers its health check is busy, not
        down (a long prefill behind others): that request fails (``DeadlineExceeded``, not
        tried again elsewhere) and the backend keeps its conversations and their caches.
        Anything else takes the backend out of routing (``mark_down``).
        """
        if isinstance(exc, BackendUnavailable) and exc.reason == "timeout":
            try:
                _probe(self._state(name).backend)
            except ChatctxError:
                pass
            else:
                logger.warning("backend %s is slow, not down: %s", name, exc)
                return DeadlineExceeded(
                    f"backend {name} did not answer in time: {exc}", what="reply"
                )
        self.mark_down(name, _why(exc))
        return _unavailable(name, exc)

    def drain(self, name: str) -> dict[str, int]:
        """Move every conversation off ``name`` (it takes no new ones until ``undrain``).

        A conversation's KV state goes with it where the source can ``export_state`` and the
        destination ``import_state`` it (engines of one model; llama-servers sharing a
        ``--slot-save-path``); else its next turn prefills again, and says so. Returns
        ``{"moved": n, "with_state": k}``.
        """
        state = self._state(name)
        with self._lock:
            state.draining = True
        if not self._live():
            state.draining = False
            raise ConfigError(f"no other backend is up to drain {name} to")
        return self._move_all(state, f"drained: moved from {name}", failover=False)

    def undrain(self, name: str) -> None:
        self._state(name).draining = False

    def _move_all(self, state: BackendState, reason: str, *, failover: bool) -> dict[str, int]:
        moved = with_state = 0
        for conversation in self._conversations_on(state.name):
            target = self._choose(conversation)
            if target is None:
                break  # nothing is up: they move when a backend comes back
            kept = False if failover else self._move_state(conversation, state, target)
            why = f"{reason}, {WITH_STATE}" if kept else reason
            if self._record_move(conversation, state.name, target.name, why, kept):
                moved += 1
                with_state += kept
                if failover:
                    state.failovers += 1
        return {"moved": moved, "with_state": with_state}

    def _move_state(self, conversation: str, source: BackendState, target: BackendState) -> bool:
        export = getattr(source.backend, "export_state", None)
        load = getattr(target.backend, "import_state", None)
        if export is None or load is None:
            return False
        try:
            saved = export(conversation)
            return saved is not None and bool(load(conversation, saved))
        except Exception as exc:  # the move still happens, with a re-prefill
            logger.warning("state of %s not moved to %s: %s", conversation, target.name, exc)
            return False

    # placement ------------------------------------------------------------------------------

    def placement(self, conversation: str) -> str | None:
        """The backend holding ``conversation``, None when it is not placed yet."""
        if self._store is None:
            return self._placed.get(conversation)
        found = self._store.get_placement(conversation)
        return None if found is None else found.backend

    def _conversations_on(self, name: str) -> list[str]:
        if self._store is None:
            with self._lock:
                return [c for c, b in self._placed.items() if b == name]
        return [p.conversation_id for p in self._store.placements(name)]

    def _counts(self) -> Counter[str]:
        if self._store is None:
            with self._lock:
                return Counter(self._placed.values())
        return Counter(self._store.placement_counts())

    def _choose(self, conversation: str) -> BackendState | None:
        """Rendezvous order over the live backends, skipping those above the load bound."""
        live = self._live()
        if not live:
            return None
        counts = self._counts()
        total = sum(counts[state.name] for state in live)
        bound = math.ceil(self._load_factor * (total + 1) / len(live))
        ranked = sorted(live, key=lambda s: _score(conversation, s.name), reverse=True)
        return next((s for s in ranked if counts[s.name] < bound), ranked[0])

    def _record_move(
        self, conversation: str, source: str, target: str, reason: str, kept: bool
    ) -> bool:
        with self._lock:
            if self._store is None:
                if self._placed.get(conversation) != source:
                    return False
                self._placed[conversation] = target
            else:
                moved = self._store.move_placement(
                    conversation, from_backend=source, to_backend=target, reason=reason
                )
                if moved is None or moved.backend != target or moved.moved_from != source:
                    return False  # another process moved it first
            if kept:
                self._pending.pop(conversation, None)
            else:
                self._pending[conversation] = reason
        logger.info("conversation %s: %s to %s", conversation, reason, target)
        return True

    def _place(self, conversation: str) -> tuple[BackendState, str | None]:
        """Where ``conversation``'s turn goes, and why it re-prefills if it moved."""
        with self._lock:
            current = self._current(conversation)
            if current is None:
                target = self._choose(conversation)
                if target is None:
                    raise self._nothing_up()
                current = self._claim(conversation, target.name)
            name = current.backend
            state = self._by_name.get(name)
            if state is None or not state.live:
                # Down, draining or unknown here (a backend another process has): move it.
                target = self._choose(conversation)
                if target is None:
                    raise self._nothing_up()
                why = (
                    f"failover: moved from {name}, down ({state.down})"
                    if state is not None and state.down is not None
                    else f"drained: moved from {name}"
                    if state is not None
                    else f"moved from {name}, not a backend of this router"
                )
                if not self._record_move(conversation, name, target.name, why, False):
                    return self._place(conversation)  # moved meanwhile: read it again
                if state is not None and state.down is not None:
                    state.failovers += 1
                state = target
            reason = self._pending.pop(conversation, None)
            if reason is None and current is not None and current.moves:
                reason = self._told_elsewhere(conversation, current)
            return state, reason

    def _current(self, conversation: str) -> Placement | None:
        if self._store is None:
            name = self._placed.get(conversation)
            return None if name is None else _placement(conversation, name)
        return self._store.get_placement(conversation)

    def _claim(self, conversation: str, name: str) -> Placement:
        if self._store is None:
            return _placement(conversation, self._placed.setdefault(conversation, name))
        return self._store.claim_placement(conversation, name)

    def _told_elsewhere(self, conversation: str, placement: Placement) -> str | None:
        """A move another process made: its reason, on the first turn after it."""
        if self._store is None or placement.move_reason is None:
            return None
        if placement.move_reason.endswith(WITH_STATE):
            return None  # nothing to prefill again
        move = (placement.backend, placement.placed_at)
        if self._seen_moves.get(conversation) == move:
            return None  # this process has looked at this move already: not every turn
        self._seen_moves[conversation] = move
        turns = self._store.turns(conversation)
        if turns and turns[-1].backend == placement.backend:
            return None
        return placement.move_reason

    def _nothing_up(self) -> BackendUnavailable:
        why = "; ".join(f"{s.name}: {s.down or 'draining'}" for s in self._states)
        return BackendUnavailable(f"no backend is up ({why})", backend="router", reason="down")

    # Backend: facts -------------------------------------------------------------------------

    @property
    def _first(self) -> Backend:
        return self._states[0].backend

    @property
    def n_ctx(self) -> int:
        return self._first.n_ctx

    @property
    def side_room(self) -> int:
        return min(state.backend.side_room for state in self._states)

    @property
    def cache_edits(self) -> str:
        """The weakest of the backends': a conversation may move to any of them."""
        return max((state.backend.cache_edits for state in self._states), key=CACHE_EDITS.index)

    @property
    def model_name(self) -> str:
        return self._first.model_name

    @property
    def closed(self) -> bool:
        return self._closed

    def info(self) -> ModelInfo:
        info = self._first.info()
        return replace(
            info,
            slots=sum(state.backend.info().slots for state in self._states),
            extra={**info.extra, "backends": self.names},
        )

    def codec(self) -> Codec:
        return self._first.codec()

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self._first.prompt_tokens(messages)

    def embedder(self) -> TextEmbedder | None:
        for state in self._states:
            found = state.backend.embedder()
            if found is not None:
                return found
        return None

    def memory(self) -> MemorySnapshot | None:
        return None  # several processes or machines: each backend reports its own

    # Backend: slots and generation ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("router")

    def _split(self, seq_id: int) -> tuple[BackendState, int]:
        index, local = divmod(seq_id, SEQ_STRIDE)
        if not 0 <= index < len(self._states):
            raise ConfigError(f"sequence {seq_id} names no backend of this router")
        return self._states[index], local

    def lease(self, conversation: str, *, timeout: float | None = None) -> Lease:
        """A slot on the backend holding ``conversation`` (placing it on first use)."""
        for _ in range(len(self._states) + 1):
            self._check_open()
            state, reason = self._place(conversation)
            try:
                lease = state.backend.lease(conversation, timeout=timeout)
            except (BackendUnavailable, ClosedError) as exc:
                self.mark_down(state.name, _why(exc))
                self._keep_reason(conversation, reason)
                continue
            except BaseException:  # no slot in time: the turn that gets one says why
                self._keep_reason(conversation, reason)
                raise
            with self._lock:
                state.leased += 1
            index = self._states.index(state)
            return replace(
                lease,
                seq_id=index * SEQ_STRIDE + lease.seq_id,
                backend=state.name,
                # A state restored from a swap means nothing was prefilled again.
                reprefill_reason=lease.reprefill_reason or (None if lease.swap_in else reason),
            )
        raise self._nothing_up()

    def _keep_reason(self, conversation: str, reason: str | None) -> None:
        """Put back the move reason ``_place`` took for a lease that was not given."""
        if reason is not None:
            with self._lock:
                self._pending.setdefault(conversation, reason)

    def release(self, lease: Lease) -> None:
        state, local = self._split(lease.seq_id)
        with self._lock:
            state.leased = max(0, state.leased - 1)
        if not state.backend.closed:  # a down backend too: its slot is let go if it can be
            with contextlib.suppress(ChatctxError):
                state.backend.release(replace(lease, seq_id=local))

    def pin(self, conversation: str, seq_id: int) -> None:
        raise ConfigError("a router leases slots per turn: pinning a slot is not supported")

    def unpin(self, conversation: str) -> None:
        return None

    def generate(
        self,
        prompt: Sequence[int],
        *,
        seq_id: int = 0,
        settings: GenerationSettings | None = None,
        eviction: str = "shift",
        history_start: int | None = None,
        grammar: CallGrammar | None = None,
    ) -> Stream:
        self._check_open()
        state, local = self._split(seq_id)
        try:
            stream = state.backend.generate(
                prompt,
                seq_id=local,
                settings=settings,
                eviction=eviction,
                history_start=history_start,
                grammar=grammar,
            )
        except (BackendUnavailable, ClosedError) as exc:
            raise self.failed(state.name, exc) from exc
        return _RoutedStream(stream, self, state, local)

    def side_generate(
        self,
        prompt: Sequence[int],
        *,
        settings: GenerationSettings,
        background: bool = False,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> str:
        """A summary on the least busy backend that is up (it needs no conversation's cache)."""
        last: BaseException | None = None
        for _ in range(len(self._states)):
            live = [s for s in self._live() if s.backend.side_room > 0] or self._live()
            if not live:
                break
            state = min(live, key=lambda s: s.leased)
            if cancel is not None:
                with self._lock:
                    self._sides[id(cancel)] = state
            try:
                return state.backend.side_generate(
                    prompt, settings=settings, background=background, deadline=deadline,
                    cancel=cancel,
                )  # fmt: skip
            except (BackendUnavailable, ClosedError) as exc:
                error = self.failed(state.name, exc)
                if not isinstance(error, BackendUnavailable):
                    raise error from exc
                last = exc
            finally:
                if cancel is not None:
                    with self._lock:
                        self._sides.pop(id(cancel), None)
        if last is not None:
            raise _unavailable("router", last) from last
        raise self._nothing_up()

    def cancel_side(self, cancel: threading.Event) -> None:
        with self._lock:
            state = self._sides.get(id(cancel))
        if state is not None:
            state.backend.cancel_side(cancel)
        else:
            cancel.set()

    def kv_usage(self, *, known: bool = False) -> dict[int, int]:
        usage: dict[int, int] = {}
        for index, state in enumerate(self._states):
            if state.down is not None or state.backend.closed:
                continue
            with contextlib.suppress(BackendUnavailable):
                for seq, cells in state.backend.kv_usage(known=known).items():
                    usage[index * SEQ_STRIDE + seq] = cells
        return usage

    def clear(self, seq_id: int | None = None) -> None:
        if seq_id is None:
            for state in self._states:
                if state.down is None:
                    state.backend.clear()
            return
        state, local = self._split(seq_id)
        state.backend.clear(local)

    # figures ----------------------------------------------------------------------------------

    def stats(self) -> list[dict[str, Any]]:
        """Per backend now: up/down/draining, conversations placed, slots this router holds."""
        counts = self._counts()
        return [
            {
                "backend": state.name,
                "state": "down" if state.down else "draining" if state.draining else "up",
                "down_reason": state.down,
                "conversations": counts.get(state.name, 0),
                "slots_busy": state.leased,
                "slots": _slots(state.backend),
                "failovers": state.failovers,
            }
            for state in self._states
        ]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._health is not None and self._health is not threading.current_thread():
            self._health.join(timeout=5)
        if self._own:
            for state in self._states:
                with contextlib.suppress(Exception):
                    state.backend.close()
        if self._own_store and self._store is not None:
            self._store.close()


def _placement(conversation: str, backend: str) -> Placement:
    """A placement held in memory (a router without a store)."""
    from chatctx.store import Placement

    return Placement(conversation, backend, None)


class _RoutedStream:
    """A backend's stream; when the backend fails under it, the router hears of it."""

    def __init__(self, inner: Stream, router: Router, state: BackendState, slot: int) -> None:
        self._inner = inner
        self._router = router
        self._state = state
        self._slot = slot

    @property
    def result(self) -> GenerationResult | None:
        result = self._inner.result
        if result is None or result.slot is not None:
            return result
        return replace(result, slot=self._slot)

    @result.setter
    def result(self, value: GenerationResult | None) -> None:
        self._inner.result = value

    @property
    def text(self) -> str:
        return self._inner.text

    @text.setter
    def text(self, value: str) -> None:
        self._inner.text = value

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            return next(self._inner)
        except (BackendUnavailable, ClosedError) as exc:
            error = self._router.failed(self._state.name, exc)
            if error is exc:
                raise
            raise error from exc

    def close(self) -> None:
        self._inner.close()

    def wait(self, *, first_token_only: bool = False) -> GenerationResult:
        try:
            self._inner.wait(first_token_only=first_token_only)
        except (BackendUnavailable, ClosedError) as exc:
            error = self._router.failed(self._state.name, exc)
            if error is exc:
                raise
            raise error from exc
        result = self.result
        assert result is not None
        return result


def _probe(backend: Backend) -> None:
    """Raise ``BackendUnavailable`` when ``backend`` cannot serve now."""
    if backend.closed:
        raise BackendUnavailable("closed", backend=str(backend), reason="down")
    health = getattr(backend, "health", None)
    if health is not None:
        health()


def _why(exc: BaseException) -> str:
    if isinstance(exc, BackendUnavailable):
        return f"{exc.reason}: {exc}"
    return f"down: {exc}"


def _unavailable(name: str, exc: BaseException) -> BackendUnavailable:
    if isinstance(exc, BackendUnavailable):
        return exc
    return BackendUnavailable(f"backend {name}: {exc}", backend=name, reason="down")


def _slots(backend: Backend) -> int | None:
    with contextlib.suppress(Exception):
        return backend.info().slots
    return None


def _open_store(store: Store | str | None) -> tuple[Store | None, bool]:
    if store is None or not isinstance(store, str):
        return store, False
    from chatctx.store import Store

    return Store(store), True
