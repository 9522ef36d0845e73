"""Logged conversations as JSON Lines: OpenAI chat format or ShareGPT, detected per line.

OpenAI: ``{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}``
ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}``
Either may carry ``"probes": [{"fact": "NH-48213", "asked_turn": 12}]`` (see
``chatctx.synthetic``). Files may be gzip-compressed; ``-`` reads standard input.
"""

from __future__ import annotations

import gzip
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from chatctx.errors import ImportFormatError

logger = logging.getLogger("chatctx.replay")

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}
_ROLES = {"system", "user", "assistant", "tool"}


@dataclass(frozen=True, slots=True)
class Probe:
    """A planted fact and the user turn (0-based) that asks for it back."""

    fact: str
    asked_turn: int
    kind: str | None = None


@dataclass(frozen=True, slots=True)
class LoggedConversation:
    id: str
    system_prompt: str | None
    messages: list[dict[str, Any]]  # without the system prompt
    probes: list[Probe] = field(default_factory=list)
    source: str = "<input>"
    line: int = 0

    def turns(self) -> list[tuple[str, list[dict[str, Any]]]]:
        """(user text, the logged messages that answer it) per user turn."""
        out: list[tuple[str, list[dict[str, Any]]]] = []
        for message in self.messages:
            if message["role"] == "user":
                out.append((message["content"], []))
            elif out:
                out[-1][1].append(message)
        return out


def _fail(message: str, line: int, source: str) -> ImportFormatError:
    return ImportFormatError(message, line=line, source=source)


def _message(raw: Any, index: int, line: int, source: str, sharegpt: bool) -> dict[str, Any]:
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise _fail(f"{where}: expected an object", line, source)
    if sharegpt:
        role = _SHAREGPT_ROLES.get(str(raw.get("from")))
        if role is None:
            raise _fail(f"{where}: unknown role {raw.get('from')!r}", line, source)
        content = raw.get("value")
    else:
        role = raw.get("role")
        if role not in _ROLES:
            raise _fail(f"{where}: unknown role {role!r}", line, source)
        content = raw.get("content")
        if content is None and raw.get("tool_calls"):
            content = ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise _fail(f"{where}: content must be a string", line, source)
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id", "tool_calls"):
        if not sharegpt and raw.get(key) is not None:
            out[key] = raw[key]
    return out


def parse_logged(text: str, *, line: int, source: str = "<input>") -> LoggedConversation:
    """One JSON Lines record in either format; errors name the file and line."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(f"not valid JSON ({exc.msg} at column {exc.colno})", line, source) from exc
    if not isinstance(data, dict):
        raise _fail("expected a JSON object", line, source)
    sharegpt = "conversations" in data
    raw = data.get("conversations") if sharegpt else data.get("messages")
    if not isinstance(raw, list):
        raise _fail(
            'expected a "messages" (OpenAI) or "conversations" (ShareGPT) list', line, source
        )
    messages = [_message(m, i, line, source, sharegpt) for i, m in enumerate(raw, start=1)]
    system = None
    if messages and messages[0]["role"] == "system":
        system = messages.pop(0)["content"]
    if not any(m["role"] == "user" for m in messages):
        raise _fail("empty conversation: no user message", line, source)
    probes = []
    for item in data.get("probes") or []:
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("fact"), str)
            or not isinstance(item.get("asked_turn"), int)
        ):
            raise _fail('a probe needs "fact" (string) and "asked_turn" (integer)', line, source)
        probes.append(
            Probe(fact=item["fact"], asked_turn=item["asked_turn"], kind=item.get("kind"))
        )
    cid = data.get("id")
    return LoggedConversation(
        id=str(cid) if cid is not None else f"{Path(source).name}:{line}",
        system_prompt=system,
        messages=messages,
        probes=probes,
        source=source,
        line=line,
    )


def _open(path: str) -> IO[bytes] | gzip.GzipFile:
    if path == "-":
        return sys.stdin.buffer
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def read_logs(
    paths: Iterable[str], *, on_error: str = "fail", errors: list[ImportFormatError] | None = None
) -> Iterator[LoggedConversation]:
    """Conversations from JSON Lines files, in order.

    ``on_error="fail"`` raises ``ImportFormatError`` at the first bad line; ``"skip"`` logs
    it, appends it to ``errors`` and goes on.
    """
    for path in paths:
        source = "<stdin>" if path == "-" else path
        try:
            stream = _open(path)
        except OSError as exc:
            raise ImportFormatError(f"cannot read: {exc.strerror}", line=0, source=source) from exc
        try:
            for number, raw in enumerate(stream, start=1):
                try:
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise _fail(f"invalid UTF-8 (byte {exc.start})", number, source) from exc
                    except (OSError, EOFError) as exc:
                        raise _fail(f"unreadable: {exc}", number, source) from exc
                    if text.strip():
                        yield parse_logged(text, line=number, source=source)
                except ImportFormatError as exc:
                    if on_error != "skip":
                        raise
                    logger.warning("skipped %s", exc)
                    if errors is not None:
                        errors.append(exc)
        except (OSError, EOFError) as exc:  # a truncated gzip stream, say
            raise ImportFormatError(f"unreadable: {exc}", line=0, source=source) from exc
        finally:
            if path != "-":
                stream.close()
