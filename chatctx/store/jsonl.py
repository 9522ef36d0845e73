"""Conversations as JSON Lines in the OpenAI chat format, one conversation per line.

``{"id": "...", "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}]}``
A leading system message is the conversation's system prompt. chatctx adds ``title`` and
``settings`` at the top level and ``status`` on interrupted messages; other readers ignore them.

Every line is untrusted. A line is refused, with ``FILE:LINE: reason``, when it is longer than
``MAX_LINE_BYTES``, is not UTF-8, is not strict JSON (``NaN``/``Infinity``, numbers that
overflow a float, duplicate keys), nests deeper than ``MAX_DEPTH``, or holds a lone surrogate
(``"\\ud800"``): such a string cannot be encoded, so it is refused rather than silently
replaced, and the database never receives it. The same reader serves ``chatctx replay``
(``chatctx.replay._input``). Import is all or nothing.
"""

from __future__ import annotations

import io
import json
import math
import re
import uuid
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import SQLAlchemyError

from chatctx._json import json_line
from chatctx.errors import ImportFormatError
from chatctx.settings import ContextSettings, GenerationSettings
from chatctx.store._connect import _retry_busy
from chatctx.store._db import Store
from chatctx.store._models import ConversationRow, MessageRow
from chatctx.store._records import ROLES

MAX_LINE_BYTES = 16 * 1024 * 1024
"""Longest accepted line (without its newline); longer lines are refused, never held whole."""
MAX_DEPTH = 64
"""Deepest accepted nesting of arrays and objects (a conversation needs about six)."""
# Column sizes (PostgreSQL enforces them; SQLite would store anything).
MAX_ID_CHARS = 200
MAX_TITLE_CHARS = 500
MAX_NAME_CHARS = 200
STATUSES = ("complete", "partial")

_MESSAGE_KEYS = {"role", "content", "name", "tool_call_id", "tool_calls", "status"}
_SETTINGS: dict[str, type[BaseModel]] = {
    "generation": GenerationSettings,
    "context": ContextSettings,
}
_SURROGATE = re.compile("[\ud800-\udfff]")
# A read error mid-file (a truncated or corrupt gzip stream, say) ends the file.
READ_ERRORS = (OSError, EOFError, zlib.error)


@dataclass(frozen=True, slots=True)
class LineRef:
    """Where a record came from; ``error`` builds the ``FILE:LINE: reason`` refusal."""

    line: int
    source: str = "<input>"

    def error(self, message: str) -> ImportFormatError:
        return ImportFormatError(message, line=self.line, source=self.source)


def kind(value: Any) -> str:
    """The JSON type of ``value``, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def show(value: Any, width: int = 40) -> str:
    """A short, printable rendering of an untrusted value (never the whole of a big one)."""
    if isinstance(value, str):
        return repr(value[:width]) + ("..." if len(value) > width else "")
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
        return text if len(text) <= width else text[:width] + "..."
    return kind(value)


def display_source(path: str) -> str:
    """A file name fit for a message (undecodable bytes of a name shown as escapes)."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


class BinaryReader(Protocol):
    """What ``read_lines`` needs: a binary file, gzip stream or standard input's buffer."""

    def readline(self, size: int, /) -> bytes: ...


def read_lines(stream: BinaryReader, *, limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The lines of a binary stream, holding at most ``limit + 1`` bytes of any line.

    A longer line is yielded as its first ``limit + 1`` bytes (so ``load_line`` refuses it as
    too long) and the rest of it is read and dropped.
    """
    while True:
        data = stream.readline(limit + 1)
        if not data:
            return
        if len(data) > limit and not data.endswith(b"\n"):
            while True:
                rest = stream.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
        yield data


class _Refused(ValueError):
    """Raised from inside the JSON decoder's hooks."""


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"duplicate key {show(key)} in an object")
            seen.add(key)
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def _where(path: list[Any]) -> str:
    out = ""
    for label in path[1:]:
        if isinstance(label, int):
            out += f"[{label}]"
        else:
            shown = label if label.isprintable() and len(label) <= 30 else show(label, 30)
            out += ("." if out else "") + shown
    return out or "the line"


