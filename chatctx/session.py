"""ChatSession: one persisted conversation driven through the llama.cpp engine.

::

    with ChatSession.open("sqlite:///bot.db", conversation_id="cust-42") as chat:
        reply = chat.send("My order 1234 has not arrived")
        for chunk in chat.stream("Can you check again?"):
            print(chunk, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from chatctx._resource import Closeable
from chatctx._turn import TurnInFlight, turn_figures
from chatctx.backend import (
    Backend,
    GenerationResult,
    Lease,
    MemorySnapshot,
    Stream,
    TextEmbedder,
    Timings,
    Usage,
)
from chatctx.config import ContextSettings, ConversationSettings, GenerationSettings, Settings
from chatctx.context import (
    BackgroundSummarizer,
    BuildResult,
    ContextBuilder,
    ContextPlan,
    ContextState,
    LLMSummarizer,
    MeaningSearch,
    RecallSearch,
    Summarizer,
    summarizer_for,
    summary_limit,
)
from chatctx.errors import (
    BackendUnavailable,
    ChatctxError,
    ClosedError,
    ConfigError,
    ContextBudgetError,
    ContextStateConflict,
    DeadlineExceeded,
    StoreError,
)
from chatctx.store import Message, Store, Turn

__all__ = ["ChatSession", "Reply"]

logger = logging.getLogger("chatctx.session")

LEASE_POLL_S = 0.5  # a turn waiting for a slot looks this often whether its session closed
CLOSE_WAIT_S = 10.0  # close() waits this long for turns still being prepared
STATE_ATTEMPTS = 3  # builds of a turn's context when another writer saves its state meanwhile
MAX_FAILOVERS = 2  # a turn whose backend fails before its first token is retried this often


@dataclass(frozen=True, slots=True)
class _Built:
    """One build of a turn's context and what it was built from (per call: two threads
    building on one session never see each other's reads)."""

    result: BuildResult
    generation: GenerationSettings  # the turn's sampling
    context: ContextSettings
    stored_generation: GenerationSettings  # the conversation's, as read
    state_version: int  # of the context state read: the save compares and sets against it


@dataclass(frozen=True, slots=True)
class Reply:
    """The assistant's answer to one user message, with what it cost."""

    text: str
    user_message_id: int
    message_id: int | None  # None when an interrupted reply produced no text
    usage: Usage
    timings: Timings
    stop_reason: str
    turn: Turn | None
    plan: ContextPlan | None = None


