"""ChatSession: one persisted conversation driven through the llama.cpp engine.

::

    with ChatSession.open("sqlite:///bot.db", conversation_id="cust-42") as chat:
        reply = chat.send("My order 1234 has not arrived")
        for chunk in chat.stream("Can you check again?"):
            print(chunk, end="")
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from chatctx._resource import Closeable
from chatctx.config import ContextSettings, GenerationSettings
from chatctx.context import (
    BackgroundSummarizer,
    BuildResult,
    ContextBuilder,
    ContextPlan,
    ContextState,
    LLMSummarizer,
    Summarizer,
    summarizer_for,
    summary_limit,
)
from chatctx.engine import Engine, GenerationResult, Timings, Usage
from chatctx.errors import ClosedError, ConfigError
from chatctx.monitor import memory_snapshot
from chatctx.store import Message, Store, Turn

__all__ = ["ChatSession", "Reply"]

logger = logging.getLogger("chatctx.session")


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
    """A conversation stored in a ``Store`` and answered by an ``Engine``.

    The user message is committed before generation starts; the assistant message when it
    ends, or marked ``partial`` if the reply is interrupted. Close the session (or use
    ``with``) to release what it opened; a store or engine passed in stays open.
    """

    def __init__(
        self,
        *,
        store: Store,
        engine: Engine,
        conversation_id: str,
        seq_id: int = 0,
        summarizer: Summarizer | None = None,
        on_turn: Callable[[Turn], None] | None = None,
        owns_store: bool = False,
        owns_engine: bool = False,
    ) -> None:
        self.store = store
        self.engine = engine
        self.conversation_id = conversation_id
        self.seq_id = seq_id
        self._custom_summarizer = summarizer
        self.on_turn = on_turn
        self._owns_store = owns_store
        self._owns_engine = owns_engine
        self._builder: ContextBuilder | None = None
        self._builder_settings: ContextSettings | None = None
        self.last_reply: Reply | None = None
        self.last_build: BuildResult | None = None  # the context sent on the last turn
        self._closed = False

    @classmethod
    def open(
        cls,
        db: str | Store = "sqlite:///chatctx.db",
        *,
        conversation_id: str | None = None,
        model: str | Path | Engine | None = None,
        system_prompt: str | None = None,
        settings: GenerationSettings | Mapping[str, Any] | None = None,
        context: ContextSettings | Mapping[str, Any] | None = None,
        summarizer: Summarizer | None = None,
        on_turn: Callable[[Turn], None] | None = None,
        engine_options: Mapping[str, Any] | None = None,
        seq_id: int = 0,
    ) -> ChatSession:
        """Open (or create) a conversation.

        ``db`` is a SQLAlchemy URL or an open ``Store``. ``model`` is a GGUF path, a loaded
        ``Engine`` (shared, left open), or None for ``CHATCTX_MODEL`` / the embedded default.
        ``system_prompt``, ``settings`` (generation) and ``context`` (budget, policy,
        summarizer), when given, are stored with the conversation. ``summarizer`` is a callable
        ``(previous_summary, evicted_messages) -> summary`` used instead of the configured one.
        ``on_turn`` is called with each stored turn record (tokens, KV events, timings).
        """
        generation = _settings(settings) if settings is not None else None
        context_settings = _context_settings(context) if context is not None else None
        owns_store = not isinstance(db, Store)
        store = Store(db) if isinstance(db, str) else db
        try:
            cid = conversation_id
            updates: dict[str, Any] = {}
            if generation is not None:
                updates["generation"] = generation.model_dump()
            if context_settings is not None:
                updates["context"] = context_settings.model_dump()
            if cid is not None and store.has_conversation(cid):
                if system_prompt is not None or updates:
                    stored = store.get_conversation(cid).settings
                    store.update_conversation(
                        cid,
                        system_prompt=system_prompt,
                        settings=(stored | updates) if updates else None,
                    )
            else:
                defaults = {
                    "generation": GenerationSettings().model_dump(),
                    "context": ContextSettings().model_dump(),
                }
                cid = store.create_conversation(
                    cid, system_prompt=system_prompt, settings=defaults | updates
                ).id
            owns_engine = not isinstance(model, Engine)
            engine = (
                model
                if isinstance(model, Engine)
                # A spare sequence for side-sequence summaries and in-place reordering.
                else Engine.load(model, **({"n_seq_max": 2} | dict(engine_options or {})))
            )
        except BaseException:
            if owns_store:
                store.close()
            raise
        return cls(
            store=store,
            engine=engine,
            conversation_id=cid,
            seq_id=seq_id,
            summarizer=summarizer,
            on_turn=on_turn,
            owns_store=owns_store,
            owns_engine=owns_engine,
        )

    # lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release what the session opened; a reply still streaming ends first (``partial``)."""
        if self._closed:
            return
        self._closed = True
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

    @property
    def settings(self) -> GenerationSettings:
        stored = self.store.get_conversation(self.conversation_id).settings
        return _settings(stored.get("generation") or {})

    @property
    def context_settings(self) -> ContextSettings:
        stored = self.store.get_conversation(self.conversation_id).settings
        return _context_settings(stored.get("context") or {})

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
                        summarizer.fold, timeout_s=settings.summary_timeout_s
                    )
            store, cid = self.store, self.conversation_id
            self._builder = ContextBuilder(
                codec,
                settings,
                summarizer=summarizer,
                cache=store,
                lookup=store.messages_by_ids,
                recall=lambda query, before, limit: store.search_messages(
                    cid, query, before_position=before, limit=limit, replies=True
                ),
            )
            self._builder_settings = settings
        return self._builder

    def _side_sequence(self) -> bool:
        """Whether summaries can run on a sequence of their own (the engine's spare)."""
        spare = self.engine.spare_seq
        return spare is not None and spare != self.seq_id

    def budget(self) -> tuple[int, int]:
        """(prompt token budget, tokens reserved for the reply).

        With the LLM summarizer on a spare sequence of a unified KV cache, the summary request
        shares the cells: its room is kept out of the chat's budget.
        """
        stored = self.store.get_conversation(self.conversation_id).settings
        return self._budget(
            _context_settings(stored.get("context") or {}),
            _settings(stored.get("generation") or {}),
        )

    def _budget(self, settings: ContextSettings, generation: GenerationSettings) -> tuple[int, int]:
        reserve = settings.reserve if settings.reserve is not None else generation.max_tokens
        side_room = self._side_room(settings)
        limit = self.engine.n_ctx - reserve - side_room
        budget = min(settings.budget, limit) if settings.budget is not None else limit
        if budget < 16:
            raise ConfigError(
                f"no room for a prompt: n_ctx {self.engine.n_ctx}, reserve {reserve}, "
                f"summary room {side_room}"
            )
        return budget, reserve

    def _side_room(self, settings: ContextSettings) -> int:
        spare = self.engine.spare_seq
        if settings.summarizer != "llm" or spare is None or spare == self.seq_id:
            return 0
        if not self.engine.config.kv_unified:
            return 0  # split streams: the spare sequence has cells of its own
        # The summary written is at most summary_limit(...) tokens (what the summarizer gets).
        written = summary_limit(settings.summary_max_tokens, settings.budget or self.engine.n_ctx)
        return self._summary_input_tokens() + written

    def plan(self, new_message: str) -> BuildResult:
        """Build the context for ``new_message`` without sending or storing anything.

        Note: when the plan evicts turns, summarizing runs here too (its result is not kept).
        """
        return self._build(new_message)[0]

    def _build(self, new_message: str) -> tuple[BuildResult, GenerationSettings, ContextSettings]:
        """The context for ``new_message``, with the settings it was built under (one read)."""
        conversation = self.store.get_conversation(self.conversation_id)
        generation = _settings(conversation.settings.get("generation") or {})
        context = _context_settings(conversation.settings.get("context") or {})
        stored = self.store.context_state(self.conversation_id)
        state = ContextState(
            window_start=stored.window_start,
            summary=stored.summary.content if stored.summary else None,
            summary_tokens=stored.summary.token_count or 0 if stored.summary else 0,
            pending_ids=stored.pending_ids,
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
        return built, generation, context

    def _summary_input_tokens(self) -> int:
        # Evicted turns are folded in chunks of this many tokens.
        return max(128, min(1024, self.engine.n_ctx // 4))

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
                prompt, settings=sampling, background=background, deadline=deadline
            )
        generation = self.engine.generate(prompt, seq_id=self.seq_id, settings=sampling)
        try:
            for _ in generation:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"summary not done after {limit:.1f} s")
        finally:
            generation.close()
        return generation.text

    # chatting -----------------------------------------------------------------------------

    def send(self, text: str) -> Reply:
        """Send a user message and wait for the whole reply."""
        for _ in self.stream(text):
            pass
        assert self.last_reply is not None
        return self.last_reply

    def stream(self, text: str) -> Generator[str, None, None]:
        """Send a user message and yield the reply as it is generated.

        Raises ``ContextBudgetError`` before storing anything when the prompt cannot fit.
        Time to first token is counted from this call.
        """
        requested = time.perf_counter()
        built, generation, context = self._prepare(text)
        return self._stream(text, built, generation, context.eviction, requested)

    def record_turn(self, text: str, reply: str | Sequence[Mapping[str, Any]]) -> Reply:
        """A teacher-forced turn: fit and prefill the context, then store ``reply`` as given.

        Nothing is generated: this measures context and KV-cache behaviour (replaying logged
        conversations). TTFT is the time until the first token could have been sampled.
        ``reply`` is the assistant's text, or the logged messages answering ``text`` (OpenAI
        format: assistant tool calls, tool results, the final answer).
        """
        requested = time.perf_counter()
        built, _, context = self._prepare(text)
        built_at = time.perf_counter()
        user = self.store.add_message(self.conversation_id, "user", text)
        stored_at = time.perf_counter()
        result = self.engine.prefill(
            built.tokens,
            seq_id=self.seq_id,
            eviction=context.eviction,
            history_start=built.plan.history_start,
        )
        logged = (
            [{"role": "assistant", "content": reply}]
            if isinstance(reply, str)
            else [dict(m) for m in reply]
        )
        first_text = next((m["content"] for m in logged if m["role"] == "assistant"), "")
        clock = (requested, built_at, stored_at)
        if logged and logged[0]["role"] == "assistant" and not logged[0].get("tool_calls"):
            self._finish(user, replace(result, text=logged[0]["content"]), built.plan, clock)
            logged = logged[1:]
        else:  # the turn record points at no single assistant message
            self._finish(user, replace(result, text=""), built.plan, clock, store_reply=False)
        if logged:
            self.store.add_messages(self.conversation_id, logged)
        assert self.last_reply is not None
        if first_text != self.last_reply.text:
            self.last_reply = replace(self.last_reply, text=first_text)
        return self.last_reply

    def _prepare(self, text: str) -> tuple[BuildResult, GenerationSettings, ContextSettings]:
        """Build the context for ``text`` and persist what the builder decided."""
        self._check_open()
        if not text.strip():
            raise ConfigError("empty message")
        # raises ContextBudgetError before anything is stored
        built, generation, context = self._build(text)
        self.last_build = built
        plan = built.plan
        if plan.evicted or plan.summary_changed or plan.summarized_ids or built.state.pending_ids:
            new_summary = None
            if plan.summary_changed and built.state.summary is not None:
                new_summary = (
                    built.state.summary,
                    plan.summarized_ids,
                    built.state.summary_tokens,
                    built.fingerprint,
                )
            self.store.save_context_state(
                self.conversation_id,
                window_start=built.state.window_start,
                pending_ids=built.state.pending_ids,
                new_summary=new_summary,
            )
        return built, generation, context

    def _stream(
        self,
        text: str,
        built: BuildResult,
        settings: GenerationSettings,
        eviction: str,
        requested: float,
    ) -> Generator[str, None, None]:
        built_at = time.perf_counter()
        user = self.store.add_message(self.conversation_id, "user", text)
        stored_at = time.perf_counter()
        generation = self.engine.generate(
            built.tokens,
            seq_id=self.seq_id,
            settings=settings,
            eviction=eviction,
            history_start=built.plan.history_start,
        )
        try:
            yield from generation
        finally:
            generation.close()
            self._finish(user, generation.result, built.plan, (requested, built_at, stored_at))

    def _finish(
        self,
        user: Message,
        result: GenerationResult | None,
        plan: ContextPlan,
        clock: tuple[float, float, float],
        *,
        store_reply: bool = True,
    ) -> None:
        """Store the reply and the turn's figures. ``clock``: perf_counter() stamps of the
        request, of the context being built and of the user message being stored."""
        if result is None:  # interrupted before the engine started
            return
        if self.store.closed:
            logger.warning("reply of %s not stored: the store is closed", self.conversation_id)
            return
        complete = result.stop_reason in ("eog", "length")
        kv = result.kv
        timings = _request_timings(result, plan, clock)
        memory = memory_snapshot()
        cells = (
            None
            if self.engine.closed
            else {str(seq): n for seq, n in self.engine.kv_usage().items()}
        )
        assistant = None
        if store_reply and (result.text or complete):
            assistant = self.store.add_message(
                self.conversation_id,
                "assistant",
                result.text,
                status="complete" if complete else "partial",
            )
        turn = self.store.add_turn(
            self.conversation_id,
            user_message_id=user.id,
            assistant_message_id=assistant.id if assistant else None,
            model=str(self.engine.config.model_path.name),
            seq_id=self.seq_id,
            n_ctx=self.engine.n_ctx,
            prompt_tokens=result.usage.prompt_tokens,
            reused_tokens=result.usage.reused_tokens,
            evaluated_tokens=result.usage.evaluated_tokens,
            generated_tokens=result.usage.generated_tokens,
            prefill_ms=timings.prefill_ms,
            ttft_ms=timings.ttft_ms,
            decode_tokens_per_s=timings.decode_tokens_per_s,
            total_ms=timings.total_ms,
            build_ms=timings.build_ms,
            store_ms=timings.store_ms,
            engine_ttft_ms=timings.engine_ttft_ms,
            stop_reason=result.stop_reason,
            plan=plan.to_dict(),
            new_tokens=plan.new_tokens,
            evicted_tokens=kv.evicted_tokens if kv else None,
            shifted_tokens=kv.shifted_tokens if kv else None,
            shift_count=kv.shift_count if kv else None,
            eviction_policy=kv.policy if kv else None,
            kv_fallback=kv.fallback if kv else None,
            cells_used=cells,
            summary_tokens=plan.sections.get("summary"),
            summary_ms=plan.summary_ms if plan.evicted or plan.summary_changed else None,
            recall_tokens=plan.sections.get("recall"),
            recall_ms=plan.recall_ms,
            rss_bytes=memory.rss_bytes,
            gpu_used_bytes=memory.gpu_used_bytes,
            gpu_free_bytes=memory.gpu_free_bytes,
        )
        self.last_reply = Reply(
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
        if self.on_turn is not None:
            self.on_turn(turn)


def _request_timings(
    result: GenerationResult, plan: ContextPlan, clock: tuple[float, float, float]
) -> Timings:
    """The engine's timings re-based on the request: TTFT and total count from it."""
    requested, built_at, stored_at = clock
    t = result.timings
    before_engine = (result.started_at - requested) * 1000 if result.started_at else 0.0
    return replace(
        t,
        ttft_ms=before_engine + t.ttft_ms if t.ttft_ms is not None else None,
        total_ms=before_engine + t.total_ms,
        build_ms=(built_at - requested) * 1000,
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


def _settings(value: GenerationSettings | Mapping[str, Any]) -> GenerationSettings:
    if isinstance(value, GenerationSettings):
        return value
    try:
        return GenerationSettings.model_validate(dict(value))
    except ValidationError as exc:
        raise ConfigError(f"invalid generation settings: {exc}") from exc
