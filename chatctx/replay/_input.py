"""Logged conversations as JSON Lines: OpenAI chat format or ShareGPT, detected per line.

OpenAI: ``{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}``
ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}``
Either may carry ``"probes": [{"fact": "NH-48213", "asked_turn": 12}]`` (see
``chatctx.synthetic``). Files may be gzip-compressed; ``-`` reads standard input.

Lines are untrusted and read as strictly as ``chatctx conversations import`` reads them
(``chatctx.store.jsonl.load_line``): at most 16 MiB, UTF-8, strict JSON, at most 64 levels
deep, no lone surrogates (refused, not replaced). Every field is type-checked; a bad line is an
``ImportFormatError`` naming ``FILE:LINE``, which ``read_logs(on_error="skip")`` reports and
steps over.
"""

from __future__ import annotations

import gzip
import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from chatctx.errors import ImportFormatError
from chatctx.store.jsonl import (
    MAX_NAME_CHARS,
    READ_ERRORS,
    LineRef,
    check_id,
    check_status,
    check_text,
    check_tool_calls,
    kind,
    load_line,
    read_lines,
    show,
)

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


def _content(raw: dict[str, Any], where: str, ref: LineRef) -> str:
    """A message's text: a string, or the text of its content parts (others are skipped)."""
    content = raw.get("content")
    if content is None and raw.get("tool_calls"):
        return ""
    if isinstance(content, list):
        texts: list[str] = []
        for number, part in enumerate(content, start=1):
            at = f"{where}: content part {number}"
            if not isinstance(part, dict):
                raise ref.error(f"{at}: expected an object, got {kind(part)}")
            text = part.get("text")
            if text is None:
                if part.get("type") in (None, "text"):
                    raise ref.error(f'{at}: a text part needs a "text" string')
                continue  # an image or audio part: nothing to replay
            if not isinstance(text, str):
                raise ref.error(f'{at}: "text" must be a string, got {kind(text)}')
            texts.append(text)
        return "".join(texts)
    if not isinstance(content, str):
        raise ref.error(
            f"{where}: content must be a string or a list of parts, got {kind(content)}"
        )
    return content


def _message(raw: Any, index: int, ref: LineRef, sharegpt: bool) -> dict[str, Any]:
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise ref.error(f"{where}: expected an object, got {kind(raw)}")
    check_status(raw, where, ref)
    if sharegpt:
        speaker = raw.get("from")
        role = _SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise ref.error(f"{where}: unknown role {show(speaker)}")
        content = raw.get("value")
        if not isinstance(content, str):
            raise ref.error(f'{where}: "value" must be a string, got {kind(content)}')
        return {"role": role, "content": content}
    role = raw.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise ref.error(f"{where}: unknown role {show(role)}")
    tool_calls = check_tool_calls(raw.get("tool_calls"), where, ref)
    out: dict[str, Any] = {"role": role, "content": _content(raw, where, ref)}
    for key in ("name", "tool_call_id"):
        value = check_text(raw, key, where, ref, MAX_NAME_CHARS)
        if value is not None:
            out[key] = value
    if tool_calls is not None:
        out["tool_calls"] = tool_calls
    return out


def _probes(value: Any, ref: LineRef) -> list[Probe]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ref.error(f'"probes" must be a list, got {kind(value)}')
    probes = []
    for number, item in enumerate(value, start=1):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("fact"), str)
            or not item["fact"]
            or isinstance(item.get("asked_turn"), bool)
            or not isinstance(item.get("asked_turn"), int)
            or item["asked_turn"] < 0
            or not isinstance(item.get("kind"), str | None)
        ):
            raise ref.error(
                f'probe {number}: needs "fact" (a non-empty string), "asked_turn" (an integer '
                'from 0) and an optional "kind" (a string)'
            )
        probes.append(
            Probe(fact=item["fact"], asked_turn=item["asked_turn"], kind=item.get("kind"))
        )
    return probes


def parse_logged(text: str | bytes, *, line: int, source: str = "<input>") -> LoggedConversation:
    """One JSON Lines record in either format (text or raw bytes); errors name file and line.

    The line is read as strictly as ``chatctx conversations import`` reads it (size, UTF-8,
    nesting, lone surrogates, NaN: see ``chatctx.store.jsonl``) and every field is type-checked.
    """
    ref = LineRef(line, source)
    data = load_line(text, ref)
    sharegpt = "conversations" in data
    raw = data.get("conversations") if sharegpt else data.get("messages")
    if not isinstance(raw, list):
        raise ref.error('expected a "messages" (OpenAI) or "conversations" (ShareGPT) list')
    messages = [_message(m, i, ref, sharegpt) for i, m in enumerate(raw, start=1)]
    system = None
    if messages and messages[0]["role"] == "system":
        system = messages.pop(0)["content"]
    if not any(m["role"] == "user" for m in messages):
        raise ref.error("empty conversation: no user message")
    probes = _probes(data.get("probes"), ref)
    cid = check_id(data.get("id"), ref)
    return LoggedConversation(
        id=cid if cid is not None else f"{Path(source).name}:{line}",
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
    it, appends it to ``errors`` and goes on. A bad line is any line ``parse_logged`` refuses,
    or a second line with an id already read. A file that cannot be opened, or stops being
    readable (a corrupt gzip stream), ends with an error even when skipping.
    """
    seen: dict[str, str] = {}  # explicit id -> where it was first read
    for path in paths:
        source = "<stdin>" if path == "-" else path.encode("utf-8", "backslashreplace").decode()
        try:
            stream = _open(path)
        except OSError as exc:
            raise ImportFormatError(f"cannot read: {exc.strerror}", line=0, source=source) from exc
        number = 0
        try:
            lines = read_lines(stream)
            while True:
                number += 1
                try:
                    raw = next(lines)
                except StopIteration:
                    break
                except READ_ERRORS as exc:
                    raise ImportFormatError(
                        f"unreadable: {exc}", line=number, source=source
                    ) from exc
                if not raw.strip():
                    continue
                try:
                    conversation = parse_logged(raw, line=number, source=source)
                    first = seen.get(conversation.id)
                    if first is not None:
                        raise LineRef(number, source).error(
                            f"duplicate id {show(conversation.id)} (first at {first})"
                        )
                    # An id made up from the file name is not the log's: two files of one name
                    # in different folders must not clash.
                    if conversation.id != f"{Path(source).name}:{number}":
                        seen[conversation.id] = f"{source}:{number}"
                except ImportFormatError as exc:
                    if on_error != "skip":
                        raise
                    logger.warning("skipped %s", exc)
                    if errors is not None:
                        errors.append(exc)
                    continue
                yield conversation
        finally:
            if path != "-":
                stream.close()
