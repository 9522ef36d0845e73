"""A turn in flight, the figures its record carries, and its storing.

A ``ChatSession`` registers every turn it starts, so that ``close()`` can end each one the
same way its own thread would: stop the generation, store what was generated (``partial``)
with its turn record, give the slot back. Whoever gets there first does it; the other finds
it done. This is what makes "a reply the client saw is a reply the store holds" hold when
the session is closed from another thread while a reply streams.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from chatctx.backends.base import (
    Backend,
    GenerationResult,
    Lease,
    MemorySnapshot,
    Stream,
    Timings,
    Usage,
)
from chatctx.context import ContextPlan, MeaningSearch
from chatctx.errors import ChatctxError, ClosedError, StoreError
from chatctx.model.tools import CallGrammar, ParsedReply, ToolCall
from chatctx.session._tools import Ask
from chatctx.store import Message, Store, Turn, TurnClaim

logger = logging.getLogger("chatctx.session")  # what a session logs about its turns


class TurnClock(NamedTuple):
    """``perf_counter()`` stamps of a turn for its record: asked for, its slot leased, its
    context built (the user message about to be stored), the user message stored.
    ``build_s``: the build's own time (it may run before the lease, in line); None: the
    time between ``leased`` and ``built``."""

    requested: float
    leased: float
    built: float
    stored: float
    build_s: float | None = None


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
    # Calls the reply made (its turn stays open for their results) and, when output that
    # looked like a call was kept as text, why.
    tool_calls: tuple[ToolCall, ...] = ()
    warning: str | None = None


@dataclass(eq=False)
class TurnInFlight:
    """One turn between its start and the moment its slot is given back.

    ``lock`` is held while the user message is written and the generation started, and while
    the turn is finished (its reply stored): ``close()`` waits on it instead of racing them.
    """

    kind: str  # "stream" (send/stream: close() may finish it) or "record" (teacher-forced)
    lease: Lease | None = None
    user: Message | None = None
    stream: Stream | None = None
    plan: ContextPlan | None = None
    clock: TurnClock | None = None
    replies: list[Reply] | None = None
    finished: bool = False  # its reply is stored (or there was none to store)
    released: bool = False  # its slot is given back
    yielded: bool = False  # text reached the reader: a failed backend can't be retried
    failovers: int = 0  # times the turn moved to another backend before its first token
    settings: dict[str, Any] | None = None  # conversation settings stored with the user message
    # Set when the turn's reader has left (``astream`` ended early): the turn stops where it
    # is, and one that has not stored its user message yet stores nothing.
    cut: threading.Event | None = None
    claim: TurnClaim | None = None  # the conversation's turn, claimed in the store
    ask: Ask | None = None  # what the turn sends: a user message or tool results
    grammar: CallGrammar | None = None  # a required call's grammar
    parsed: ParsedReply | None = None  # the reply read for calls, once it is whole
    lock: threading.RLock = field(default_factory=threading.RLock)
    done: threading.Event = field(default_factory=threading.Event)


def turn_figures(
    result: GenerationResult,
    plan: ContextPlan,
    timings: Timings,
    lease: Lease,
    *,
    model: str,
    n_ctx: int,
    cells: dict[str, int] | None,
    memory: MemorySnapshot | None,
) -> dict[str, Any]:
    """The turn record's columns (``Store.add_turn``/``record_reply`` keywords) for one turn."""
    kv = result.kv
    summarized = plan.evicted or plan.summary_changed
    return {
        "model": model,
        "seq_id": lease.seq_id,
        "n_ctx": n_ctx,
        "prompt_tokens": result.usage.prompt_tokens,
        "reused_tokens": result.usage.reused_tokens,
        "evaluated_tokens": result.usage.evaluated_tokens,
        "generated_tokens": result.usage.generated_tokens,
        "prefill_ms": timings.prefill_ms,
        "ttft_ms": timings.ttft_ms,
        "decode_tokens_per_s": timings.decode_tokens_per_s,
        "total_ms": timings.total_ms,
        "build_ms": timings.build_ms,
        "store_ms": timings.store_ms,
        "engine_ttft_ms": timings.engine_ttft_ms,
        "stop_reason": result.stop_reason,
        "plan": plan.to_dict(),
        "new_tokens": plan.new_tokens,
        "evicted_tokens": kv.evicted_tokens if kv else None,
        "shifted_tokens": kv.shifted_tokens if kv else None,
        "shift_count": kv.shift_count if kv else None,
        "eviction_policy": kv.policy if kv else None,
        "kv_fallback": kv.fallback if kv else None,
        "cells_used": cells,
        "summary_tokens": plan.sections.get("summary"),
        "summary_ms": plan.summary_ms if summarized else None,
        "recall_tokens": plan.sections.get("recall"),
        "recall_ms": plan.recall_ms,
        "rss_bytes": memory.rss_bytes if memory else None,
        "gpu_used_bytes": memory.gpu_used_bytes if memory else None,
        "gpu_free_bytes": memory.gpu_free_bytes if memory else None,
        "slot": lease.seq_id,
        # Waiting for the conversation's turn and a slot; restoring a swapped cache is work.
        "queue_ms": max(0.0, timings.slot_ms - (lease.swap_in_ms or 0.0)),
        "swap_in": lease.swap_in,
        "swap_in_ms": lease.swap_in_ms,
        "swap_in_bytes": lease.swap_in_bytes,
        "reprefill_reason": lease.reprefill_reason,
        "batch_max": result.batch_max,
        "backend": lease.backend,
    }


