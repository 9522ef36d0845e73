"""Executing a KV reuse plan on one sequence: remove, shift, park, evaluate.

``plan_reuse`` (``_kv``) decides what stays; this applies it to llama.cpp's cache and keeps
the engine's mirror of the sequence exact.
"""

from __future__ import annotations

import logging

from chatctx.engine._kv import KVReport, plan_reuse
from chatctx.engine._native import NativeContext

logger = logging.getLogger("chatctx.engine")


def prepare(
    ctx: NativeContext,
    mirror: list[int],
    seq_id: int,
    prompt: list[int],
    *,
    eviction: str,
    history_start: int | None,
    spare: int | None,
    spare_free: bool,
    unified: bool,
) -> tuple[KVReport, int]:
    """Bring the KV cache of ``seq_id`` (mirrored by ``mirror``) to a prefix of ``prompt``.

    Removes, shifts and parks what the plan says; returns (report, resume): the caller
    evaluates ``prompt[resume:]`` (never empty: the last token's logits pick the reply's first
    token) at positions ``resume...``, in one batch or in chunks. ``spare`` is the sequence used
    to park kept turns while inserted tokens (a changed summary) are evaluated in front of
    them; that needs a unified cache and a free spare, else the turns are re-evaluated.
    """
    plan = plan_reuse(mirror, prompt, history_start=history_start)
    fallback = None
    if plan.chunk is not None:
        if eviction == "recompute":
            fallback = "eviction policy is recompute"
        elif not ctx.can_shift():
            fallback = "this model's KV cache cannot shift positions"
        elif plan.inserted and (spare in (None, seq_id) or not unified):
            fallback = "new tokens precede the kept turns and no spare unified sequence"
        elif plan.inserted and not spare_free:
            fallback = "new tokens precede the kept turns and the spare sequence is busy"
    if plan.chunk is None or fallback is not None:
        reused = plan.prefix
        evicted = len(mirror) - reused
        ctx.seq_rm(seq_id, reused, -1)
        del mirror[reused:]
        report = KVReport(
            policy=eviction,
            reused_tokens=reused,
            evaluated_tokens=len(prompt) - reused,
            evicted_tokens=evicted,
            shifted_tokens=0,
            shift_count=0,
            fallback=fallback,
        )
        return report, reused
    start, end = plan.chunk
    evicted = len(mirror) - plan.prefix - plan.chunk_len
    ctx.seq_rm(seq_id, end, -1)  # the old tail (previous reply) goes first
    if plan.inserted == 0:
        ctx.seq_rm(seq_id, plan.prefix, start)
        ctx.seq_add(seq_id, start, end, plan.delta)
        mirror[:] = mirror[: plan.prefix] + mirror[start:end]
    else:
        # llama.cpp only appends at pos_max + 1: park the kept turns on the spare
        # sequence, evaluate the inserted tokens, then move the turns back behind them.
        assert spare is not None
        ctx.seq_rm(spare, 0, -1)
        ctx.seq_cp(seq_id, spare, start, end)
        ctx.seq_rm(seq_id, plan.prefix, -1)
        kept = mirror[start:end]
        del mirror[plan.prefix :]
        try:
            ctx.decode(seq_id, prompt[plan.prefix : plan.dest], plan.prefix, want_last_logits=False)
            mirror.extend(prompt[plan.prefix : plan.dest])
            ctx.seq_add(spare, start, end, plan.delta)
            ctx.seq_cp(spare, seq_id, plan.dest, plan.dest + plan.chunk_len)
            mirror.extend(kept)
        finally:
            ctx.seq_rm(spare, 0, -1)
    report = KVReport(
        policy=eviction,
        reused_tokens=plan.prefix + plan.chunk_len,
        evaluated_tokens=len(prompt) - plan.prefix - plan.chunk_len,
        evicted_tokens=evicted,
        shifted_tokens=plan.chunk_len if plan.delta else 0,
        shift_count=1 if plan.delta else 0,
    )
    logger.debug(
        "seq %d: kept %d, removed %d, shifted %d by %d, evaluated %d",
        seq_id,
        plan.prefix,
        evicted,
        plan.chunk_len,
        plan.delta,
        report.evaluated_tokens,
    )
    return report, plan.resume
