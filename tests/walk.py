"""llama-server's cache reuse, written out here as an oracle for the tests.

The walk of ``update_slots`` in llama.cpp's tools/server/server-context.cpp (build 11434):
the common prefix, then with ``n_cache_reuse`` > 0 every cached run of at least that many
tokens that continues the prompt where the last run stopped, scanning the cache forward; the
prompt's last token is always evaluated. chatctx's own model of it (``plan_in_order``) is
what the tests check, so this one is written apart from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def server_walk(cached: Sequence[int], prompt: Sequence[int], min_chunk: int) -> int:
    """Tokens llama-server keeps of ``prompt`` (its ``cache_n``) when its slot holds
    ``cached``."""
    n_past = 0
    while n_past < min(len(cached), len(prompt)) and cached[n_past] == prompt[n_past]:
        n_past += 1
    head_c = head_p = n_past
    while min_chunk > 0 and head_c < len(cached) and head_p < len(prompt):
        n = 0
        while (
            head_c + n < len(cached)
            and head_p + n < len(prompt)
            and cached[head_c + n] == prompt[head_p + n]
        ):
            n += 1
        if n >= min_chunk:
            n_past += n
            head_c += n
            head_p += n
        else:
            head_c += 1
    return n_past - 1 if n_past == len(prompt) else n_past


def kept_in(
    messages: Sequence[dict[str, Any]], before: Sequence[dict[str, Any]]
) -> list[int | None]:
    """For each of ``messages``, its index in ``before`` matched in order (None: not there)."""
    out: list[int | None] = []
    at = 0
    for message in messages:
        j = next((i for i in range(at, len(before)) if before[i] == message), None)
        out.append(j)
        if j is not None:
            at = j + 1
    return out


def cut_of(content: str, original: str) -> bool:
    """``content`` is ``original`` with text left out (its characters, in order)."""
    rest = iter(original)
    return len(content) < len(original) and all(ch in rest for ch in content)