def _check_string(text: str, path: list[Any], ref: LineRef) -> None:
    found = _SURROGATE.search(text)
    if found is not None:
        raise ref.error(
            f"lone surrogate {found.group()!a} in {_where(path)}: not valid Unicode text"
        )


def _check_tree(value: Any, ref: LineRef) -> None:
    """Depth, lone surrogates and non-finite numbers, walked without recursion.

    The stack holds one iterator per open container, so memory stays O(depth) on a line of
    millions of items.
    """
    stack: list[Iterator[tuple[Any, Any]]] = [iter([("", value)])]
    path: list[Any] = [""]  # the label of the item being looked at, per level
    while stack:
        for label, item in stack[-1]:
            path[-1] = label
            if isinstance(item, str):
                _check_string(item, path, ref)
            elif isinstance(item, float) and not math.isfinite(item):
                raise ref.error(f"number out of range in {_where(path)}")
            elif isinstance(item, dict | list):
                if len(stack) > MAX_DEPTH:
                    raise ref.error(f"nested more than {MAX_DEPTH} levels deep")
                if isinstance(item, dict):
                    for key in item:
                        _check_string(key, [*path, "<key>"], ref)
                    stack.append(iter(item.items()))
                else:
                    stack.append(enumerate(item))
                path.append("")
                break
        else:
            stack.pop()
            path.pop()


def load_line(text: str | bytes, ref: LineRef) -> Any:
    """Parse one JSON Lines record strictly; any refusal is an ``ImportFormatError``."""
    body = text.rstrip(b"\r\n") if isinstance(text, bytes) else text.rstrip("\r\n")
    size = len(body)
    if isinstance(body, str) and size * 4 > MAX_LINE_BYTES:
        size = len(body.encode("utf-8", "surrogatepass"))
    if size > MAX_LINE_BYTES:
        raise ref.error(f"line longer than {MAX_LINE_BYTES // (1024 * 1024)} MiB")
    if isinstance(body, bytes):
        try:
            body = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ref.error(f"invalid UTF-8 (byte {exc.start})") from exc
    body = body.removeprefix("\ufeff")  # a byte order mark some editors write
    try:
        data = _DECODER.decode(body)
    except json.JSONDecodeError as exc:
        raise ref.error(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    except _Refused as exc:
        raise ref.error(str(exc)) from exc
    except RecursionError as exc:
        raise ref.error(f"nested more than {MAX_DEPTH} levels deep") from exc
    except ValueError as exc:  # an integer of more than 4,300 digits, say
        raise ref.error(f"not valid JSON ({exc})") from exc
    _check_tree(data, ref)
    if not isinstance(data, dict):
        raise ref.error(f"expected a JSON object, got {kind(data)}")
    return data


def check_id(value: Any, ref: LineRef) -> str | None:
    """A conversation id: a non-empty string (or an integer), at most 200 characters."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ref.error(f'"id" must be a string, got {kind(value)}')
    cid = str(value)
    if not cid.strip():
        raise ref.error('"id" must not be empty')
    if len(cid) > MAX_ID_CHARS:
        raise ref.error(f'"id" longer than {MAX_ID_CHARS} characters')
    return cid


def check_text(raw: dict[str, Any], key: str, where: str, ref: LineRef, limit: int) -> str | None:
    """An optional short string field (``name``, ``tool_call_id``)."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ref.error(f'{where}: "{key}" must be a string, got {kind(value)}')
    if len(value) > limit:
        raise ref.error(f'{where}: "{key}" longer than {limit} characters')
    return value


def check_status(raw: dict[str, Any], where: str, ref: LineRef) -> str | None:
    status = raw.get("status")
    if status is not None and (not isinstance(status, str) or status not in STATUSES):
        raise ref.error(
            f'{where}: unknown status {show(status)} (expected "complete" or "partial")'
        )
    return status


def check_tool_calls(value: Any, where: str, ref: LineRef) -> list[dict[str, Any]] | None:
    """OpenAI tool calls: ``[{"id": str, "type": str, "function": {"name": str, ...}}]``."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ref.error(f'{where}: "tool_calls" must be a list, got {kind(value)}')
    for number, call in enumerate(value, start=1):
        at = f"{where}: tool call {number}"
        if not isinstance(call, dict):
            raise ref.error(f"{at}: expected an object, got {kind(call)}")
        for key in ("id", "type"):
            if call.get(key) is not None and not isinstance(call[key], str):
                raise ref.error(f'{at}: "{key}" must be a string, got {kind(call[key])}')
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ref.error(f'{at}: needs a "function" object with a string "name"')
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str | dict):
            raise ref.error(f"{at}: arguments must be a string or an object")
    return value


def check_settings(value: Any, ref: LineRef) -> dict[str, Any]:
    """Conversation settings as ``ChatSession`` reads them: refused now, not at the next turn."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ref.error(f'"settings" must be an object, got {kind(value)}')
    unknown = sorted(set(value) - set(_SETTINGS))
    if unknown:
        shown = ", ".join(show(k) for k in unknown[:5])
        raise ref.error(f'"settings": unknown keys {shown} (expected "generation", "context")')
    for key, model in _SETTINGS.items():
        part = value.get(key)
        if part is None:
            continue
        if not isinstance(part, dict):
            raise ref.error(f'"settings.{key}" must be an object, got {kind(part)}')
        _validate(model, part, f"settings.{key}", ref)
    return value


def _validate(model: type[BaseModel], value: dict[str, Any], label: str, ref: LineRef) -> None:
    try:
        model.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or label}: {e['msg']}" for e in exc.errors()[:3]
        )
        raise ref.error(f'"{label}" is not valid: {problems}') from exc


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    """One parsed line: a conversation ready to be stored."""

    id: str | None
    title: str | None
    system_prompt: str | None
    settings: dict[str, Any]
    messages: list[dict[str, Any]]
    line: int
    source: str = "<input>"


