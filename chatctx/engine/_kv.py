"""Planning KV-cache reuse: what stays, what is removed, what is shifted, what is evaluated.

Between evictions a prompt extends the cached tokens and only its tail is evaluated. After
the builder evicts whole turns, the prompt is ``[kept prefix][inserted?][kept turns][new]``
while the cache holds ``[kept prefix][evicted turns][kept turns][old tail]``. Instead of
re-evaluating everything after the kept prefix, the evicted span is removed and the kept turns
are shifted to their new positions in place (``llama_memory_seq_rm`` + ``llama_memory_seq_add``);
only inserted tokens (a changed summary) and the new tail are evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_CHUNK = 16  # smaller reusable spans are not worth a shift


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """How to turn the cached tokens into the prompt.

    ``prefix``: tokens kept in place. ``chunk``: (start, end) of cached tokens moved so they
    start at ``dest`` in the prompt (None: nothing is moved). Prompt tokens
    ``[prefix, dest)`` are evaluated before the chunk, ``[resume, len)`` after it.
    """

    prefix: int
    chunk: tuple[int, int] | None = None
    dest: int = 0

    @property
    def chunk_len(self) -> int:
        return 0 if self.chunk is None else self.chunk[1] - self.chunk[0]

    @property
    def inserted(self) -> int:
        return 0 if self.chunk is None else self.dest - self.prefix

    @property
    def resume(self) -> int:
        return self.prefix if self.chunk is None else self.dest + self.chunk_len

    @property
    def delta(self) -> int:
        return 0 if self.chunk is None else self.dest - self.chunk[0]


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
    best = ReusePlan(prefix=prefix)
    for dest in starts:
        if dest + min_chunk > limit:
            continue
        start = prefix + 1 if dest == prefix else prefix
        at, length = _best_match(cached, prompt, dest, start, limit, min_chunk)
        if at >= 0 and length > best.chunk_len:
            best = ReusePlan(prefix=prefix, chunk=(at, at + length), dest=dest)
    return best


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
