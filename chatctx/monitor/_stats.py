"""Aggregates over per-turn records: prefill amplification, cache hit ratio, TTFT, swap-ins."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from chatctx.store import Turn


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class Totals:
    turns: int
    prompt_tokens: int
    new_tokens: int
    reused_tokens: int
    evaluated_tokens: int
    generated_tokens: int
    evicted_tokens: int
    shifted_tokens: int
    shift_count: int
    evictions: int
    summary_ms: float
    prefill_amplification: float | None  # evaluated / new tokens; 1.0 is the floor
    cache_hit_ratio: float | None  # reused / prompt tokens
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    decode_tokens_per_s: float | None
    queue_p50_ms: float | None = None  # waiting in line for a slot (turns that recorded it)
    queue_p95_ms: float | None = None
    tool_calls: int = 0  # calls the replies made (an agent's turns)
    tool_results_cleared: int = 0  # old tool results cleared to stubs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def totals(turns: Sequence[Turn]) -> Totals:
    """Sum and summarize a conversation's (or any set of) turns."""
    prompt = sum(t.prompt_tokens for t in turns)
    new = sum(t.new_tokens or 0 for t in turns)
    reused = sum(t.reused_tokens for t in turns)
    evaluated = sum(t.evaluated_tokens for t in turns)
    ttfts = [t.ttft_ms for t in turns if t.ttft_ms is not None]
    rates = [t.decode_tokens_per_s for t in turns if t.decode_tokens_per_s]
    queued = [t.queue_ms for t in turns if t.queue_ms is not None]
    return Totals(
        turns=len(turns),
        prompt_tokens=prompt,
        new_tokens=new,
        reused_tokens=reused,
        evaluated_tokens=evaluated,
        generated_tokens=sum(t.generated_tokens for t in turns),
        evicted_tokens=sum(t.evicted_tokens or 0 for t in turns),
        shifted_tokens=sum(t.shifted_tokens or 0 for t in turns),
        shift_count=sum(t.shift_count or 0 for t in turns),
        evictions=sum(1 for t in turns if t.plan and t.plan.get("evicted")),
        summary_ms=sum(t.summary_ms or 0.0 for t in turns),
        prefill_amplification=evaluated / new if new else None,
        cache_hit_ratio=reused / prompt if prompt else None,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p95_ms=percentile(ttfts, 95),
        decode_tokens_per_s=sum(rates) / len(rates) if rates else None,
        queue_p50_ms=percentile(queued, 50),
        queue_p95_ms=percentile(queued, 95),
        tool_calls=sum(t.tool_calls or 0 for t in turns),
        tool_results_cleared=sum(len(t.plan.get("cleared_ids") or ()) for t in turns if t.plan),
    )


@dataclass(frozen=True, slots=True)
class SwapTotals:
    """How turns found their KV state in the slot pool: restored from a swap or prefilled."""

    turns: int
    swap_in_ram: int  # turns whose KV state came back from RAM
    swap_in_disk: int  # ... and from disk
    swap_in_bytes: int
    swap_in_ms_mean: float | None  # over the swap-in turns that timed it
    reprefills: int  # turns that refused a swapped state and prefilled again
    reprefill_reasons: dict[str, int]  # reason -> turns, most frequent first
    batch_max: int | None  # most sequences decoded together in one step, over all turns

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def swap_totals(turns: Sequence[Turn]) -> SwapTotals:
    """Count the turns that started from a swap-in (RAM, disk) or from a re-prefill."""
    swapped = [t for t in turns if t.swap_in is not None]
    timed = [t.swap_in_ms for t in swapped if t.swap_in_ms is not None]
    reasons = Counter(t.reprefill_reason for t in turns if t.reprefill_reason is not None)
    widths = [t.batch_max for t in turns if t.batch_max is not None]
    return SwapTotals(
        turns=len(turns),
        swap_in_ram=sum(t.swap_in == "ram" for t in swapped),
        swap_in_disk=sum(t.swap_in == "disk" for t in swapped),
        swap_in_bytes=sum(t.swap_in_bytes or 0 for t in swapped),
        swap_in_ms_mean=sum(timed) / len(timed) if timed else None,
        reprefills=sum(reasons.values()),
        reprefill_reasons=dict(sorted(reasons.items(), key=lambda item: (-item[1], item[0]))),
        batch_max=max(widths) if widths else None,
    )


@dataclass(frozen=True, slots=True)
class BackendTotals:
    """One backend's share, where a router spreads conversations over several."""

    backend: str
    conversations: int  # placed there now
    turns: int
    prompt_tokens: int
    reused_tokens: int
    evaluated_tokens: int
    cache_hit_ratio: float | None  # reused / prompt tokens of its turns
    failovers: int  # turns that prefilled again because their backend had failed
    swap_ins: int  # turns whose slot came back from a swap (a server's --slot-save-path)
    reprefills: int  # turns that prefilled again, for whatever reason
    reprefill_reasons: dict[str, int]  # reason (its first words) -> turns
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    slots_busy: int | None = None  # leased now (a live router's figure)
    state: str | None = None  # up | down | draining (a live router's figure)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _reason_kind(reason: str) -> str:
    """A re-prefill reason without the names in it: "failover", "drained", "state refused"."""
    head = reason.split(":", 1)[0].strip()
    return head if head in ("failover", "drained") else reason.split("(", 1)[0].strip()


def backend_totals(
    turns: Sequence[Turn],
    placements: Mapping[str, int],
    live: Sequence[Mapping[str, Any]] = (),
) -> list[BackendTotals]:
    """Per backend: conversations placed (``placements``, from ``Store.placement_counts``),
    hit ratio, failovers, swap-ins and re-prefills by reason over its turns; ``live``
    (``Router.stats()``) adds slots busy and state. Turns with no backend are left out."""
    by_backend: dict[str, list[Turn]] = {}
    for turn in turns:
        if turn.backend is not None:
            by_backend.setdefault(turn.backend, []).append(turn)
    now = {row["backend"]: row for row in live}
    names = sorted(set(by_backend) | set(placements) | set(now))
    rows = []
    for name in names:
        mine = by_backend.get(name, [])
        prompt = sum(t.prompt_tokens for t in mine)
        reused = sum(t.reused_tokens for t in mine)
        reasons = Counter(_reason_kind(t.reprefill_reason) for t in mine if t.reprefill_reason)
        ttfts = [t.ttft_ms for t in mine if t.ttft_ms is not None]
        rows.append(
            BackendTotals(
                backend=name,
                conversations=int(placements.get(name, 0)),
                turns=len(mine),
                prompt_tokens=prompt,
                reused_tokens=reused,
                evaluated_tokens=sum(t.evaluated_tokens for t in mine),
                cache_hit_ratio=reused / prompt if prompt else None,
                failovers=reasons.get("failover", 0),
                swap_ins=sum(t.swap_in is not None for t in mine),
                reprefills=sum(reasons.values()),
                reprefill_reasons=dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
                ttft_p50_ms=percentile(ttfts, 50),
                ttft_p95_ms=percentile(ttfts, 95),
                slots_busy=now[name].get("slots_busy") if name in now else None,
                state=now[name].get("state") if name in now else None,
            )
        )
    return rows