def export_conversation(store: Store, conversation_id: str) -> dict[str, Any]:
    """One conversation as a JSON-ready dict."""
    conversation = store.get_conversation(conversation_id)
    messages: list[dict[str, Any]] = []
    if conversation.system_prompt is not None:
        messages.append({"role": "system", "content": conversation.system_prompt})
    for message in store.messages(conversation_id):
        item = message.to_openai()
        if message.status != "complete":
            item["status"] = message.status
        messages.append(item)
    out: dict[str, Any] = {"id": conversation.id, "messages": messages}
    if conversation.title is not None:
        out["title"] = conversation.title
    if conversation.settings:
        out["settings"] = conversation.settings
    return out


def export_jsonl(store: Store, conversation_ids: Iterable[str], out: TextIO) -> int:
    """Write each conversation as one line; returns how many were written."""
    count = 0
    for cid in conversation_ids:
        out.write(json_line(export_conversation(store, cid)) + "\n")
        count += 1
    return count


def _import_message(raw: Any, index: int, ref: LineRef) -> dict[str, Any]:
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise ref.error(f"{where}: expected an object, got {kind(raw)}")
    unknown = sorted(set(raw) - _MESSAGE_KEYS)
    if unknown:
        shown = ", ".join(show(k) for k in unknown[:5])
        raise ref.error(f"{where}: unknown keys {shown}")
    role = raw.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ref.error(f"{where}: unknown role {show(role)}")
    tool_calls = check_tool_calls(raw.get("tool_calls"), where, ref)
    content = raw.get("content")
    if content is None and role == "assistant" and tool_calls:
        content = ""
    if not isinstance(content, str):
        raise ref.error(f"{where}: content must be a string, got {kind(content)}")
    message: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        value = check_text(raw, key, where, ref, MAX_NAME_CHARS)
        if value is not None:
            message[key] = value
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    if check_status(raw, where, ref) == "partial":  # "complete" is the stored default
        message["status"] = "partial"
    return message


