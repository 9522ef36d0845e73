"""Planning KV-cache reuse: what stays, what is removed, what is shifted, what is evaluated.

Between evictions a prompt extends the cached tokens and only its tail is evaluated. After
the builder evicts whole turns, the prompt is ``[kept prefix][inserted?][kept turns][new]``
while the cache holds ``[kept prefix][evicted turns][kept turns][old tail]``. Instead of
re-evaluating everything after the kept prefix, the evicted span is removed and the kept turns
are shifted to their new positions in place (``llama_memory_seq_rm`` + ``llama_memory_seq_add``);
only inserted tokens (a changed summary) and the new tail are evaluated.

The kept text can have more than one hole: a recall section sent before the last message is
gone from the next prompt, so an eviction right after it leaves the cache as
``[kept prefix][evicted turns][kept turns][recall][last message and reply][old tail]``.
Each further run of kept tokens that follows in the prompt is moved too, so only the new tail
is evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MIN_CHUNK",
    "SERVER_MIN_CHUNK",
    "KVReport",
    "ReusePlan",
    "common_prefix",
    "plan_in_order",
    "plan_reuse",
]

MIN_CHUNK = 16  # smaller reusable spans are not worth a shift
# llama-server's walk with chatctx's n_cache_reuse: the abridge layout keeps runs as short as
# a message's header and a clause, which the walk must find (bench/README.md, the abridge
# layout).
SERVER_MIN_CHUNK = 4


@dataclass(frozen=True, slots=True)
class KVReport:
    """What one prefill did to the KV cache of its sequence."""

    policy: str  # shift | recompute
    reused_tokens: int  # kept in place or shifted: not evaluated
    evaluated_tokens: int
    evicted_tokens: int  # removed from the cache (evicted turns and the old tail)
    shifted_tokens: int
    shift_count: int
    fallback: str | None = None  # why a possible shift was not done


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """How to turn the cached tokens into the prompt.

    ``prefix``: tokens kept in place. ``chunks``: (start, end) of the cached runs moved, in
    order, so that they lie back to back in the prompt from ``dest`` on (none: nothing is
    moved). Prompt tokens ``[prefix, dest)`` are evaluated before them, ``[resume, len)``
    after them.
    """

    prefix: int
    chunks: tuple[tuple[int, int], ...] = ()
    dest: int = 0

    @property
    def chunk_len(self) -> int:
        """Tokens moved, all runs together."""
        return sum(end - start for start, end in self.chunks)

    @property
    def inserted(self) -> int:
        return self.dest - self.prefix if self.chunks else 0

    @property
    def resume(self) -> int:
        return self.dest + self.chunk_len if self.chunks else self.prefix

    def moves(self) -> list[tuple[int, int, int]]:
        """(start, end, delta) of each run: its cached positions and how far it moves."""
        out = []
        at = self.dest
        for start, end in self.chunks:
            out.append((start, end, at - start))
            at += end - start
        return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _best_match(
    cached: Sequence[int], prompt: Sequence[int], dest: int, start: int, limit: int, min_chunk: int
) -> tuple[int, int]:
    """The cached run at or after ``start`` matching ``prompt[dest:]`` longest: (at, length).

    Repeated text can occur several times in a cache; the longest run wins, then the latest.
    """
    anchor = list(prompt[dest : dest + min_chunk])
    best_at, best_len = -1, 0
    for at in range(start, len(cached) - min_chunk + 1):
        if cached[at] != anchor[0] or list(cached[at : at + min_chunk]) != anchor:
            continue
        length = min_chunk
        while (
            at + length < len(cached)
            and dest + length < limit
            and cached[at + length] == prompt[dest + length]
        ):
            length += 1
        if length >= best_len:
            best_at, best_len = at, length
    return best_at, best_len


def plan_reuse(
    cached: Sequence[int],
    prompt: Sequence[int],
    *,
    history_start: int | None = None,
    min_chunk: int = MIN_CHUNK,
) -> ReusePlan:
    """The cheapest way to bring ``cached`` to ``prompt``.

    ``history_start`` is where the kept turns begin in the prompt (after the system prompt,
    pinned messages and summary); without it only pure deletions are found. The prompt's last
    token is always evaluated, since its logits pick the first reply token.
    """
    limit = len(prompt) - 1
    prefix = min(common_prefix(cached, prompt), limit)
    if prefix >= len(cached) or prefix >= limit:
        return ReusePlan(prefix=prefix)
    starts = [prefix]
    if history_start is not None and prefix < history_start < limit:
        starts.append(history_start)
    best = (-1, 0, prefix, prefix)  # the first run (at, length, dest), the prefix kept
    for dest in starts:
        if dest + min_chunk > limit:
            continue
        # A run moved to right after the prefix starts past it (else it would extend the
        # prefix). One moved behind new tokens may start inside it: turns right after the
        # system prompt share their first token with a summary put in front of them, and the
        # prefix gives that token back.
        start = prefix + 1 if dest == prefix else 0
        at, length = _best_match(cached, prompt, dest, start, limit, min_chunk)
        kept = min(prefix, at)
        if at >= 0 and kept + length > best[3] + best[1]:
            best = (at, length, dest, kept)
    at, length, dest, prefix = best
    if at < 0:
        return ReusePlan(prefix=prefix)
    chunks = [(at, at + length)]
    # Runs further on in the cache that continue the prompt where the last one stops.
    here = dest + length
    while here + min_chunk <= limit:
        at, length = _best_match(cached, prompt, here, chunks[-1][1], limit, min_chunk)
        if at < 0:
            break
        chunks.append((at, at + length))
        here += length
    return ReusePlan(prefix=prefix, chunks=tuple(chunks), dest=dest)


def plan_in_order(cached: Sequence[int], prompt: Sequence[int], *, min_chunk: int) -> ReusePlan:
    """What a cache that moves runs only in order keeps: llama-server's ``n_cache_reuse``.

    After the common prefix the server walks the cache forward; where at least ``min_chunk``
    tokens continue the prompt at its current place it shifts them there and goes on after
    them, else it steps one cached token on. A deleted span is stepped over; text inserted
    in the prompt is never found, so nothing after it is kept. ``min_chunk`` 0: the common
    prefix only. As the server, it always evaluates the prompt's last token.
    """
    limit = len(prompt) - 1
    prefix = common_prefix(cached, prompt)
    chunks: list[tuple[int, int]] = []
    if min_chunk > 0:
        head_c = head_p = prefix
        while head_c < len(cached) and head_p < len(prompt):
            n = 0
            while (
                head_c + n < len(cached)
                and head_p + n < len(prompt)
                and cached[head_c + n] == prompt[head_p + n]
            ):
                n += 1
            if n >= min_chunk:
                chunks.append((head_c, head_c + n))
                head_c += n
                head_p += n
            else:
                head_c += 1
    # The last prompt token is evaluated again: trim what was kept to end before it.
    prefix = min(prefix, limit)
    kept: list[tuple[int, int]] = []
    room = limit - prefix
    for start, end in chunks:
        take = min(end - start, room)
        if take <= 0:
            break
        kept.append((start, start + take))
        room -= take
    return ReusePlan(prefix=prefix, chunks=tuple(kept), dest=prefix)
