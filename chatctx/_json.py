"""JSON for line-oriented outputs: server-sent events, JSON Lines, log lines.

Non-ASCII text is written as is, except three characters that JSON allows raw in a string
but that common line splitters take for line ends (Python's ``str.splitlines``, and so
httpx's ``iter_lines``): U+0085, U+2028 and U+2029. Written raw, a reply holding one of
them reaches such a client as a cut event or record; escaped, it parses back the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

_ESCAPES = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def json_line(value: Any, *, default: Callable[[Any], Any] | None = None) -> str:
    """``value`` as one line of JSON (no line end added)."""
    return json.dumps(value, ensure_ascii=False, default=default).translate(_ESCAPES)