def parse_line(text: str | bytes, *, line: int, source: str = "<input>") -> ConversationRecord:
    """Validate one JSON Lines record (text or raw bytes); errors name the file and line."""
    ref = LineRef(line, source)
    data = load_line(text, ref)
    raw_messages = data.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ref.error('expected a non-empty "messages" list')
    cid = check_id(data.get("id"), ref)
    title = data.get("title")
    if title is not None:
        if not isinstance(title, str):
            raise ref.error(f'"title" must be a string, got {kind(title)}')
        if len(title) > MAX_TITLE_CHARS:
            raise ref.error(f'"title" longer than {MAX_TITLE_CHARS} characters')
    system_prompt: str | None = None
    messages: list[dict[str, Any]] = []
    for index, raw in enumerate(raw_messages, start=1):
        message = _import_message(raw, index, ref)
        if index == 1 and message["role"] == "system" and set(message) == {"role", "content"}:
            system_prompt = message["content"]
            continue
        messages.append(message)
    return ConversationRecord(
        id=cid,
        title=title,
        system_prompt=system_prompt,
        settings=check_settings(data.get("settings"), ref),
        messages=messages,
        line=line,
        source=source,
    )


def read_jsonl(
    stream: Iterable[str] | Iterable[bytes], *, source: str = "<input>"
) -> Iterator[ConversationRecord]:
    """Parse every non-blank line, raising ``ImportFormatError`` at the first bad one.

    ``stream`` is text or bytes lines (a text file, a list of strings), or a binary file,
    which is read with ``read_lines`` so that a hostile line never sits whole in memory.
    """
    given: Iterable[str | bytes] = stream
    if isinstance(stream, io.BufferedIOBase | io.RawIOBase):
        given = read_lines(stream)
    lines = iter(given)
    number = 0
    while True:
        number += 1
        try:
            text = next(lines)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:  # a text stream met bytes that are not UTF-8
            raise ImportFormatError(
                f"invalid UTF-8 (byte {exc.start})", line=number, source=source
            ) from exc
        except READ_ERRORS as exc:
            raise ImportFormatError(f"unreadable: {exc}", line=number, source=source) from exc
        if text.strip():
            yield parse_line(text, line=number, source=source)


def import_records(store: Store, records: Iterable[ConversationRecord]) -> list[str]:
    """Store parsed conversations in one transaction: all of them, or none on any error.

    Errors name the record's file and line: a duplicate id, an id already in the store, or
    a row the database refused.
    """
    records = list(records)
    seen: dict[str, ConversationRecord] = {}
    for record in records:
        if record.id is not None:
            first = seen.get(record.id)
            if first is not None:
                raise LineRef(record.line, record.source).error(
                    f"duplicate id {show(record.id)} (first on line {first.line})"
                )
            seen[record.id] = record
    return _store_records(store, records)


@_retry_busy
def _store_records(store: Store, records: list[ConversationRecord]) -> list[str]:
    ids: list[str] = []
    # One write transaction: the existence checks and the inserts see the same database.
    with store._session(write=True) as session:
        for record in records:
            ref = LineRef(record.line, record.source)
            if record.id is not None and session.get(ConversationRow, record.id) is not None:
                raise ref.error(f"conversation {show(record.id)} already exists")
            row = ConversationRow(
                title=record.title, system_prompt=record.system_prompt, settings=record.settings
            )
            row.id = record.id if record.id is not None else uuid.uuid4().hex[:12]
            session.add(row)
            for position, message in enumerate(record.messages):
                session.add(MessageRow(conversation_id=row.id, position=position, **message))
            try:
                session.flush()
            # ValueError: a string the driver cannot encode, in a record not made by parse_line
            except (SQLAlchemyError, ValueError, TypeError) as exc:
                raise ref.error(f"the database refused it, nothing was imported: {exc}") from exc
            ids.append(row.id)
    return ids