def request_timings(result: GenerationResult, plan: ContextPlan, clock: TurnClock) -> Timings:
    """The engine's timings re-based on the request: TTFT and total count from it. The
    wait for the slot counts from the request to the lease, a build in line included."""
    requested, leased_at, built_at, stored_at, build_s = clock
    t = result.timings
    before_engine = (result.started_at - requested) * 1000 if result.started_at else 0.0
    return replace(
        t,
        ttft_ms=before_engine + t.ttft_ms if t.ttft_ms is not None else None,
        total_ms=before_engine + t.total_ms,
        slot_ms=(leased_at - requested) * 1000,
        build_ms=(built_at - leased_at if build_s is None else build_s) * 1000,
        store_ms=(stored_at - built_at) * 1000,
        summary_ms=plan.summary_ms if plan.evicted or plan.summary_changed else 0.0,
        engine_ttft_ms=t.ttft_ms,
    )


def _gauges(
    engine: Backend, conversation_id: str
) -> tuple[dict[str, int] | None, MemorySnapshot | None]:
    """The cache's cells per sequence (as the backend knows them without a round trip) and
    the memory figures for a turn record; None where the backend cannot tell: a reply is
    stored without them, never lost for them."""
    if engine.closed:
        return None, None
    try:
        cells = {str(seq): n for seq, n in engine.kv_usage(known=True).items()}
    except ChatctxError as exc:
        logger.warning("cache cells of %s not read: %s", conversation_id, exc)
        cells = None
    try:
        memory = engine.memory()
    except ChatctxError as exc:
        logger.warning("memory figures not read: %s", exc)
        memory = None
    return cells, memory


def store_turn(
    store: Store,
    engine: Backend,
    conversation_id: str,
    user: Message,
    result: GenerationResult,
    plan: ContextPlan,
    clock: TurnClock,
    lease: Lease,
    *,
    store_reply: bool = True,
    meaning: MeaningSearch | None = None,
    parsed: ParsedReply | None = None,
) -> Reply:
    """Store the reply and the turn's figures in one transaction. ``clock``: the turn's
    stamps (``TurnClock``). ``meaning`` (recall by meaning) embeds the two messages
    ahead of the searches that follow evictions. ``parsed``: the reply read for tool calls
    (stored as its content and calls, the record counting them); None, the text as it is.

    A failure logs the reply's text (nothing the client saw is lost without a trace) and
    raises ``StoreError`` (``ClosedError`` for a closed store) chained to the cause.
    """
    complete = result.stop_reason in ("eog", "length")
    timings = request_timings(result, plan, clock)
    cells, memory = _gauges(engine, conversation_id)
    figures = turn_figures(
        result,
        plan,
        timings,
        lease,
        model=engine.model_name,
        n_ctx=engine.n_ctx,
        cells=cells,
        memory=memory,
    )
    text = parsed.content if parsed is not None else result.text
    calls = [call.to_openai() for call in parsed.calls] if parsed is not None else []
    if parsed is not None:
        figures["tool_calls"] = len(calls)
        figures["tool_warning"] = parsed.warning
    figures["tool_result_tokens"] = plan.tool_result_tokens or None
    figures["tool_cleared_tokens"] = plan.tool_cleared_tokens or None
    message = None
    if store_reply and (text or calls or complete):
        message = {
            "role": "assistant",
            "content": text,
            "status": "complete" if complete else "partial",
            "tool_calls": calls or None,
        }
    try:
        if store.closed:
            raise ClosedError("store")
        assistant, turn = store.record_reply(
            conversation_id, message, user_message_id=user.id, **figures
        )
    except Exception as exc:
        logger.error(
            "reply of %s not stored (%s: %s); its text: %r",
            conversation_id,
            type(exc).__name__,
            exc,
            result.text,
        )
        if isinstance(exc, ChatctxError):
            raise
        raise StoreError(f"reply of {conversation_id} not stored: {exc}") from exc
    # Recall searches only once something was evicted: the messages are embedded (in the
    # background) from the turn the prompt reaches the level an eviction trims down to, a
    # few turns ahead of the first search. A chat that never gets there embeds nothing.
    if meaning is not None and (plan.window_start > 0 or plan.prompt_tokens >= plan.low_limit):
        meaning.warm_turn([user.content, *([assistant.content] if assistant else [])])
    reply = Reply(
        text=text,
        user_message_id=user.id,
        message_id=assistant.id if assistant else None,
        usage=result.usage,
        timings=timings,
        stop_reason=result.stop_reason,
        turn=turn,
        plan=plan,
        tool_calls=parsed.calls if parsed is not None else (),
        warning=parsed.warning if parsed is not None else None,
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
    return reply
