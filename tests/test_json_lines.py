"""Line-oriented JSON (server-sent events, JSON Lines) survives the characters that line
splitters outside JSON take for line ends: U+0085, U+2028, U+2029.

Oracles: httpx's own line reader (what a Python client streaming a chat reads events with),
``str.splitlines`` and ``json.loads``; not chatctx's reader.
"""

from __future__ import annotations

import io
import json

import httpx

from chatctx.serve._chat import _sse
from chatctx.store import Store, export_jsonl, import_records, read_jsonl

TRICKY = "a\u2028b\x85c\u2029d é ☀️\ne"


def test_an_event_with_a_line_separator_reaches_an_httpx_client_whole() -> None:
    event = {"choices": [{"index": 0, "delta": {"content": TRICKY}}]}
    body = _sse(event) + b"data: [DONE]\n\n"
    lines = [line for line in httpx.Response(200, content=body).iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 2
    assert lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == event
    assert "é ☀️" in lines[0]  # other text is still written as is, not as \u escapes


def test_an_exported_conversation_is_one_line_for_splitlines(tmp_path) -> None:
    record = {"id": "c", "messages": [{"role": "user", "content": TRICKY}]}
    with Store(f"sqlite:///{tmp_path / 'a.db'}") as store:
        import_records(store, read_jsonl([json.dumps(record)]))
        out = io.StringIO()
        export_jsonl(store, ["c"], out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == record
