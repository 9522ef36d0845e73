"""ChatSession: one persisted conversation driven through the llama.cpp engine.

::

    with ChatSession.open("sqlite:///bot.db", conversation_id="cust-42") as chat:
        reply = chat.send("My order 1234 has not arrived")
        for chunk in chat.stream("Can you check again?"):
            print(chunk, end="")

The session owns its state and works with collaborators: a ``ConversationContext``
(``_context``: builder, budget, recall search, summaries) builds each turn's context,
``store_turn`` (``_turn``) stores a turn with its record, and ``stream_in_thread``
(``_async``) carries a turn's chunks from its worker thread to asyncio.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Unpack

from pydantic import ValidationError

from chatctx._resource import Closeable
from chatctx.backends.base import (
    Backend,
    GenerationResult,
    Lease,
    Stream,
    TextEmbedder,
)
from chatctx.context import (
    BuildResult,
    ContextBuilder,
    ContextPlan,
    Summarizer,
)
from chatctx.errors import (
    BackendUnavailable,
    ChatctxError,
    ClosedError,
    ConfigError,
    ContextStateConflict,
    DeadlineExceeded,
)
from chatctx.model.tools import (
    ParsedReply,
    ReplyFilter,
    ToolCall,
    call_grammar,
    parse_tool_calls,
)
from chatctx.session._async import stream_in_thread
from chatctx.session._context import ConversationContext, _Built, open_conversation
from chatctx.session._tools import Ask, ToolOptions, ask_for, check_results, open_turn
from chatctx.session._turn import Reply, TurnClock, TurnInFlight, store_turn
from chatctx.settings import ContextSettings, ConversationSettings, GenerationSettings, Settings
from chatctx.store import Message, Store, Turn, TurnClaim

logger = logging.getLogger("chatctx.session")

LEASE_POLL_S = 0.5  # a turn waiting for a slot looks this often whether its session closed
# A turn's first ask for a slot waits no longer: with none free it takes its place in line
# and builds its context, then waits (a wait of 0 would be a mere try, leaving no place).
PLACE_S = 0.001
CLOSE_WAIT_S = 10.0  # close() waits this long for turns still being prepared
STATE_ATTEMPTS = 3  # builds of a turn's context when another writer saves its state meanwhile
MAX_FAILOVERS = 2  # a turn whose backend fails before its first token is retried this often


class ChatSession(Closeable):
    """A conversation stored in a ``Store`` and answered by a backend (an ``Engine``).

    The user message is committed before generation starts; the assistant message when it
    ends, or marked ``partial`` if the reply is interrupted. Each turn leases one of the
    engine's slots: many sessions (threads, or ``asend``/``astream`` on asyncio) share one
    engine, their generations batched together. A turn first claims its conversation in the
    store, so processes sharing the database answer it one turn at a time
    (``chatctx.store._turn_claim``). Close the session (or use ``with``) to release what it opened;
    a store or engine passed in stays open.
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
        claim_turns: bool = True,
    ) -> None:
        self.store = store
        self.engine = engine
        self.conversation_id = conversation_id
        # Set: the expert option, this slot for good. None: a slot is leased per turn (the
        # slot of the last turn is kept here).
        self.seq_id = seq_id
        self._pinned = seq_id is not None
        self._lease: Lease | None = None
        # Each turn claims the conversation in the store (``_turn_claim``), so turns of other
        # processes on it wait: False for a caller that serializes them itself.
        self._claim_turns = claim_turns
        self.on_turn = on_turn
        self._owns_store = owns_store
        self._owns_engine = owns_engine
        # Clear while a turn is prepared and until its first token: a background summary the
        # turn starts waits for it, so it never holds the model ahead of the customer.
        self._turn_under_way = threading.Event()
        self._turn_under_way.set()
        self._context = ConversationContext(
            store,
            engine,
            conversation_id,
            summarizer=summarizer,
            embedder=embedder,
            lease=lambda: self._lease,
            turn_under_way=self._turn_under_way,
        )
        # Turns in flight (any thread): close() ends them before it closes anything.
        self._turns: set[TurnInFlight] = set()
        self._turns_changed = threading.Condition()
        self.last_reply: Reply | None = None
        self.last_user: Message | None = None  # the user message the last turn stored
        self.last_build: BuildResult | None = None  # the context sent on the last turn
        self._last_tools: list[dict[str, Any]] | None = None  # offered on the last turn
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
        claim_turns: bool = True,
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
        ``claim_turns`` (default True): each turn first claims the conversation in the store,
        so bot processes or machines sharing the database answer it one turn at a time, each
        on the whole history before it; a turn waits while another holds the claim (one whose
        process died runs out after 30 s). False skips the two writes per turn, for a caller
        that is the conversation's only writer.
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
            cid = open_conversation(
                store, conversation_id, system_prompt, generation, context_settings
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
                claim_turns=claim_turns,
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
        self._context.stop_summary()
        if self._pinned and not self.engine.closed:
            self.engine.unpin(self.conversation_id)
        if self._owns_engine:
            self.engine.close()
        if self._owns_store:
            self.store.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("chat session")

    # state --------------------------------------------------------------------------------

    @property
    def system_prompt(self) -> str | None:
        return self.store.get_conversation(self.conversation_id).system_prompt

    def conversation_settings(self) -> ConversationSettings:
        """The stored settings, parsed (once per call)."""
        return self._context.conversation_settings()

    @property
    def settings(self) -> GenerationSettings:
        return self.conversation_settings().generation

    @property
    def context_settings(self) -> ContextSettings:
        return self.conversation_settings().context

    # the context -------------------------------------------------------------------------

    def builder(self) -> ContextBuilder:
        """The context builder for the conversation's current settings."""
        return self._context.builder()

    def budget(self, settings: ConversationSettings | None = None) -> tuple[int, int]:
        """(prompt token budget, tokens reserved for the reply) under ``settings`` (default:
        the stored ones, read now).

        The budget is what one slot holds less the reply's reserve; summaries have cells of
        their own (the engine's summary room), so they never take from it.
        """
        return self._context.budget(settings)

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
        self._context.check_fits(message, settings, system_prompt=system_prompt)

    def check_whole(
        self,
        messages: Sequence[Mapping[str, Any]],
        settings: ConversationSettings,
        *,
        system_prompt: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        """The prompt tokens of ``messages`` (OpenAI chat messages) sent whole, with no turn
        trimmed; ``ContextBudgetError`` when they exceed the budget under ``settings``."""
        return self._context.check_whole(
            messages, settings, system_prompt=system_prompt, tools=tools
        )

    def plan(self, new_message: str) -> BuildResult:
        """Build the context for ``new_message`` without sending or storing anything.

        A summary finished in the background shows in the plan and is still taken by the
        next turn; none is started. An inline summarizer (extractive, a callable) runs here
        too when the plan evicts turns, and its result is not kept.
        """
        return self._context.plan(new_message)

    def history(self) -> list[Message]:
        """Every stored message of this conversation, in order (never trimmed)."""
        return self.store.messages(self.conversation_id)

    def pin(self, message_id: int, pinned: bool = True) -> Message:
        """Always send this message, right after the system prompt."""
        return self.store.set_pinned(message_id, pinned)

    # chatting -----------------------------------------------------------------------------

    def send(
        self,
        text: str,
        *,
        settings: Sampling = None,
        **options: Unpack[ToolOptions],
    ) -> Reply:
        """Send a user message and wait for the whole reply.

        ``settings`` (``GenerationSettings`` or a mapping of its fields) sample this turn and
        become the conversation's, stored with the user message in one transaction.

        ``tools`` (OpenAI function tools: ``{"type": "function", "function": {"name",
        "description", "parameters"}}``) go into the prompt through the model's chat
        template. A reply that calls them has ``tool_calls`` (and usually no text); its
        turn stays open until ``submit_tool_results`` sends every call's result.
        ``tool_choice``: ``"auto"`` (default with tools), ``"none"``, ``"required"`` or
        ``{"type": "function", "function": {"name": ...}}``; the last two hold the reply to
        a valid call with a grammar. ``parallel_tool_calls``: one reply may make several.
        """
        ask = ask_for(text, **options)
        return self._send(ask, settings)

    def submit_tool_results(
        self,
        results: Mapping[str, Any],
        *,
        settings: Sampling = None,
        **options: Unpack[ToolOptions],
    ) -> Reply:
        """Continue the open turn with its calls' results (``{call id: output}``, an output
        that is not a string is sent as JSON) and wait for the next reply: text, or more
        calls. The results are stored as messages of the turn before the reply is generated.

        ``tools`` default to those this session offered last (give them again after a
        restart: the open turn itself is read from the store). A result for a call that is
        not waiting, or a waiting call without one, is a ``ConfigError`` naming it, and
        nothing is stored.
        """
        ask = self._results_ask(results, options)
        return self._send(ask, settings)

    def run_tools(
        self,
        text: str,
        functions: Mapping[str, Callable[..., Any]],
        *,
        tools: Sequence[Mapping[str, Any]],
        tool_choice: Any = None,
        max_steps: int = 4,
        settings: Sampling = None,
    ) -> Reply:
        """Send ``text`` and run the calls the replies make with ``functions`` (by name,
        called with the arguments as keywords) until a reply is text: the loop most bots
        write around ``send`` and ``submit_tool_results``. After ``max_steps`` rounds of
        calls the last results go back with ``tool_choice="none"``, so the turn ends in
        text. A function that raises, or a call of one not given, sends the error back as
        the result (the model can say so or try again); it is logged.
        """
        if max_steps < 1:
            raise ConfigError("max_steps must be at least 1")
        reply = self.send(text, settings=settings, tools=tools, tool_choice=tool_choice)
        for step in range(max_steps):
            if not reply.tool_calls:
                return reply
            results = {call.id: _call_function(functions, call) for call in reply.tool_calls}
            reply = self.submit_tool_results(
                results,
                settings=settings,
                tools=tools,
                tool_choice="none" if step == max_steps - 1 else "auto",
            )
        return reply

    def _send(self, ask: Ask, settings: Sampling) -> Reply:
        replies: list[Reply] = []
        for _ in self._open_stream(ask, replies, _settings_or_none(settings)):
            pass
        return _stored(replies)

    def _results_ask(self, results: Mapping[str, Any], options: ToolOptions) -> Ask:
        """The results' ``Ask``, with the tools this session offered last unless given."""
        if options.get("tools") is None:
            options = {**options, "tools": self._last_tools}
        return ask_for(None, results=results, **options)

    def waiting_tool_calls(self) -> list[dict[str, Any]]:
        """The calls of the open turn still waiting for a result (OpenAI-shaped), read from
        the store; empty when no turn is open."""
        turn = open_turn(self.store.last_turn(self.conversation_id))
        return turn.waiting if turn is not None else []

    def stream(
        self,
        text: str,
        *,
        settings: Sampling = None,
        **options: Unpack[ToolOptions],
    ) -> Generator[str, None, None]:
        """Send a user message and yield the reply as it is generated.

        Raises ``ContextBudgetError`` before storing anything when the prompt cannot fit.
        Time to first token is counted from this call, which waits while every slot of the
        engine is leased. ``settings`` and the tool arguments: as for ``send``. With tools,
        output that may be a call is held back; ``last_reply.tool_calls`` has the calls
        once the stream ends.
        """
        ask = ask_for(text, **options)
        return self._open_stream(ask, None, _settings_or_none(settings))

    def stream_tool_results(
        self,
        results: Mapping[str, Any],
        *,
        settings: Sampling = None,
        **options: Unpack[ToolOptions],
    ) -> Generator[str, None, None]:
        """``submit_tool_results``, yielding the reply as it is generated."""
        ask = self._results_ask(results, options)
        return self._open_stream(ask, None, _settings_or_none(settings))

    async def asend(
        self,
        text: str,
        *,
        settings: Sampling = None,
        **options: Unpack[ToolOptions],
    ) -> Reply:
        """``send`` for asyncio: the turn runs in a worker thread, batched with the others."""
        ask = ask_for(text, **options)
        return await self.asend_ask(ask, settings=settings)

    async def asubmit_tool_results(
        self,
        results: Mapping[str, Any],
        *,
        settings: Sampling = None,
        **options: Unpack[ToolOptions],
    ) -> Reply:
        """``submit_tool_results`` for asyncio."""
        ask = self._results_ask(results, options)
        return await self.asend_ask(ask, settings=settings)

    async def asend_ask(self, ask: Ask, *, settings: Sampling = None) -> Reply:
        """``asend`` of an ``Ask`` made with ``ask_for`` (a user message or tool results)."""
        replies: list[Reply] = []
        async for _ in self._astream(ask, replies, None, _settings_or_none(settings)):
            pass
        return _stored(replies)

    def astream(
        self,
        text: str | Ask,
        *,
        before: Callable[[], None] | None = None,
        settings: Sampling = None,
        **options: Unpack[ToolOptions],
    ) -> AsyncIterator[str]:
        """``stream`` for asyncio: ``async for chunk in chat.astream(text)``.

        Leaving the loop early ends the reply (stored as ``partial``), as with ``stream``,
        even in its prefill or while it waits for a slot (then nothing is stored, if its user
        message was not yet); the leaving waits until that is done, even when cancelled.
        ``before`` runs first in the turn's worker thread, before the turn begins (a server
        stores there what its request adds: no thread hop of its own); what it raises is
        raised here, and the turn is then not started. ``settings`` and the tool arguments:
        as for ``send``; ``text`` may be an ``Ask`` (``ask_for``) with tool results.
        """
        ask = text if isinstance(text, Ask) else ask_for(text, **options)
        return self._astream(ask, None, before, _settings_or_none(settings))

    def _astream(
        self,
        ask: Ask,
        replies: list[Reply] | None,
        before: Callable[[], None] | None,
        sampling: GenerationSettings | None,
    ) -> AsyncIterator[str]:
        return stream_in_thread(
            lambda cut: self._open_stream(ask, replies, sampling, cut=cut), self._cut, before
        )

    def _cut(self, cut: threading.Event) -> None:
        """Stop the turn whose reader left (``cut`` is set): closing the backend's stream
        stops a prefill under way too; the turn's own thread then stores what was generated
        (``partial``), as when the reader closes the stream."""
        with self._turns_changed:
            turns = [t for t in self._turns if t.cut is cut]
        for turn in turns:
            with turn.lock:  # a user message being written, a generation being started
                stream = turn.stream
            if stream is not None:
                stream.close()

    def _store_turn(
        self,
        user: Message,
        result: GenerationResult,
        plan: ContextPlan,
        clock: TurnClock,
        lease: Lease,
        *,
        store_reply: bool = True,
        parsed: ParsedReply | None = None,
    ) -> Reply:
        reply = store_turn(
            self.store,
            self.engine,
            self.conversation_id,
            user,
            result,
            plan,
            clock,
            lease,
            store_reply=store_reply,
            meaning=self._context.meaning,
            parsed=parsed,
        )
        self.last_reply = reply
        if self.on_turn is not None and reply.turn is not None:
            self.on_turn(reply.turn)
        return reply

    def _open_stream(
        self,
        ask: Ask,
        replies: list[Reply] | None,
        sampling: GenerationSettings | None = None,
        *,
        cut: threading.Event | None = None,
    ) -> Generator[str, None, None]:
        requested = time.perf_counter()
        turn = self._begin_turn("stream")
        turn.cut = cut
        turn.ask = ask
        if ask.tools:
            self._last_tools = list(ask.tools)
        try:
            self._claim(turn)
            self._turn_under_way.clear()
            # The turn takes its place in line now and builds its context while it waits
            # (a build needs no slot unless its summary runs there): no slot is held idle
            # meanwhile, and turns still start in the order they came.
            self._ask_for_slot(turn, PLACE_S)
            leased_at = waited = 0.0

            def slot() -> None:  # waits in line for the slot, once
                nonlocal leased_at, waited
                if turn.lease is None:
                    asked = time.perf_counter()
                    self._lease_slot(turn)
                    leased_at = time.perf_counter()
                    waited = leased_at - asked

            if turn.lease is not None:
                leased_at = time.perf_counter()
            building = time.perf_counter()
            prepared = self._prepare_ask(turn, ask, sampling, slot=slot)
            build_s = time.perf_counter() - building - waited  # a wait the build made aside
            slot()
            clock = (requested, leased_at, build_s)
            context = prepared.context
            # Sampling given with the turn is stored with its user message (one transaction).
            turn.settings = (
                None
                if sampling is None or sampling == prepared.stored_generation
                else ConversationSettings(generation=sampling, context=context).to_json()
            )
            stream = self._stream(
                turn, prepared.result, prepared.generation, context.eviction, clock, replies
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

    def _claim(self, turn: TurnInFlight) -> None:
        """Wait for the conversation's turn against other processes (before the history is
        read); let go in ``_end_turn``."""
        if not self._claim_turns:
            return
        claim = turn.claim = TurnClaim(self.store, self.conversation_id)

        def check() -> None:
            self._check_open()
            _check_cut(turn)

        claim.take(check)

    def _lease_slot(self, turn: TurnInFlight) -> Lease:
        # In steps, so that a session closed (or a turn cut) meanwhile stops waiting.
        while (lease := self._ask_for_slot(turn, LEASE_POLL_S)) is None:
            pass
        return lease

    def _ask_for_slot(self, turn: TurnInFlight, timeout: float) -> Lease | None:
        """The turn's slot if one comes within ``timeout``; else None, the turn keeping its
        place in line while its caller is away for a moment (the pool's ``AWAY_S``)."""
        self._check_open()
        _check_cut(turn)
        try:
            lease = self.engine.lease(self.conversation_id, timeout=timeout)
        except DeadlineExceeded:
            return None
        return self._hand(turn, lease)

    def _hand(self, turn: TurnInFlight, lease: Lease) -> Lease:
        """``lease`` becomes the turn's, unless the turn was ended meanwhile: then it goes
        back and ``ClosedError`` is raised."""
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
        if turn.claim is not None:
            turn.claim.release()
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
            self._claim(turn)
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
        clock = TurnClock(*leased, built_at, stored_at)
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

    def _prepare_ask(
        self,
        turn: TurnInFlight,
        ask: Ask,
        sampling: GenerationSettings | None,
        *,
        slot: Callable[[], object] | None = None,
    ) -> _Built:
        """``_prepare`` for a user message or the open turn's tool results (checked against
        the calls waiting for them: the turn then continues on its stored user message).
        ``slot``: waits for the turn's slot, for a build that needs it (``_prepare``)."""
        if ask.by_name:
            fmt = self.engine.codec().tool_format
            turn.grammar = call_grammar(ask.by_name, fmt, ask.choice, parallel=ask.parallel)
        if ask.text is not None:
            return self._prepare(ask.text, sampling, tools=ask.tools, slot=slot)
        self._check_open()
        waiting = open_turn(self.store.last_turn(self.conversation_id))
        check_results(
            waiting.waiting_ids if waiting is not None else None, [i for i, _ in ask.results]
        )
        assert waiting is not None
        turn.user = waiting.user
        rest = [m.to_openai() for m in waiting.rest] + ask.result_messages()
        return self._prepare(
            waiting.user.content,
            sampling,
            tools=ask.tools,
            open_turn=(waiting.user.position, rest),
            slot=slot,
        )

    def _prepare(
        self,
        text: str,
        sampling: GenerationSettings | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        open_turn: tuple[int, Sequence[Mapping[str, Any]]] | None = None,
        slot: Callable[[], object] | None = None,
    ) -> _Built:
        """Build the context for ``text`` and persist what the builder decided. ``slot``:
        for a build before the turn has its slot, waits for it where the build needs it."""
        self._check_open()
        if not text.strip():
            raise ConfigError("empty message")
        for attempt in range(1, STATE_ATTEMPTS + 1):
            # raises ContextBudgetError before anything is stored
            prepared = self._context.build(
                text, sampling, open_turn=open_turn, tools=tools or None, slot=slot
            )
            built = self.last_build = prepared.result
            plan = built.plan
            if not (
                plan.evicted
                or plan.cleared_ids
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
                    abridged=[cut.to_row() for cut in built.state.abridged],
                    cleared_ids=built.state.cleared_ids,
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
        built: BuildResult,
        settings: GenerationSettings,
        eviction: str,
        leased: tuple[float, float, float | None],
        replies: list[Reply] | None,
    ) -> Generator[str, None, None]:
        try:
            lost: BackendUnavailable | None = None  # the backend failed to start it
            with turn.lock:
                self._check_open()  # closed before the first chunk was asked for
                _check_cut(turn)  # its reader left before it began: store nothing
                built_at = time.perf_counter()
                ask = turn.ask
                assert ask is not None
                if ask.text is not None:
                    turn.user = self.store.add_message(
                        self.conversation_id, "user", ask.text, conversation_settings=turn.settings
                    )
                else:  # the open turn goes on: its results are stored, its user message was
                    self.store.add_messages(
                        self.conversation_id, ask.result_messages(), settings=turn.settings
                    )
                self.last_user = turn.user
                requested, leased_at, build_s = leased
                turn.clock = TurnClock(requested, leased_at, built_at, time.perf_counter(), build_s)
                turn.plan = built.plan
                turn.replies = replies
                try:
                    self._generate(turn, built, settings, eviction)
                except BackendUnavailable as exc:
                    lost = exc
            failure: BaseException | None = None
            ask = turn.ask
            assert ask is not None
            # Output that may be a call is held back; a turn without tools streams as is.
            shown = (
                ReplyFilter(self.engine.codec().tool_format, ask.by_name)
                if ask.reads_calls
                else None
            )
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
                            if shown is None:
                                yield chunk
                            elif text := shown.feed(chunk):
                                yield text
                        break
                    except BackendUnavailable as exc:
                        if turn.yielded or turn.failovers >= MAX_FAILOVERS:
                            raise
                        lost = exc
                if shown is not None:
                    parsed, rest = shown.finish()
                    turn.parsed = parsed if ask.parallel else parsed.first_call_only()
                    if rest:
                        yield rest
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
            grammar=turn.grammar,
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
            parsed = turn.parsed
            ask = turn.ask
            if parsed is None and ask is not None and ask.reads_calls:  # stopped before its end
                fmt = self.engine.codec().tool_format
                parsed = parse_tool_calls(stream.result.text, fmt, ask.by_name)
                if not ask.parallel:
                    parsed = parsed.first_call_only()
            try:
                reply = self._store_turn(
                    user, stream.result, turn.plan, turn.clock, turn.lease, parsed=parsed
                )
            except ChatctxError:
                if failure is None:
                    raise
                logger.exception("and the reply of %s could not be stored", self.conversation_id)
                return
            if turn.replies is not None:
                turn.replies.append(reply)


def _call_function(functions: Mapping[str, Callable[..., Any]], call: ToolCall) -> Any:
    """What a call returns, or the error it met as text (sent back as its result)."""
    function = functions.get(call.name)
    if function is None:
        return f"error: no function {call.name!r} here"
    try:
        return function(**json.loads(call.arguments))
    except Exception as exc:
        logger.warning("tool %s failed: %s: %s", call.name, type(exc).__name__, exc)
        return f"error: {type(exc).__name__}: {exc}"


def _load_engine(model: str | Path | None, options: Mapping[str, Any]) -> Backend:
    # Imported here: a session on another backend never loads llama.cpp.
    from chatctx.backends.engine import Engine

    return Engine.load(model, **options)


def _stored(replies: list[Reply]) -> Reply:
    if not replies:  # _finish stores nothing once the store is closed
        raise ClosedError("store")
    return replies[0]


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
