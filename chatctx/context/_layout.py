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
grows at its end: what such a cache reuses in full. A summary that is rewritten rather than
extended (a compaction, the LLM summarizer) becomes one block at the end; so does one that
would exceed ``MAX_BLOCKS`` blocks, which bounds the headers' cost.

A block is ``(start, after)``: it begins at character ``start`` of the summary text and is
sent before the first message whose position is above ``after``.
"""

from __future__ import annotations

from collections.abc import Sequence

SUMMARY_HEADER = "Summary of the earlier conversation (older turns are not shown):\n"
SUMMARY_MORE = "Summary of the earlier conversation, continued:\n"
MAX_BLOCKS = 8  # then the summary is sent again as one block (one re-evaluation)

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
            out.append((after, (SUMMARY_HEADER if not out else SUMMARY_MORE) + text))
    return out


def next_blocks(
    previous: str | None, blocks: Sequence[Block], summary: str | None, after: int
) -> tuple[Block, ...]:
    """The blocks of ``summary`` written after message position ``after`` over ``previous``.

    An extension of the previous summary adds one block for the new text; anything else
    (a rewrite, or one block too many) starts over with one block there.
    """
    if not summary:
        return ()
    if previous and summary != previous and summary.startswith(previous):
        spans = tuple(blocks) or _FRONT
        if len(spans) < MAX_BLOCKS:
            return (*spans, (len(previous), after))
    return ((0, after),)
