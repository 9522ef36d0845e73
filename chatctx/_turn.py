"""A turn in flight, and the figures its record carries.

A ``ChatSession`` registers every turn it starts, so that ``close()`` can end each one the
same way its own thread would: stop the generation, store what was generated (``partial``)
with its turn record, give the slot back. Whoever gets there first does it; the other finds
it done. This is what makes "a reply the client saw is a reply the store holds" hold when
the session is closed from another thread while a reply streams.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatctx.backend import GenerationResult, Lease, MemorySnapshot, Stream, Timings
    from chatctx.context import ContextPlan
    from chatctx.session import Reply
    from chatctx.store import Message


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
    clock: tuple[float, float, float, float] | None = None
    replies: list[Reply] | None = None
    finished: bool = False  # its reply is stored (or there was none to store)
    released: bool = False  # its slot is given back
    yielded: bool = False  # text reached the reader: a failed backend can't be retried
    failovers: int = 0  # times the turn moved to another backend before its first token
    settings: dict[str, Any] | None = None  # conversation settings stored with the user message
    # Set when the turn's reader has left (``astream`` ended early): the turn stops where it
    # is, and one that has not stored its user message yet stores nothing.
    cut: threading.Event | None = None
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
        "swap_in": lease.swap_in,
        "swap_in_ms": lease.swap_in_ms,
        "swap_in_bytes": lease.swap_in_bytes,
        "reprefill_reason": lease.reprefill_reason,
        "batch_max": result.batch_max,
        "backend": lease.backend,
    }
