"""How a ``ChatSession`` builds a turn's context: its builder, budget, recall search and
summaries (``ConversationContext``, one per session)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatctx.backends.base import Backend, Lease, TextEmbedder
from chatctx.context import (
    BackgroundSummarizer,
    BuildResult,
    ContextBuilder,
    ContextState,
    Cut,
    LLMSummarizer,
    MeaningSearch,
    RecallSearch,
    Summarizer,
    summarizer_for,
    summary_limit,
)
from chatctx.errors import ConfigError, ContextBudgetError, DeadlineExceeded
from chatctx.settings import ContextSettings, ConversationSettings, GenerationSettings
from chatctx.store import Store

logger = logging.getLogger("chatctx.session")


@dataclass(frozen=True, slots=True)
class _Built:
    """One build of a turn's context and what it was built from (per call: two threads
    building on one session never see each other's reads)."""

    result: BuildResult
    generation: GenerationSettings  # the turn's sampling
    context: ContextSettings
    stored_generation: GenerationSettings  # the conversation's, as read
    state_version: int  # of the context state read: the save compares and sets against it


class ConversationContext:
    """How a ``ChatSession``'s turns get their context: the builder for the conversation's
    settings, the budget, recall (by meaning or by words) and the running summary, written
    inline or in the background. The session owns one and asks it for each turn's build."""

    def __init__(
        self,
        store: Store,
        engine: Backend,
        conversation_id: str,
        *,
        summarizer: Summarizer | None,
        embedder: TextEmbedder | None,
        lease: Callable[[], Lease | None],
        turn_under_way: threading.Event,
    ) -> None:
        self.store = store
        self.engine = engine
        self.conversation_id = conversation_id
        self._custom_summarizer = summarizer
        # Recall by meaning: this embedder, else the backend's (None: recall by words).
        self._embedder = embedder
        self._lease = lease  # the turn's slot, where a summary without a side sequence runs
        # Clear while a turn is prepared and until its first token: a background summary
        # waits for it, so it never holds the model ahead of the customer.
        self._turn_under_way = turn_under_way
        self._builder: ContextBuilder | None = None
        self._builder_settings: ContextSettings | None = None
        self.background: BackgroundSummarizer | None = None  # a summary written off-turn
        self.meaning: MeaningSearch | None = None  # recall by meaning, when it is used
        self._cancel_summary = threading.Event()  # set at close: stop writing it

    def conversation_settings(self) -> ConversationSettings:
        """The stored settings, parsed (once per call)."""
        return ConversationSettings.parse(
            self.store.get_conversation(self.conversation_id).settings
        )

    def builder(self) -> ContextBuilder:
        """The context builder for the conversation's current settings."""
        stored = self.conversation_settings()
        return self._builder_for(stored.context, self._budget(stored.context, stored.generation)[0])

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
                    max_input_tokens=self._summary_input_tokens(settings),
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
                    self.stop_summary()  # one written for the settings before, if any
                    self.background = summarizer
            store = self.store
            self._builder = ContextBuilder(
                codec,
                settings,
                summarizer=summarizer,
                cache=store,
                lookup=store.messages_by_ids,
                recall=self._recall_search(settings),
                layout=self._layout(settings),
                cache_edits=getattr(self.engine, "cache_edits", "in-place"),
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
        self.meaning = None
        if settings.recall and mode == "meaning":
            if embedder is None:  # asked for by name: the local one, or its clear ModelError
                from chatctx.backends.engine import shared_embedder

                embedder = shared_embedder()
            self.meaning = MeaningSearch(
                lambda: store.messages(cid),
                embedder.embed,
                min_similarity=settings.recall_min_similarity,
                prefetch=embedder.prefetch,
                vectors=store,
                fingerprint=embedder.fingerprint,
                unrelated=getattr(embedder, "unrelated", None),
                words=lambda query, before, limit: store.search_messages(
                    cid, query, before_position=before, limit=limit
                ),
            )
            # Messages are embedded once recall is within reach (``store_turn``); a resumed
            # conversation's are mostly stored with their vectors already.
            return self.meaning
        return lambda query, before, limit: store.search_messages(
            cid, query, before_position=before, limit=limit, replies=True
        )

    def summary_on_slot(self, settings: ContextSettings) -> bool:
        """Whether a summary under ``settings`` runs on the turn's own slot: the model
        writes it (no summarizer of the caller's) and there is no sequence for summaries."""
        return (
            self._custom_summarizer is None
            and settings.summarizer == "llm"
            and not self._side_sequence()
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

    def check_whole(
        self,
        messages: Sequence[Mapping[str, Any]],
        settings: ConversationSettings,
        *,
        system_prompt: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        """The prompt tokens of ``messages`` sent whole (no turn trimmed, no summary); a
        ``ContextBudgetError`` when they exceed the budget under ``settings``.

        For callers that refuse to fit a history (the Responses API's ``truncation:
        disabled``): the stored history and what the request adds, checked before either
        is sent or stored.
        """
        budget, reserve = self._budget(settings.context, settings.generation)
        whole = [dict(m) for m in messages]
        if system_prompt:
            whole.insert(0, {"role": "system", "content": system_prompt})
        needed = self._builder_for(settings.context, budget).count_messages(whole, tools=tools)
        if needed > budget:
            raise ContextBudgetError(
                f"the conversation takes {needed} tokens > budget {budget}, and truncation "
                "is disabled",
                prompt_tokens=needed,
                budget=budget,
                n_ctx=budget + reserve,
            )
        return needed

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
        background = self.background
        if background is None:
            return self.build(new_message).result
        with background.peeking():
            return self.build(new_message).result

    def build(
        self,
        new_message: str,
        sampling: GenerationSettings | None = None,
        *,
        open_turn: tuple[int, Sequence[Mapping[str, Any]]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        slot: Callable[[], object] | None = None,
    ) -> _Built:
        """The context for ``new_message``, with the settings it was built under (one read;
        ``sampling`` in place of the stored generation settings). ``open_turn``: the
        position of ``new_message`` when it is stored already, in a turn still open, and
        the calls and results that follow it. ``tools``: the function tools offered.
        ``slot``: for a build that runs before the turn has its slot, called (to wait for
        it) when a summary written now would run on that slot."""
        inputs = self.store.context_inputs(self.conversation_id)
        conversation, stored, history = inputs.conversation, inputs.state, inputs.history
        parsed = ConversationSettings.parse(conversation.settings)
        generation, context = sampling or parsed.generation, parsed.context
        state = ContextState(
            window_start=stored.window_start,
            summary=stored.summary.content if stored.summary else None,
            summary_tokens=stored.summary.token_count or 0 if stored.summary else 0,
            pending_ids=stored.pending_ids,
            cleared_ids=stored.cleared_ids,
            summary_blocks=stored.summary.blocks if stored.summary else (),
            abridged=tuple(Cut.from_row(c) for c in stored.summary.abridged)
            if stored.summary
            else (),
        )
        if open_turn is not None:
            history = [m for m in history if m.position < open_turn[0]]
        budget, reserve = self._budget(context, generation)
        if slot is not None and self.summary_on_slot(context):
            slot()
        built = self._builder_for(context, budget).build(
            system_prompt=conversation.system_prompt,
            history=history,
            new_message=new_message,
            budget=budget,
            reserve=reserve,
            state=state,
            pinned=inputs.pinned,
            open_turn=open_turn[1] if open_turn is not None else (),
            tools=tools,
        )
        return _Built(built, generation, context, parsed.generation, stored.version)

    def _summary_input_tokens(self, settings: ContextSettings) -> int:
        # Evicted turns are folded in chunks of this many tokens; with the summary's output
        # and instructions they fit the engine's summary room.
        chunk = max(128, min(1024, self.engine.n_ctx // 4))
        if self._side_sequence():
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
        settings = self.conversation_settings().context
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
        lease = self._lease()
        assert lease is not None, "summaries run while the turn holds its slot"
        generation = self.engine.generate(prompt, seq_id=lease.seq_id, settings=sampling)
        try:
            for _ in generation:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"summary not done after {limit:.1f} s", what="summary", seconds=limit
                    )
        finally:
            generation.close()
        return generation.text

    def stop_summary(self) -> None:
        """Stop a summary still being written in the background and wait until its side
        sequence is free again: once the session is gone nobody would take the result, and
        the engine could not clear or reuse that sequence meanwhile."""
        background, self.background = self.background, None
        if background is None or not background.running():
            return
        self.engine.cancel_side(self._cancel_summary)
        if not background.wait(timeout=background.timeout_s):
            logger.warning("the background summary did not stop")
        self._cancel_summary = threading.Event()


def open_conversation(
    store: Store,
    conversation_id: str | None,
    system_prompt: str | None,
    generation: GenerationSettings | None,
    context: ContextSettings | None,
) -> str:
    """The id of the conversation ``ChatSession.open`` opens: created (a new id when
    ``conversation_id`` is None) or found, with what was given stored over its settings."""
    changed = generation is not None or context is not None
    initial = ConversationSettings(
        generation=generation or GenerationSettings(),
        context=context or ContextSettings(),
    )
    if conversation_id is None:
        cid = store.create_conversation(system_prompt=system_prompt, settings=initial.to_json()).id
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
                context=context or current.context,
            )
            store.update_conversation(
                cid,
                system_prompt=system_prompt,
                settings=merged.to_json() if changed else None,
            )
    return cid
