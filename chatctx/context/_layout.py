"""Where the running summary sits in a prompt: one section up front, or appended in blocks.

``summary-first`` sends the summary as one system message right after the system prompt. An
eviction changes it, so every kept turn behind it follows changed text: the in-process engine
evaluates the new text and moves the kept turns behind it (``engine._kv``), but a cache that
only matches runs in order (llama-server's ``n_cache_reuse``: after the common prefix it
looks for each next prompt token in the cache, so it can step over a deleted span, never over
an inserted one) evaluates every kept turn again.

``append`` sends each addition to the summary as a block of its own, where it was written:
right before the user message of the turn that wrote it, after the turns kept then. Later
evictions delete turns in front of it and it moves forward with them, so from one prompt to
the next the text only ever loses whole spans (evicted turns, last turn's recall section) and
grows at its end: what such a cache reuses in full. A summary that keeps some of its lines
as they were, drops the others and adds text at its end (the extractive summarizer's
compaction) keeps its blocks where they were, less the dropped lines, plus a block for the
new text: again only deletions and an addition at the end. A summary rewritten otherwise
(the LLM summarizer) becomes one block at the end; so does one that would exceed
``MAX_BLOCKS`` blocks, which bounds the headers' cost. A block whose lines are all dropped
goes, except the first, which stays empty, so that the blocks behind it keep their
``SUMMARY_MORE`` header: a changed header would be new text in front of cached turns.

A block is ``(start, after)``: it begins at character ``start`` of the summary text and is
sent before the first message whose position is above ``after``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_BLOCKS", "SUMMARY_HEADER", "SUMMARY_MORE", "Block", "next_blocks", "render"]

SUMMARY_HEADER = "Summary of the earlier conversation (older turns are not shown):\n"
SUMMARY_MORE = "Summary of the earlier conversation, continued:\n"
MAX_BLOCKS = 8  # then the summary is sent again as one block (one re-evaluation)
MIN_RUN_CHARS = 80  # kept lines between two dropped ones: about 16 tokens of English at least

Block = tuple[int, int]  # (first character in the summary text, position it follows)
_FRONT: tuple[Block, ...] = ((0, -1),)


def render(summary: str | None, blocks: Sequence[Block], layout: str) -> list[tuple[int, str]]:
    """``(after, content)`` of each summary message to send, in order."""
    if not summary:
        return []
    if layout != "append":
        return [(-1, SUMMARY_HEADER + summary)]
    spans = tuple(blocks) or _FRONT
    out: list[tuple[int, str]] = []
    for i, (start, after) in enumerate(spans):
        end = spans[i + 1][0] if i + 1 < len(spans) else len(summary)
        text = summary[start:end].strip()
        if text:
            out.append((after, (SUMMARY_HEADER if i == 0 else SUMMARY_MORE) + text))
    return out


def next_blocks(
    previous: str | None, blocks: Sequence[Block], summary: str | None, after: int
) -> tuple[Block, ...]:
    """The blocks of ``summary`` written after message position ``after`` over ``previous``.

    An extension of the previous summary adds one block for the new text; so does a summary
    that keeps some of the previous lines as they were and in order, dropped lines aside
    (``_kept_lines``): each block keeps its surviving lines. Anything else (a rewrite, or
    one block too many) starts over with one block there.
    """
    if not summary:
        return ()
    spans = tuple(blocks) or _FRONT
    if previous and summary != previous and summary.startswith(previous):
        if len(spans) < MAX_BLOCKS:
            return (*spans, (len(previous), after))
        return ((0, after),)
    kept = _kept_lines(previous, summary) if previous else None
    if not kept:
        return ((0, after),)
    old_starts = _line_starts(previous or "")
    new_starts = _line_starts(summary)
    old_lines = (previous or "").split("\n")
    out: list[Block] = []
    for i, (start, block_after) in enumerate(spans):
        end = spans[i + 1][0] if i + 1 < len(spans) else len(previous or "")
        mine = [o for o, at in enumerate(old_starts) if start <= at < end and old_lines[o]]
        survivors = [(o, n) for o, n in kept if start <= old_starts[o] < end]
        if survivors and len(survivors) < len(mine) and not _long_runs(survivors, old_lines):
            return ((0, after),)
        if survivors:
            out.append((0 if i == 0 else new_starts[survivors[0][1]], block_after))
        elif i == 0:
            out.append((0, block_after))  # stays, empty: the next keeps SUMMARY_MORE
    added = len(kept)
    if added < len(new_starts):  # new lines at the end: a block of their own
        out.append((new_starts[added], after))
    if len(out) > MAX_BLOCKS:
        return ((0, after),)
    return tuple(out)


def _long_runs(survivors: Sequence[tuple[int, int]], lines: Sequence[str]) -> bool:
    """Whether each run of consecutive lines a block keeps, where it loses others, is long
    enough to be found again: llama-server takes a cached run only from ``n_cache_reuse``
    (16) tokens up, and a shorter one between two deletions stops its walk there."""
    runs: list[list[int]] = []
    for o, _ in survivors:
        if runs and runs[-1][-1] == o - 1:
            runs[-1].append(o)
        else:
            runs.append([o])
    return all(sum(len(lines[o]) + 1 for o in run) >= MIN_RUN_CHARS for run in runs)


def _line_starts(text: str) -> list[int]:
    starts, at = [], 0
    for line in text.split("\n"):
        starts.append(at)
        at += len(line) + 1
    return starts


def _kept_lines(previous: str, summary: str) -> list[tuple[int, int]] | None:
    """``(old line, new line)`` of each line ``summary`` keeps from ``previous``, when it
    begins with some of the previous lines, as they were and in order, and then only adds
    lines; None otherwise, or when it keeps none."""
    old, new = previous.split("\n"), summary.split("\n")
    kept: list[tuple[int, int]] = []
    o = 0
    for n, line in enumerate(new):
        try:
            o = old.index(line, o)
        except ValueError:
            break
        kept.append((o, n))
        o += 1
    return kept or None
