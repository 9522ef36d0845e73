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
        # llama.cpp only appends at pos_max + 1: park the kept runs on the spare sequence,
        # moved to their places; the scheduler evaluates the new tokens in front of each run
        # in chunks, then the run comes back behind them (Insert.restore).
        assert spare is not None
        ctx.seq_rm(spare, 0, -1)
        for start, end, _ in moves:
            ctx.seq_cp(seq_id, spare, start, end)
        ctx.seq_rm(seq_id, plan.prefix, -1)
        _shift(ctx, spare, moves)
        del mirror[plan.prefix :]
        insert = Insert(
            ctx=ctx,
            mirror=mirror,
            seq_id=seq_id,
            spare=spare,
            prompt=prompt,
            gaps=plan.gaps(),
            runs=[(start + delta, end + delta) for start, end, delta in moves],
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
    """New tokens to evaluate in front of kept runs parked on the spare sequence: a changed
    summary in front of the kept turns, a cleared tool result's stub between them.

    The runs lie on the spare at their prompt places (``runs``: start, end); ``gaps`` are the
    prompt spans evaluated in front of each (empty where a run follows the one before). The
    scheduler decodes ``tokens`` at ``start...`` in chunks on ``seq_id`` (extending ``mirror``
    as it goes), then calls ``restore()``: the run comes back behind them, and the next gap
    is up (``done`` once every run is back and the spare is free). ``abort()`` (a cancelled
    or failed turn) drops the runs not yet back: the sequence keeps what it has.
    """

    ctx: NativeContext
    mirror: list[int]
    seq_id: int
    spare: int
    prompt: list[int]
    gaps: list[tuple[int, int]]
    runs: list[tuple[int, int]]
    step: int = 0  # the next run to come back
    done: bool = False

    def __post_init__(self) -> None:
        self._ready()

    @property
    def start(self) -> int:
        return self.gaps[self.step][0]

    @property
    def tokens(self) -> list[int]:
        """The gap to evaluate now (in front of run ``step``)."""
        if self.done:
            return []
        start, end = self.gaps[self.step]
        return self.prompt[start:end]

    @property
    def resume(self) -> int:
        """Where the prompt goes on after the last run."""
        return self.runs[-1][1]

    @property
    def unrestored(self) -> int:
        """Tokens of the runs that have not come back (dropped by an abort)."""
        return sum(end - start for start, end in self.runs[self.step :])

    def restore(self) -> None:
        """The gap in front of run ``step`` is evaluated: the run comes back behind it, and
        the runs right after it too."""
        self._back()
        self._ready()

    def _back(self) -> None:
        start, end = self.runs[self.step]
        self.ctx.seq_cp(self.spare, self.seq_id, start, end)
        self.mirror.extend(self.prompt[start:end])
        self.step += 1

    def _ready(self) -> None:
        while self.step < len(self.runs) and self.gaps[self.step][0] == self.gaps[self.step][1]:
            self._back()
        if self.step == len(self.runs):
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
