"""What one ``chatctx serve`` process owns: the store, the backend, open sessions, limits.

The model is loaded in a worker thread after the server starts listening, so ``/health``
answers at once and ``/ready`` says when turns can be served. ``drain()`` is SIGTERM: new
requests are refused, in-flight replies go on until a deadline and are then cut (stored
as partial).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from chatctx.backends.base import (
    Backend,
    Codec,
    Lease,
    MemorySnapshot,
    ModelInfo,
    Stream,
    TextEmbedder,
)
from chatctx.errors import ChatctxError, ConfigError, DeadlineExceeded
from chatctx.model.tools import CallGrammar
from chatctx.serve._errors import APIError
from chatctx.serve._metrics import ServeMetrics
from chatctx.serve._tenants import ConversationLocks, Tenancy, TurnLimiter
from chatctx.serve._turn import Cut
from chatctx.session import ChatSession
from chatctx.settings import (
    SWAP_DISK_MB,
    ContextSettings,
    GenerationSettings,
    ServeConfig,
    Settings,
)
from chatctx.store import CLAIM_TTL_S, Store, new_owner, try_claim

logger = logging.getLogger("chatctx.serve")

# Stateless requests: no memory beyond the request, so nothing to summarize or recall.
STATELESS_CONTEXT = ContextSettings(summarizer="none", recall=False)


def server_backend_class() -> Any:
    """``chatctx.LlamaServerBackend``, or a ``ConfigError`` saying it is not there yet."""
    import chatctx

    found = getattr(chatctx, "LlamaServerBackend", None)
    if found is None:
        raise ConfigError(
            "--backend is not available yet: this chatctx has no LlamaServerBackend; "
            "use --model GGUF"
        )
    return found


def make_backend(
    model: str | None,
    backend_urls: Sequence[str],
    engine_options: Mapping[str, Any],
    store: Store | None = None,
    slot_save_path: str | None = None,
    swap_disk_mb: float = SWAP_DISK_MB,
    summary_slot: bool = False,
) -> Backend:
    """The backend ``serve`` runs: the llama-server at ``backend_urls`` (several: a router
    over them, placements kept in ``store``; none given: ``CHATCTX_BACKENDS``), else a
    local engine. With servers, ``model`` is the GGUF the local tokenizer reads, and
    ``slot_save_path`` their ``--slot-save-path``: slots given away are swapped there (at
    most ``swap_disk_mb``); ``summary_slot`` keeps each server's last slot for LLM
    summaries, else every slot serves customers."""
    from chatctx.backends.router import backends_from_env

    urls = list(backend_urls) or backends_from_env()
    if urls:
        server = server_backend_class()
        swap: dict[str, Any] = (
            {"slot_save_path": slot_save_path, "swap": True, "swap_disk_mb": swap_disk_mb}
            if slot_save_path
            else {}
        )
        backends = [server(url, model=model, summary_slot=summary_slot, **swap) for url in urls]
        if len(backends) == 1:
            backend: Backend = backends[0]
            return backend
        from chatctx.backends.router import Router

        return Router(backends, store=store, own=True)
    from chatctx.backends.engine import Engine

    return Engine.load(model, **engine_options)


ALIKE = 3  # stateless requests of one opening that may run beside its first, each slot apart


class OwnedAs:
    """A backend whose slots are leased under another name than the conversation's.

    Stateless requests are stored under a fresh id each, but lease the slot of the chat they
    continue (named after its opening), so its cached prefix can be reused.
    """

    def __init__(self, inner: Backend, owner: str) -> None:
        self.inner = inner
        self.owner = owner

    @property
    def n_ctx(self) -> int:
        return self.inner.n_ctx

    @property
    def side_room(self) -> int:
        return self.inner.side_room

    @property
    def cache_edits(self) -> str:
        return self.inner.cache_edits

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def info(self) -> ModelInfo:
        return self.inner.info()

    def codec(self) -> Codec:
        return self.inner.codec()

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.inner.prompt_tokens(messages)

    def lease(self, conversation: str, *, timeout: float | None = None) -> Lease:
        """The chat's slot when it is free now, else one of its ``ALIKE`` side names' (the
        same opening cached there too), else wait for the chat's own: requests that open
        alike (a fixed system prompt and greeting) run side by side instead of one after
        another on one slot, under a bounded set of names (a router stores each one's
        placement)."""
        for name in (self.owner, *(f"{self.owner}#{n}" for n in range(2, ALIKE + 2))):
            with contextlib.suppress(DeadlineExceeded):
                return self.inner.lease(name, timeout=0)
        return self.inner.lease(self.owner, timeout=timeout)

    def release(self, lease: Lease) -> None:
        self.inner.release(lease)

    def pin(self, conversation: str, seq_id: int) -> None:
        self.inner.pin(self.owner, seq_id)

    def unpin(self, conversation: str) -> None:
        self.inner.unpin(self.owner)

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
        return self.inner.generate(
            prompt,
            seq_id=seq_id,
            settings=settings,
            eviction=eviction,
            history_start=history_start,
            grammar=grammar,
        )

    def side_generate(
        self,
        prompt: Sequence[int],
        *,
        settings: GenerationSettings,
        background: bool = False,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> str:
        return self.inner.side_generate(
            prompt, settings=settings, background=background, deadline=deadline, cancel=cancel
        )

    def cancel_side(self, cancel: threading.Event) -> None:
        self.inner.cancel_side(cancel)

    def kv_usage(self, *, known: bool = False) -> dict[int, int]:
        return self.inner.kv_usage(known=known)

    def clear(self, seq_id: int | None = None) -> None:
        self.inner.clear(seq_id)

    def memory(self) -> MemorySnapshot | None:
        return self.inner.memory()

    def embedder(self) -> TextEmbedder | None:
        return None  # nothing is recalled in a stateless request

    def close(self) -> None:
        """The shared backend stays open."""


def stateless_owner(tenant: str | None, opening: Sequence[tuple[str, str]]) -> str:
    """The slot name of a stateless chat: its tenant and first messages, hashed."""
    digest = hashlib.sha256(repr((tenant, list(opening))).encode("utf-8")).hexdigest()[:16]
    return f"stateless:{digest}"


def warm_up(backend: Backend) -> None:
    """Build what the first turn would otherwise build while a customer waits: the codec
    (tiktoken's tables) and, when conversations recall by meaning by default, the sentence
    embedder (converted to GGUF on first use, then loaded): seconds each on a small CPU."""
    defaults = ContextSettings()
    steps: list[tuple[str, Callable[[], object]]] = [("codec", backend.codec)]
    if defaults.recall and defaults.recall_search != "words":
        steps.append(("sentence embedder", backend.embedder))
    for name, step in steps:
        try:
            step()
        except ChatctxError as exc:  # the turns that need it get this error themselves
            logger.warning("%s not ready ahead of the first turn: %s", name, exc)


class Service:
    """The store, the backend, the sessions kept open, the limits and the drain state."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        backend: Backend | None = None,
        store: Store | None = None,
    ) -> None:
        self.config = config
        limits = config.limits
        self.tenancy = Tenancy(config.api_keys)
        self.limiter = TurnLimiter(limits.max_concurrent_turns, retry_after=limits.retry_after_s)
        self.locks = ConversationLocks(limits.conversation_wait_s)
        # This process, in the store's turn claims (several serve processes, one database).
        self.owner = new_owner()
        self.metrics = ServeMetrics()
        self.backend = backend
        self.store = store
        self._owns_backend = backend is None
        self._owns_store = store is None
        self.ephemeral: Store | None = None  # stateless requests' conversations (in memory)
        self.load_error: str | None = None
        self.loaded = False
        self.draining = False
        self.started_at = time.time()
        self.sessions: OrderedDict[str, ChatSession] = OrderedDict()
        # Conversations of ``sessions`` that their first turn got or created (set from the
        # turns' worker threads): later turns only read them.
        self.opened: set[str] = set()
        self.cancels: set[Cut] = set()  # one per turn in flight: set to cut it
        self._idle = asyncio.Event()
        self._idle.set()
        # The last turns served, newest last: what the cache page charts.
        self.recent: deque[dict[str, Any]] = deque(maxlen=200)

    # lifecycle ----------------------------------------------------------------------------

    def load(self) -> None:
        """Open the store and load the model (blocking: run it in a thread)."""
        try:
            if self.store is None:
                self.store = Store(self.config.db or Settings.from_env().db)
            self.ephemeral = Store("sqlite://")
            if self.backend is None:
                self.backend = make_backend(
                    self.config.model,
                    self.config.backend_urls,
                    {"slots": self.config.slots, **self.config.engine_options},
                    store=self.store,
                    slot_save_path=self.config.slot_save_path,
                    swap_disk_mb=self.config.swap_disk_mb,
                    summary_slot=self.config.summary_slot,
                )
            warm_up(self.backend)
            self.loaded = True
            logger.info("serving %s", self.model_id)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            logger.error("could not start serving: %s", self.load_error)

    def close(self) -> None:
        """Close the sessions, then what this service opened (blocking)."""
        while self.sessions:
            _, session = self.sessions.popitem()
            with contextlib.suppress(Exception):
                session.close()
        if self._owns_backend and self.backend is not None:
            self.backend.close()
        if self.ephemeral is not None:
            self.ephemeral.close()
        if self._owns_store and self.store is not None:
            self.store.close()

    @property
    def model_id(self) -> str:
        if self.config.model_id:
            return self.config.model_id
        return self.backend.model_name if self.backend is not None else "chatctx"

    async def claim_turn(self, store: Store, stored_id: str) -> Callable[[], Awaitable[None]]:
        """Claim the conversation's turn in the store, against other serve processes on the
        database (this process's own turns take ``locks`` first); the claim is renewed while
        the turn runs. 409 ``conversation_busy`` after ``conversation_wait_s``. Returns the
        coroutine function that lets the claim go."""
        wait_s = self.config.limits.conversation_wait_s
        deadline = time.monotonic() + wait_s
        pause = 0.02
        while not await asyncio.to_thread(try_claim, store, stored_id, self.owner, CLAIM_TTL_S):
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(
                    409,
                    f"another process is taking a turn of this conversation after {wait_s:g} s; "
                    "retry when it has finished",
                    code="conversation_busy",
                )
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

        async def renew() -> None:
            while True:
                await asyncio.sleep(CLAIM_TTL_S / 3)
                try:
                    await asyncio.to_thread(store.renew_turn, stored_id, self.owner, CLAIM_TTL_S)
                except ChatctxError as exc:  # the next try may get through; the turn goes on
                    logger.warning("renewing the turn claim of %s failed: %s", stored_id, exc)

        renewal = asyncio.get_running_loop().create_task(renew())

        async def release() -> None:
            renewal.cancel()
            await asyncio.to_thread(store.release_turn, stored_id, self.owner)

        return release

    def require_ready(self) -> tuple[Store, Backend]:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down",
                code="draining",
                headers={"Retry-After": str(self.config.limits.retry_after_s)},
            )
        if not self.loaded or self.store is None or self.backend is None:
            message = (
                f"the model could not be loaded ({self.load_error})"
                if self.load_error
                else "the model is still loading"
            )
            raise APIError(
                503,
                message,
                code="not_ready",
                headers={"Retry-After": str(self.config.limits.retry_after_s)},
            )
        return self.store, self.backend

    # turns in flight ----------------------------------------------------------------------

    def turn_started(self) -> Cut:
        cancel = Cut()
        self.cancels.add(cancel)
        self._idle.clear()
        return cancel

    def turn_ended(self, cancel: Cut) -> None:
        self.cancels.discard(cancel)
        if not self.cancels:
            self._idle.set()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; let replies finish for ``timeout_s``, then cut the rest."""
        self.draining = True
        logger.info("draining: %d turns in flight", len(self.cancels))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        if self.cancels:
            logger.info("drain deadline: cutting %d replies (stored as partial)", len(self.cancels))
            for cancel in list(self.cancels):
                cancel.set()
            with contextlib.suppress(TimeoutError):
                # A cut reply ends after its next token; one still in prefill takes longer.
                await asyncio.wait_for(self._idle.wait(), timeout=60.0)

    # sessions -----------------------------------------------------------------------------

    async def session(self, stored_id: str) -> tuple[ChatSession, bool]:
        """The open session of a conversation (the caller holds its lock), and whether its
        conversation is still to be got or created: a new session is made here without the
        database, and its first turn does that in its own worker thread (then adds the id to
        ``opened``)."""
        session = self.sessions.get(stored_id)
        if session is not None and not session.closed:
            self.sessions.move_to_end(stored_id)
            return session, stored_id not in self.opened
        store, backend = self.require_ready()
        self.opened.discard(stored_id)
        # The request claims the conversation's turn itself (``claim_turn``), before it
        # stores the messages it adds, and answers 409 when it cannot.
        session = ChatSession(
            store=store, engine=backend, conversation_id=stored_id, claim_turns=False
        )
        self.sessions[stored_id] = session
        await self._trim()
        return session, True

    async def _trim(self) -> None:
        over = len(self.sessions) - self.config.max_open_sessions
        for stored_id in list(self.sessions):
            if over <= 0:
                break
            if self.locks.busy(stored_id):
                continue
            await self.forget(stored_id)
            over -= 1

    async def forget(self, stored_id: str) -> None:
        session = self.sessions.pop(stored_id, None)
        self.opened.discard(stored_id)
        if session is not None:
            await asyncio.to_thread(session.close)

    def record(self, entry: dict[str, Any]) -> None:
        self.recent.append(entry)
