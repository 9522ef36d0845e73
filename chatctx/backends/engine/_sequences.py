"""Executing a KV reuse plan on one sequence: remove, shift, park, evaluate.

``plan_reuse`` (``_kv``) decides what stays; this applies it to llama.cpp's cache and keeps
the engine's mirror of the sequence exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from chatctx.backends.engine._native import NativeContext
from chatctx.model.kv import KVReport, plan_reuse

logger = logging.getLogger("chatctx.backends.engine")


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
) -> tuple[KVReport, int, Insert | None]:
    """Bring the KV cache of ``seq_id`` (mirrored by ``mirror``) to a prefix of ``prompt``.

    Removes, shifts and parks what the plan says; returns (report, resume, insert): the
    caller evaluates ``insert.tokens`` first when there is an insert (then
    ``insert.finish()``), then ``prompt[resume:]`` (never empty: the last token's logits pick
    the reply's first token) at positions ``resume...``, in chunks. ``spare`` is the sequence used
    to park kept turns while inserted tokens (a changed summary) are evaluated in front of
    them; that needs a unified cache and a free spare, else the turns are re-evaluated.
    """
    plan = plan_reuse(mirror, prompt, history_start=history_start)
    fallback = None
    if plan.chunks:
        if eviction == "recompute":
            fallback = "eviction policy is recompute"
        elif not ctx.can_shift():
            fallback = "this model's KV cache cannot shift positions"
        elif plan.inserted and (spare in (None, seq_id) or not unified):
            fallback = "new tokens precede the kept turns and no spare unified sequence"
        elif plan.inserted and not spare_free:
            fallback = "new tokens precede the kept turns and the spare sequence is busy"
    if not plan.chunks or fallback is not None:
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
        return report, reused, None
    insert: Insert | None = None
    moves = plan.moves()
    kept = [t for start, end, _ in moves for t in mirror[start:end]]
    evicted = len(mirror) - plan.prefix - plan.chunk_len
    ctx.seq_rm(seq_id, moves[-1][1], -1)  # the old tail (previous reply) goes first
    if plan.inserted == 0:
        for gap_start, gap_end in _gaps(plan.prefix, moves):
            ctx.seq_rm(seq_id, gap_start, gap_end)
        _shift(ctx, seq_id, moves)
        mirror[:] = mirror[: plan.prefix] + kept
    else:
        # llama.cpp only appends at pos_max + 1: park the kept turns on the spare
        # sequence; the scheduler evaluates the inserted tokens in chunks, then the turns
        # move back behind them (Insert.finish).
        assert spare is not None
        ctx.seq_rm(spare, 0, -1)
        for start, end, _ in moves:
            ctx.seq_cp(seq_id, spare, start, end)
        ctx.seq_rm(seq_id, plan.prefix, -1)
        del mirror[plan.prefix :]
        insert = Insert(
            ctx=ctx,
            mirror=mirror,
            seq_id=seq_id,
            spare=spare,
            start=plan.prefix,
            tokens=prompt[plan.prefix : plan.dest],
            moves=moves,
            kept=kept,
            dest=plan.dest,
            resume=plan.resume,
        )
    shifted = [(end - start, delta) for start, end, delta in moves if delta]
    report = KVReport(
        policy=eviction,
        reused_tokens=plan.prefix + plan.chunk_len,
        evaluated_tokens=len(prompt) - plan.prefix - plan.chunk_len,
        evicted_tokens=evicted,
        shifted_tokens=sum(n for n, _ in shifted),
        shift_count=len(shifted),
    )
    logger.debug(
        "seq %d: kept %d, removed %d, shifted (tokens, by) %s, evaluated %d",
        seq_id,
        plan.prefix,
        evicted,
        shifted,
        report.evaluated_tokens,
    )
    return report, plan.resume, insert


@dataclass(eq=False)
class Insert:
    """New tokens (a changed summary) to evaluate in front of kept turns parked on the spare.

    The scheduler decodes ``tokens`` at ``start...`` in chunks on ``seq_id`` (extending
    ``mirror`` as it goes), then calls ``finish()``: the parked turns move to their place
    behind them and come back. ``abort()`` (a cancelled or failed turn) drops them: the
    sequence keeps what was evaluated so far and the next turn evaluates the rest.
    """

    ctx: NativeContext
    mirror: list[int]
    seq_id: int
    spare: int
    start: int
    tokens: list[int]
    moves: list[tuple[int, int, int]]
    kept: list[int]
    dest: int
    resume: int
    done: bool = False

    def finish(self) -> None:
        try:
            _shift(self.ctx, self.spare, self.moves)
            self.ctx.seq_cp(self.spare, self.seq_id, self.dest, self.resume)
            self.mirror.extend(self.kept)
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.done:
            self.done = True
            if not self.ctx.closed:
                self.ctx.seq_rm(self.spare, 0, -1)


def _gaps(prefix: int, moves: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The cached spans between the kept prefix and the runs moved, and between the runs."""
    out = []
    at = prefix
    for start, end, _ in moves:
        if start > at:
            out.append((at, start))
        at = end
    return out


def _shift(ctx: NativeContext, seq_id: int, moves: list[tuple[int, int, int]]) -> None:
    """Move each run by its delta (the spans between them are already removed).

    ``seq_add`` moves whatever cells lie in a position range, so no run may land on one not
    yet moved: runs going right move last first, then runs going left first first. The runs
    keep their order, so neither kind can reach one that has still to move.
    """
    right = [m for m in moves if m[2] > 0]
    left = [m for m in moves if m[2] < 0]
    for start, end, delta in [*reversed(right), *left]:
        ctx.seq_add(seq_id, start, end, delta)
