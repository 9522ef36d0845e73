"""Turns: a user message with the replies, tool calls and tool results that answer it."""

from __future__ import annotations

from collections.abc import Sequence

from chatctx.store import Message


def group_turns(messages: Sequence[Message]) -> list[list[Message]]:
    """Split messages into turns; each starts at a user message.

    Messages before the first user message (a greeting, say) form a leading turn of their own.
    Tool calls and their results sit in the turn of the user message they answer, so evicting
    whole turns never separates them.
    """
    turns: list[list[Message]] = []
    current: list[Message] = []
    for message in messages:
        if message.role == "user" and current:
            turns.append(current)
            current = []
        current.append(message)
    if current:
        turns.append(current)
    return turns


def id_ranges(ids: Sequence[int]) -> list[list[int]]:
    """Compact sorted ids into [first, last] ranges (plans stay small for long chats)."""
    ranges: list[list[int]] = []
    for i in sorted(ids):
        if ranges and i == ranges[-1][1] + 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ranges
