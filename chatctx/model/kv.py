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

New text can also stand between kept runs: an old tool result cleared to a stub in the middle
of the kept history leaves ``[kept prefix][stub][kept turns]`` against
``[kept prefix][result][kept turns]``. A run found after such a gap (at least ``GAP_RUN``
tokens: a gap costs a decode step of its own) is moved behind it; the gap is evaluated in
its place (``ReusePlan.dests``).
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
GAP_RUN = 64  # the shortest run worth moving behind new text evaluated in front of it
MAX_RUNS = 16  # most runs one plan moves (each gap is a decode step of its own)


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
    after them. ``dests``, when set, puts each run at its own prompt position instead: the
    prompt tokens between one run's end and the next one's place are new, evaluated there.
    """

    prefix: int
    chunks: tuple[tuple[int, int], ...] = ()
    dest: int = 0
    dests: tuple[int, ...] = ()

    @property
    def chunk_len(self) -> int:
        """Tokens moved, all runs together."""
        return sum(end - start for start, end in self.chunks)

    def places(self) -> list[int]:
        """Where each run goes in the prompt."""
        if self.dests:
            return list(self.dests)
        out, at = [], self.dest
        for start, end in self.chunks:
            out.append(at)
            at += end - start
        return out

    @property
    def inserted(self) -> int:
        """New tokens evaluated in front of moved runs (before the first, between them)."""
        return self.resume - self.prefix - self.chunk_len if self.chunks else 0

    @property
    def resume(self) -> int:
        if not self.chunks:
            return self.prefix
        start, end = self.chunks[-1]
        return self.places()[-1] + end - start

    def gaps(self) -> list[tuple[int, int]]:
        """The prompt span of new tokens evaluated in front of each run (often empty)."""
        out, at = [], self.prefix
        for (start, end), place in zip(self.chunks, self.places(), strict=True):
            out.append((at, place))
            at = place + end - start
        return out

    def moves(self) -> list[tuple[int, int, int]]:
        """(start, end, delta) of each run: its cached positions and how far it moves."""
        return [
            (start, end, place - start)
            for (start, end), place in zip(self.chunks, self.places(), strict=True)
        ]


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
    index = _Anchors(cached, min_chunk)
    if at < 0:  # new text right after the prefix: the first run may follow it
        found = index.next_run(prompt, prefix + 1, prefix, limit)
        if found is None:
            return ReusePlan(prefix=prefix)
        dest, at, length = found
    chunks, places = [(at, at + length)], [dest]
    # Runs further on in the cache that continue the prompt where the last one stops, or
    # after new text in the prompt (a gap, evaluated in its place).
    here = dest + length
    while here + min_chunk <= limit and len(chunks) < MAX_RUNS:
        at, length = _best_match(cached, prompt, here, chunks[-1][1], limit, min_chunk)
        if at >= 0:
            place = here
        else:
            found = index.next_run(prompt, here + 1, chunks[-1][1], limit)
            if found is None:
                break
            place, at, length = found
        chunks.append((at, at + length))
        places.append(place)
        here = place + length
    gapped = any(a + (e - s) != b for (s, e), a, b in zip(chunks, places, places[1:], strict=False))
    return ReusePlan(
        prefix=prefix,
        chunks=tuple(chunks),
        dest=places[0],
        dests=tuple(places) if gapped else (),
    )


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


class _Anchors:
    """The cache's positions by the two tokens starting there (built on first use, from
    ``after`` on): where a run after a gap in the prompt may begin."""

    WORK = 200_000  # token comparisons one search may make (repetitive text stays cheap)

    def __init__(self, cached: Sequence[int], min_chunk: int) -> None:
        self.cached = cached
        self.min_chunk = max(2, min_chunk)
        self._index: dict[int, list[int]] | None = None
        self._from = 0

    def next_run(
        self, prompt: Sequence[int], start: int, after: int, limit: int
    ) -> tuple[int, int, int] | None:
        """The first prompt position from ``start`` on where a cached run of at least
        ``GAP_RUN`` tokens, starting at or after cache position ``after``, continues the
        prompt: (prompt position, cache position, length); None if there is none."""
        cached = self.cached
        if limit - start < GAP_RUN or len(cached) - after < GAP_RUN:
            return None
        if self._index is None or after < self._from:
            self._from = after
            self._index = {}
            for at in range(after, len(cached) - 1):
                self._index.setdefault(cached[at] * _KEY + cached[at + 1], []).append(at)
        work = 0
        for p in range(start, limit - GAP_RUN + 1):
            for at in self._index.get(prompt[p] * _KEY + prompt[p + 1], ()):
                if at < after:
                    continue
                n = 2
                while at + n < len(cached) and p + n < limit and cached[at + n] == prompt[p + n]:
                    n += 1
                work += n
                if n >= GAP_RUN:
                    return p, at, n
            if work > self.WORK:
                return None
        return None


_KEY = 1 << 32  # token ids are below it: two of them make one int key