class ChatSession(Closeable):
    """A conversation stored in a ``Store`` and answered by a backend (an ``Engine``).

    The user message is committed before generation starts; the assistant message when it
    ends, or marked ``partial`` if the reply is interrupted. Each turn leases one of the
    engine's slots: many sessions (threads, or ``asend``/``astream`` on asyncio) share one
    engine, their generations batched together. Close the session (or use ``with``) to
    release what it opened; a store or engine passed in stays open.
    """

    def __init__(
        self,
        *,
        store: Store,
        engine: Backend,
        conversation_id: str,
        seq_id: int | None = None,
        summarizer: Summarizer | None = None,
        on_turn: Callable[[Turn], None] | None = None,
        owns_store: bool = False,
        owns_engine: bool = False,
        embedder: TextEmbedder | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.conversation_id = conversation_id
        # Set: the expert option, this slot for good. None: a slot is leased per turn (the
        # slot of the last turn is kept here).
        self.seq_id = seq_id
        self._pinned = seq_id is not None
        self._lease: Lease | None = None
        self._custom_summarizer = summarizer
        # Recall by meaning: this embedder, else the backend's (None: recall by words).
        self._embedder = embedder
        self.on_turn = on_turn
        self._owns_store = owns_store
        self._owns_engine = owns_engine
        self._builder: ContextBuilder | None = None
        self._background: BackgroundSummarizer | None = None  # a summary written off-turn
        self._meaning: MeaningSearch | None = None  # recall by meaning, when it is used
        self._cancel_summary = threading.Event()  # set at close: stop writing it
        # Clear while a turn is prepared and until its first token: a background summary the
        # turn starts waits for it, so it never holds the model ahead of the customer.
        self._turn_under_way = threading.Event()
        self._turn_under_way.set()
        self._builder_settings: ContextSettings | None = None
        # Turns in flight (any thread): close() ends them before it closes anything.
        self._turns: set[TurnInFlight] = set()
        self._turns_changed = threading.Condition()
        self.last_reply: Reply | None = None
        self.last_user: Message | None = None  # the user message the last turn stored
        self.last_build: BuildResult | None = None  # the context sent on the last turn
        self._closed = False
        if seq_id is not None:
            engine.pin(conversation_id, seq_id)

    @classmethod
    def open(
        cls,
        db: str | Store | None = None,
        *,
        conversation_id: str | None = None,
        model: str | Path | Backend | None = None,
        system_prompt: str | None = None,
        settings: GenerationSettings | Mapping[str, Any] | None = None,
        context: ContextSettings | Mapping[str, Any] | None = None,
        summarizer: Summarizer | None = None,
        on_turn: Callable[[Turn], None] | None = None,
        engine_options: Mapping[str, Any] | None = None,
        seq_id: int | None = None,
        embedder: TextEmbedder | None = None,
        backend: Backend | None = None,
    ) -> ChatSession:
        """Open (or create) a conversation.

        ``db`` is a SQLAlchemy URL, an open ``Store``, or None for ``CHATCTX_DB`` (default
        ``$CHATCTX_HOME/chatctx.db``, the CLI's database). ``model`` is a GGUF path, a
        loaded ``Engine`` or other backend (shared, left open), or None for
        ``CHATCTX_MODEL`` / the embedded default. ``seq_id`` pins the conversation to one
        slot (expert option); by default each turn leases a slot from the engine's pool.
        ``system_prompt``, ``settings`` (generation) and ``context`` (budget, policy,
        summarizer), when given, are stored with the conversation. ``summarizer`` is a callable
        ``(previous_summary, evicted_messages) -> summary`` used instead of the configured one.
        ``on_turn`` is called with each stored turn record (tokens, KV events, timings).
        ``embedder`` ranks evicted messages for recall by meaning instead of the backend's
        (``Backend.embedder()``: the local all-MiniLM-L6-v2 when it is installed).
        ``backend`` is a running backend (an ``Engine``, a ``LlamaServerBackend``), shared and
        left open: the same as passing it as ``model``.
        """
        if backend is not None:
            if model is not None:
                raise ConfigError("pass model or backend, not both")
            if not isinstance(backend, Backend):
                raise ConfigError(f"backend must be a chatctx Backend, not {type(backend)!r}")
            model = backend
        generation = _settings(settings) if settings is not None else None
        context_settings = _context_settings(context) if context is not None else None
        owns_store = not isinstance(db, Store)
        if db is None:
            db = Settings.from_env().db
        store = Store(db) if isinstance(db, str) else db
        built: Backend | None = None  # an engine loaded here, closed again on failure
        try:
            changed = generation is not None or context_settings is not None
            initial = ConversationSettings(
                generation=generation or GenerationSettings(),
                context=context_settings or ContextSettings(),
            )
            if conversation_id is None:
                cid = store.create_conversation(
                    system_prompt=system_prompt, settings=initial.to_json()
                ).id
            else:
                # Get-or-create in one statement: two first messages of a new customer at
                # once open one conversation, never an "already exists" error.
                cid = conversation_id
                existing, created = store.get_or_create_conversation(
                    cid, system_prompt=system_prompt, settings=initial.to_json()
                )
                if not created and (system_prompt is not None or changed):
                    current = ConversationSettings.parse(existing.settings)
                    merged = ConversationSettings(
                        generation=generation or current.generation,
                        context=context_settings or current.context,
                    )
                    store.update_conversation(
                        cid,
                        system_prompt=system_prompt,
                        settings=merged.to_json() if changed else None,
                    )
            if isinstance(model, Backend):
                engine: Backend = model
            else:
                engine = built = _load_engine(model, engine_options or {})
            # __init__ can refuse (a pin to a taken slot): what was opened here is closed.
            return cls(
                store=store,
                engine=engine,
                conversation_id=cid,
                seq_id=seq_id,
                summarizer=summarizer,
                on_turn=on_turn,
                owns_store=owns_store,
                owns_engine=built is not None,
                embedder=embedder,
            )
        except BaseException:
            if built is not None:
                built.close()
            if owns_store:
                store.close()
            raise

    # lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """End the turns in flight, then release what the session opened.

        A reply still streaming (in any thread) is stopped and stored as ``partial`` with its
        turn record before this returns: the store holds every reply a client saw. Turns
        still being prepared are refused before they store anything.
        """
        with self._turns_changed:
            if self._closed:
                return
            self._closed = True
            turns = list(self._turns)
        for turn in turns:
            with turn.lock:  # a user message being written, a generation being started
                stream = turn.stream
            if stream is not None:
                stream.close()  # returns once the backend has let go of it
        for turn in turns:
            if turn.kind == "stream":
                try:
                    self._finish_turn(turn)
                except ChatctxError:
                    logger.exception("a reply of %s was not stored", self.conversation_id)
                self._end_turn(turn)
        deadline = time.monotonic() + CLOSE_WAIT_S
        with self._turns_changed:
            while self._turns and (left := deadline - time.monotonic()) > 0:
                self._turns_changed.wait(left)
            if self._turns:
                logger.warning(
                    "closing %s with %d turn(s) still being prepared",
                    self.conversation_id,
                    len(self._turns),
                )
        self._stop_summary()
        if self._pinned and not self.engine.closed:
            self.engine.unpin(self.conversation_id)
        if self._owns_engine:
            self.engine.close()
        if self._owns_store:
            self.store.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _stop_summary(self) -> None:
        """Stop a summary still being written in the background and wait until its side
        sequence is free again: once the session is gone nobody would take the result, and
        the engine could not clear or reuse that sequence meanwhile."""
        background, self._background = self._background, None
        if background is None or not background.running():
            return
        self.engine.cancel_side(self._cancel_summary)
        if not background.wait(timeout=background.timeout_s):
            logger.warning("the background summary did not stop")
        self._cancel_summary = threading.Event()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("chat session")

    # state --------------------------------------------------------------------------------

    @property
    def system_prompt(self) -> str | None:
        return self.store.get_conversation(self.conversation_id).system_prompt

    def conversation_settings(self) -> ConversationSettings:
        """The stored settings, parsed (once per call)."""
        stored = self.store.get_conversation(self.conversation_id).settings
        return ConversationSettings.parse(stored)

    @property
    def settings(self) -> GenerationSettings:
        return self.conversation_settings().generation

    @property
    def context_settings(self) -> ContextSettings:
        return self.conversation_settings().context

    def history(self) -> list[Message]:
        """Every stored message of this conversation, in order (never trimmed)."""
        return self.store.messages(self.conversation_id)

    def pin(self, message_id: int, pinned: bool = True) -> Message:
        """Always send this message, right after the system prompt."""
        return self.store.set_pinned(message_id, pinned)

    def builder(self) -> ContextBuilder:
        """The context builder for the conversation's current settings."""
        return self._builder_for(self.context_settings, self.budget()[0])

    def _builder_for(self, settings: ContextSettings, budget: int) -> ContextBuilder:
        if self._builder is None or self._builder_settings != settings:
            codec = self.engine.codec()
            summarizer: Summarizer | None = self._custom_summarizer
            if summarizer is None:
                background = settings.summarizer == "llm" and self._side_sequence()
                summarizer = summarizer_for(
                    settings.summarizer,
                    count=codec.count,
                    max_tokens=settings.summary_max_tokens,
                    budget=budget,
                    generate=functools.partial(self._summary_generate, background=background),
                    max_input_tokens=self._summary_input_tokens(),
                    timed=True,
                )
                if background and isinstance(summarizer, LLMSummarizer):
                    # Off the critical path: the evicting turn goes out with the previous
                    # summary (and recall); the new one takes effect once it is written.
                    summarizer = BackgroundSummarizer(
                        summarizer.fold,
                        timeout_s=settings.summary_timeout_s,
                        gate=self._turn_under_way.wait,
                    )
                    self._stop_summary()  # one written for the settings before, if any
                    self._background = summarizer
            store = self.store
            self._builder = ContextBuilder(
                codec,
                settings,
                summarizer=summarizer,
                cache=store,
                lookup=store.messages_by_ids,
                recall=self._recall_search(settings),
                layout=self._layout(settings),
            )
            self._builder_settings = settings
        return self._builder

    def _layout(self, settings: ContextSettings) -> str:
        """The prompt layout: as set, or for "auto" the one the backend's cache keeps best
        (summary-first where it edits in place, else append: see ``chatctx.context._layout``)."""
        if settings.layout != "auto":
            return settings.layout
        edits = getattr(self.engine, "cache_edits", "in-place")  # a backend from before it
        return "summary-first" if edits == "in-place" else "append"

    def _recall_search(self, settings: ContextSettings) -> RecallSearch:
        """Recall by meaning (sentence embeddings) or by words (the store's BM25 index)."""
        store, cid = self.store, self.conversation_id
        mode = settings.recall_search
        embedder = self._embedder
        if settings.recall and mode != "words" and embedder is None:
            embedder = self.engine.embedder()
        if settings.recall and mode == "auto":
            mode = "meaning" if embedder is not None else "words"
        self._meaning = None
        if settings.recall and mode == "meaning":
            if embedder is None:  # asked for by name: the local one, or its clear ModelError
                from chatctx.engine._embedder import shared_embedder

                embedder = shared_embedder()
            self._meaning = MeaningSearch(
                lambda: store.messages(cid),
                embedder.embed,
                min_similarity=settings.recall_min_similarity,
                prefetch=embedder.prefetch,
                vectors=store,
                fingerprint=embedder.fingerprint,
            )
            # A resumed conversation: what is not stored yet is embedded while the customer
            # types.
            self._meaning.warm_messages(store.messages(cid))
            return self._meaning
        return lambda query, before, limit: store.search_messages(
            cid, query, before_position=before, limit=limit, replies=True
        )

    def _side_sequence(self) -> bool:
        """Whether summaries can run on a sequence of their own (the engine's reserved one)."""
        return self.engine.side_room > 0

    def budget(self, settings: ConversationSettings | None = None) -> tuple[int, int]:
        """(prompt token budget, tokens reserved for the reply) under ``settings`` (default:
        the stored ones, read now).

        The budget is what one slot holds less the reply's reserve; summaries have cells of
        their own (the engine's summary room), so they never take from it.
        """
        stored = settings if settings is not None else self.conversation_settings()
        return self._budget(stored.context, stored.generation)

    def check_fits(
        self,
        message: str,
        settings: ConversationSettings | None = None,
        *,
        system_prompt: str | None = None,
    ) -> None:
        """Raise ``ContextBudgetError`` now when ``message`` can never be sent: the system
        prompt and it alone exceed the budget (and ``truncate_oversized`` is off).

        The turn would refuse it too, but only once it runs: a caller that writes other
        messages first (``chatctx serve`` storing a request's earlier messages) asks here.
        """
        stored = settings if settings is not None else self.conversation_settings()
        if stored.context.truncate_oversized:
            return
        budget, reserve = self._budget(stored.context, stored.generation)
        messages = [{"role": "user", "content": message}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        needed = self._builder_for(stored.context, budget).count_messages(messages)
        if needed > budget:
            raise ContextBudgetError(
                f"the newest message does not fit: with the system prompt it takes {needed} "
                f"tokens > budget {budget}",
                prompt_tokens=needed,
                budget=budget,
                n_ctx=budget + reserve,
            )

    def _budget(self, settings: ContextSettings, generation: GenerationSettings) -> tuple[int, int]:
        reserve = settings.reserve if settings.reserve is not None else generation.max_tokens
        limit = self.engine.n_ctx - reserve
        budget = min(settings.budget, limit) if settings.budget is not None else limit
        if budget < 16:
            raise ConfigError(f"no room for a prompt: n_ctx {self.engine.n_ctx}, reserve {reserve}")
        return budget, reserve

    def plan(self, new_message: str) -> BuildResult:
        """Build the context for ``new_message`` without sending or storing anything.

        A summary finished in the background shows in the plan and is still taken by the
        next turn; none is started. An inline summarizer (extractive, a callable) runs here
        too when the plan evicts turns, and its result is not kept.
        """
        self.builder()  # made now, so that a background summarizer is there to peek at
        background = self._background
        if background is None:
            return self._build(new_message).result
        with background.peeking():
            return self._build(new_message).result

    def _build(self, new_message: str, sampling: GenerationSettings | None = None) -> _Built:
        """The context for ``new_message``, with the settings it was built under (one read;
        ``sampling`` in place of the stored generation settings)."""
        conversation = self.store.get_conversation(self.conversation_id)
        parsed = ConversationSettings.parse(conversation.settings)
        generation, context = sampling or parsed.generation, parsed.context
        stored = self.store.context_state(self.conversation_id)
        state = ContextState(
            window_start=stored.window_start,
            summary=stored.summary.content if stored.summary else None,
            summary_tokens=stored.summary.token_count or 0 if stored.summary else 0,
            pending_ids=stored.pending_ids,
            summary_blocks=stored.summary.blocks if stored.summary else (),
        )
        history = self.store.messages(self.conversation_id, from_position=state.window_start)
        budget, reserve = self._budget(context, generation)
        built = self._builder_for(context, budget).build(
            system_prompt=conversation.system_prompt,
            history=history,
            new_message=new_message,
            budget=budget,
            reserve=reserve,
            state=state,
            pinned=self.store.pinned_messages(self.conversation_id),
        )
        return _Built(built, generation, context, parsed.generation, stored.version)

    def _summary_input_tokens(self) -> int:
        # Evicted turns are folded in chunks of this many tokens; with the summary's output
        # and instructions they fit the engine's summary room.
        chunk = max(128, min(1024, self.engine.n_ctx // 4))
        if self._side_sequence():
            settings = self.context_settings
            written = summary_limit(
                settings.summary_max_tokens, settings.budget or self.engine.n_ctx
            )
            chunk = min(chunk, self.engine.side_room - written - 160)
        return max(32, chunk)

    def _summary_generate(
        self,
        messages: list[dict[str, Any]],
        timeout_s: float | None = None,
        *,
        background: bool = False,
    ) -> str:
        """Run the summary prompt on the engine's spare sequence when it has one.

        ``timeout_s`` is what is left of the summary's one overall deadline. In the
        background the prefill is chunked and steps aside for customers' turns. With a single
        sequence it runs on the chat's own, which evicts the chat's cached prefix: the next
        turn re-evaluates its whole prompt.
        """
        settings = self.context_settings
        limit = settings.summary_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        sampling = GenerationSettings(
            max_tokens=settings.summary_max_tokens, temperature=0.0, repeat_penalty=1.1
        )
        prompt = self.engine.prompt_tokens(messages)
        if self._side_sequence():
            return self.engine.side_generate(
                prompt,
                settings=sampling,
                background=background,
                deadline=deadline,
                cancel=self._cancel_summary if background else None,
            )
        assert self._lease is not None, "summaries run while the turn holds its slot"
        generation = self.engine.generate(prompt, seq_id=self._lease.seq_id, settings=sampling)
        try:
            for _ in generation:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"summary not done after {limit:.1f} s", what="summary", seconds=limit
                    )
        finally:
            generation.close()
        return generation.text

    # chatting -----------------------------------------------------------------------------

    def send(self, text: str, *, settings: Sampling = None) -> Reply:
        """Send a user message and wait for the whole reply.

        ``settings`` (``GenerationSettings`` or a mapping of its fields) sample this turn and
        become the conversation's, stored with the user message in one transaction.
        """
        replies: list[Reply] = []
        for _ in self._open_stream(text, replies, _settings_or_none(settings)):
            pass
        return _stored(replies)

    def stream(self, text: str, *, settings: Sampling = None) -> Generator[str, None, None]:
        """Send a user message and yield the reply as it is generated.

        Raises ``ContextBudgetError`` before storing anything when the prompt cannot fit.
        Time to first token is counted from this call, which waits while every slot of the
        engine is leased. ``settings``: as for ``send``.
        """
        return self._open_stream(text, None, _settings_or_none(settings))

    async def asend(self, text: str, *, settings: Sampling = None) -> Reply:
        """``send`` for asyncio: the turn runs in a worker thread, batched with the others."""
        replies: list[Reply] = []
        async for _ in self._astream(text, replies, settings=_settings_or_none(settings)):
            pass
        return _stored(replies)

    def astream(
        self,
        text: str,
        *,
        before: Callable[[], None] | None = None,
        settings: Sampling = None,
    ) -> AsyncIterator[str]:
        """``stream`` for asyncio: ``async for chunk in chat.astream(text)``.

        Leaving the loop early ends the reply (stored as ``partial``), as with ``stream``,
        even in its prefill or while it waits for a slot (then nothing is stored, if its user
        message was not yet); the leaving waits until that is done, even when cancelled.
        ``before`` runs first in the turn's worker thread, before the turn begins (a server
        stores there what its request adds: no thread hop of its own); what it raises is
        raised here, and the turn is then not started. ``settings``: as for ``send``.
        """
        return self._astream(text, None, before, _settings_or_none(settings))

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

    def _open_stream(
        self,
        text: str,
        replies: list[Reply] | None,
        sampling: GenerationSettings | None = None,
        *,
        cut: threading.Event | None = None,
    ) -> Generator[str, None, None]:
        requested = time.perf_counter()
        turn = self._begin_turn("stream")
        turn.cut = cut
        try:
            self._lease_slot(turn)
            clock = (requested, time.perf_counter())
            self._turn_under_way.clear()
            prepared = self._prepare(text, sampling)
            context = prepared.context
            # Sampling given with the turn is stored with its user message (one transaction).
            turn.settings = (
                None
                if sampling is None or sampling == prepared.stored_generation
                else ConversationSettings(generation=sampling, context=context).to_json()
            )
            stream = self._stream(
                turn, text, prepared.result, prepared.generation, context.eviction, clock, replies
            )
        except BaseException:
            self._turn_under_way.set()
            self._end_turn(turn)
            raise
        # A stream dropped before its first chunk never runs its cleanup: give the slot back
        # and let a background summary waiting for this turn go on.
        weakref.finalize(stream, self._abandon, turn)
        return stream

    def _begin_turn(self, kind: str) -> TurnInFlight:
        turn = TurnInFlight(kind)
        with self._turns_changed:
            self._check_open()
            self._turns.add(turn)
        return turn

    def _lease_slot(self, turn: TurnInFlight) -> Lease:
        # In steps, so that a session closed (or a turn cut) meanwhile stops waiting.
        while True:
            self._check_open()
            _check_cut(turn)
            try:
                lease = self.engine.lease(self.conversation_id, timeout=LEASE_POLL_S)
            except DeadlineExceeded:
                continue
            break
        with self._turns_changed:  # against close() ending this turn meanwhile
            handed = not (self._closed or turn.released)
            if handed:
                turn.lease = lease
                self._lease = lease
                self.seq_id = lease.seq_id
        if not handed:  # the turn was ended while the lease was on its way: give it back
            if not self.engine.closed:
                with contextlib.suppress(ChatctxError):
                    self.engine.release(lease)
            raise ClosedError("chat session")
        return lease

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

    def _abandon(self, turn: TurnInFlight) -> None:
        self._turn_under_way.set()
        self._end_turn(turn)

    def _end_turn(self, turn: TurnInFlight) -> None:
        """Give the turn's slot back and forget the turn (once, whoever calls it)."""
        with self._turns_changed:
            if turn.released:
                return
            turn.released = True
            self._turns.discard(turn)
            self._turns_changed.notify_all()
        turn.done.set()
        lease = turn.lease
        if lease is not None:
            if self._lease is lease:
                self._lease = None
            if not self.engine.closed:
                self.engine.release(lease)

    def record_turn(self, text: str, reply: str | Sequence[Mapping[str, Any]]) -> Reply:
        """A teacher-forced turn: fit and prefill the context, then store ``reply`` as given.

        Nothing is generated: this measures context and KV-cache behaviour (replaying logged
        conversations). TTFT is the time until the first token could have been sampled.
        ``reply`` is the assistant's text, or the logged messages answering ``text`` (OpenAI
        format: assistant tool calls, tool results, the final answer).
        """
        requested = time.perf_counter()
        turn = self._begin_turn("record")
        try:
            lease = self._lease_slot(turn)
            self._turn_under_way.clear()
            return self._record_turn(turn, text, reply, (requested, time.perf_counter()), lease)
        finally:
            self._turn_under_way.set()
            self._end_turn(turn)

    def _record_turn(
        self,
        turn: TurnInFlight,
        text: str,
        reply: str | Sequence[Mapping[str, Any]],
        leased: tuple[float, float],
        lease: Lease,
    ) -> Reply:
        prepared = self._prepare(text)
        built, context = prepared.result, prepared.context
        with turn.lock:
            self._check_open()
            built_at = time.perf_counter()
            user = self.last_user = self.store.add_message(self.conversation_id, "user", text)
            stored_at = time.perf_counter()
            turn.stream = self.engine.generate(
                built.tokens,
                seq_id=lease.seq_id,
                settings=GenerationSettings(max_tokens=1, temperature=0.0),
                eviction=context.eviction,
                history_start=built.plan.history_start,
            )
        result = turn.stream.wait(first_token_only=True)
        self._turn_under_way.set()
        logged = (
            [{"role": "assistant", "content": reply}]
            if isinstance(reply, str)
            else [dict(m) for m in reply]
        )
        first_text = next((m["content"] for m in logged if m["role"] == "assistant"), "")
        clock = (*leased, built_at, stored_at)
        if logged and logged[0]["role"] == "assistant" and not logged[0].get("tool_calls"):
            stored = self._store_turn(
                user, replace(result, text=logged[0]["content"]), built.plan, clock, lease
            )
            logged = logged[1:]
        else:  # the turn record points at no single assistant message
            stored = self._store_turn(
                user, replace(result, text=""), built.plan, clock, lease, store_reply=False
            )
        if logged:
            self.store.add_messages(self.conversation_id, logged)
        if first_text != stored.text:
            stored = replace(stored, text=first_text)
            self.last_reply = stored
        return stored

    def _prepare(self, text: str, sampling: GenerationSettings | None = None) -> _Built:
        """Build the context for ``text`` and persist what the builder decided."""
        self._check_open()
        if not text.strip():
            raise ConfigError("empty message")
        for attempt in range(1, STATE_ATTEMPTS + 1):
            # raises ContextBudgetError before anything is stored
            prepared = self._build(text, sampling)
            built = self.last_build = prepared.result
            plan = built.plan
            if not (
                plan.evicted
                or plan.summary_changed
                or plan.summarized_ids
                or built.state.pending_ids
            ):
                break
            new_summary = None
            if plan.summary_changed and built.state.summary is not None:
                new_summary = (
                    built.state.summary,
                    plan.summarized_ids,
                    built.state.summary_tokens,
                    built.fingerprint,
                )
            try:  # compare-and-set: another process saving this state meanwhile is not lost
                self.store.save_context_state(
                    self.conversation_id,
                    window_start=built.state.window_start,
                    pending_ids=built.state.pending_ids,
                    new_summary=new_summary,
                    expected_version=prepared.state_version,
                    summary_blocks=built.state.summary_blocks,
                )
            except ContextStateConflict:
                if attempt == STATE_ATTEMPTS:
                    raise
                logger.info(
                    "context state of %s changed meanwhile: built again", self.conversation_id
                )
                continue
            break
        return prepared

    def _stream(
        self,
        turn: TurnInFlight,
        text: str,
        built: BuildResult,
        settings: GenerationSettings,
        eviction: str,
        leased: tuple[float, float],
        replies: list[Reply] | None,
    ) -> Generator[str, None, None]:
        try:
            lost: BackendUnavailable | None = None  # the backend failed to start it
            with turn.lock:
                self._check_open()  # closed before the first chunk was asked for
                _check_cut(turn)  # its reader left before it began: store nothing
                built_at = time.perf_counter()
                turn.user = self.last_user = self.store.add_message(
                    self.conversation_id, "user", text, conversation_settings=turn.settings
                )
                turn.clock = (*leased, built_at, time.perf_counter())
                turn.plan = built.plan
                turn.replies = replies
                try:
                    self._generate(turn, built, settings, eviction)
                except BackendUnavailable as exc:
                    lost = exc
            failure: BaseException | None = None
            try:
                while True:
                    try:
                        if lost is not None:
                            self._fail_over(turn, built, settings, eviction, lost)
                            lost = None
                        assert turn.stream is not None
                        for chunk in turn.stream:
                            turn.yielded = True
                            self._turn_under_way.set()  # the first token is out
                            yield chunk
                        break
                    except BackendUnavailable as exc:
                        if turn.yielded or turn.failovers >= MAX_FAILOVERS:
                            raise
                        lost = exc
            except GeneratorExit:  # the reader let go: the reply so far is stored
                raise
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self._turn_under_way.set()
                if turn.stream is not None:
                    turn.stream.close()
                self._finish_turn(turn, failure)
        finally:
            self._end_turn(turn)

    def _generate(
        self, turn: TurnInFlight, built: BuildResult, settings: GenerationSettings, eviction: str
    ) -> Stream:
        assert turn.lease is not None
        stream = turn.stream = self.engine.generate(
            built.tokens,
            seq_id=turn.lease.seq_id,
            settings=settings,
            eviction=eviction,
            history_start=built.plan.history_start,
        )
        return stream

    def _fail_over(
        self,
        turn: TurnInFlight,
        built: BuildResult,
        settings: GenerationSettings,
        eviction: str,
        exc: BackendUnavailable,
    ) -> None:
        """The backend went away before this turn's first token: run it again on the slot
        a new lease gives (a router places the conversation on another backend). The user
        message is stored once; the record says why the prompt was prefilled again."""
        logger.warning(
            "turn of %s moves off %s before its first token: %s",
            self.conversation_id,
            exc.backend,
            exc,
        )
        turn.failovers += 1
        with turn.lock:
            old, stream = turn.lease, turn.stream
            turn.lease = turn.stream = None
            if stream is not None:
                stream.close()
            if old is not None:
                if self._lease is old:
                    self._lease = None
                if not self.engine.closed:
                    with contextlib.suppress(ChatctxError):
                        self.engine.release(old)
        lease = self._lease_slot(turn)
        if lease.reprefill_reason is None and lease.swap_in is None:
            lease = replace(lease, reprefill_reason=f"failover: {exc.backend} {exc.reason}")
            turn.lease = self._lease = lease
        with turn.lock:
            self._check_open()
            self._generate(turn, built, settings, eviction)

    def _finish_turn(self, turn: TurnInFlight, failure: BaseException | None = None) -> None:
        """Store what the turn generated with its record (once, whoever calls it).

        When the generation itself failed (``failure``), that error is the one the caller
        sees; a failure to store the reply too is logged with the text, never raised over it.
        """
        with turn.lock:
            if turn.finished:
                return
            turn.finished = True
            stream, user = turn.stream, turn.user
            if stream is None or user is None or stream.result is None:
                return  # nothing was generated: nothing to store
            assert turn.plan is not None and turn.clock is not None and turn.lease is not None
            try:
                reply = self._store_turn(user, stream.result, turn.plan, turn.clock, turn.lease)
            except ChatctxError:
                if failure is None:
                    raise
                logger.exception("and the reply of %s could not be stored", self.conversation_id)
                return
            if turn.replies is not None:
                turn.replies.append(reply)

    def _gauges(self) -> tuple[dict[str, int] | None, MemorySnapshot | None]:
        """The cache's cells per sequence and the memory figures for a turn record; None
        where the backend cannot tell (a server refusing ``/slots``): a reply is stored
        without them, never lost for them."""
        if self.engine.closed:
            return None, None
        try:
            cells = {str(seq): n for seq, n in self.engine.kv_usage().items()}
        except ChatctxError as exc:
            logger.warning("cache cells of %s not read: %s", self.conversation_id, exc)
            cells = None
        try:
            memory = self.engine.memory()
        except ChatctxError as exc:
            logger.warning("memory figures not read: %s", exc)
            memory = None
        return cells, memory

    def _store_turn(
        self,
        user: Message,
        result: GenerationResult,
        plan: ContextPlan,
        clock: tuple[float, float, float, float],
        lease: Lease,
        *,
        store_reply: bool = True,
    ) -> Reply:
        """Store the reply and the turn's figures in one transaction. ``clock``:
        perf_counter() stamps of the request, of the slot being leased, of the context being
        built and of the user message being stored.

        A failure logs the reply's text (nothing the client saw is lost without a trace) and
        raises ``StoreError`` (``ClosedError`` for a closed store) chained to the cause.
        """
        complete = result.stop_reason in ("eog", "length")
        timings = _request_timings(result, plan, clock)
        cells, memory = self._gauges()
        figures = turn_figures(
            result,
            plan,
            timings,
            lease,
            model=self.engine.model_name,
            n_ctx=self.engine.n_ctx,
            cells=cells,
            memory=memory,
        )
        message = None
        if store_reply and (result.text or complete):
            message = {
                "role": "assistant",
                "content": result.text,
                "status": "complete" if complete else "partial",
            }
        try:
            if self.store.closed:
                raise ClosedError("store")
            assistant, turn = self.store.record_reply(
                self.conversation_id, message, user_message_id=user.id, **figures
            )
        except Exception as exc:
            logger.error(
                "reply of %s not stored (%s: %s); its text: %r",
                self.conversation_id,
                type(exc).__name__,
                exc,
                result.text,
            )
            if isinstance(exc, ChatctxError):
                raise
            raise StoreError(f"reply of {self.conversation_id} not stored: {exc}") from exc
        if self._meaning is not None:  # embedded now, searched once evicted
            self._meaning.warm([user.content, *([assistant.content] if assistant else [])])
        reply = Reply(
            text=result.text,
            user_message_id=user.id,
            message_id=assistant.id if assistant else None,
            usage=result.usage,
            timings=timings,
            stop_reason=result.stop_reason,
            turn=turn,
            plan=plan,
        )
        logger.debug(
            "turn %s: prompt %d (new %d, reused %d, evaluated %d), evicted %s, shifted %s, "
            "cells %s, ttft %s ms",
            turn.id,
            turn.prompt_tokens,
            turn.new_tokens or 0,
            turn.reused_tokens,
            turn.evaluated_tokens,
            turn.evicted_tokens,
            turn.shifted_tokens,
            turn.cells_used,
            turn.ttft_ms,
        )
        self.last_reply = reply
        if self.on_turn is not None:
            self.on_turn(turn)
        return reply


def _load_engine(model: str | Path | None, options: Mapping[str, Any]) -> Backend:
    # Imported here: a session on another backend never loads llama.cpp.
    from chatctx.engine import Engine

    return Engine.load(model, **options)


def _stored(replies: list[Reply]) -> Reply:
    if not replies:  # _finish stores nothing once the store is closed
        raise ClosedError("store")
    return replies[0]


def _request_timings(
    result: GenerationResult, plan: ContextPlan, clock: tuple[float, float, float, float]
) -> Timings:
    """The engine's timings re-based on the request: TTFT and total count from it."""
    requested, leased_at, built_at, stored_at = clock
    t = result.timings
    before_engine = (result.started_at - requested) * 1000 if result.started_at else 0.0
    return replace(
        t,
        ttft_ms=before_engine + t.ttft_ms if t.ttft_ms is not None else None,
        total_ms=before_engine + t.total_ms,
        slot_ms=(leased_at - requested) * 1000,
        build_ms=(built_at - leased_at) * 1000,
        store_ms=(stored_at - built_at) * 1000,
        summary_ms=plan.summary_ms if plan.evicted or plan.summary_changed else 0.0,
        engine_ttft_ms=t.ttft_ms,
    )


def _context_settings(value: ContextSettings | Mapping[str, Any]) -> ContextSettings:
    if isinstance(value, ContextSettings):
        return value
    try:
        return ContextSettings.model_validate(dict(value))
    except ValidationError as exc:
        raise ConfigError(f"invalid context settings: {exc}") from exc


Sampling = GenerationSettings | Mapping[str, Any] | None


def _settings_or_none(value: Sampling) -> GenerationSettings | None:
    return None if value is None else _settings(value)


def _settings(value: GenerationSettings | Mapping[str, Any]) -> GenerationSettings:
    if isinstance(value, GenerationSettings):
        return value
    try:
        return GenerationSettings.model_validate(dict(value))
    except ValidationError as exc:
        raise ConfigError(f"invalid generation settings: {exc}") from exc


def _check_cut(turn: TurnInFlight) -> None:
    if turn.cut is not None and turn.cut.is_set():
        raise ClosedError("chat turn")


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
