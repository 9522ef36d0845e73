"""Conversations as JSON Lines in the OpenAI chat format, one conversation per line.

``{"id": "...", "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}]}``
A leading system message is the conversation's system prompt. chatctx adds ``title`` and
``settings`` at the top level and ``status`` on interrupted messages; other readers ignore them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from sqlalchemy.exc import SQLAlchemyError

from chatctx.errors import ImportFormatError, StoreError
from chatctx.store._db import Store
from chatctx.store._models import ConversationRow, MessageRow
from chatctx.store._records import ROLES

_MESSAGE_KEYS = {"role", "content", "name", "tool_call_id", "tool_calls", "status"}


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    """One parsed line: a conversation ready to be stored."""

    id: str | None
    title: str | None
    system_prompt: str | None
    settings: dict[str, Any]
    messages: list[dict[str, Any]]
    line: int


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
        out.write(json.dumps(export_conversation(store, cid), ensure_ascii=False) + "\n")
        count += 1
    return count


def _fail(message: str, line: int, source: str) -> ImportFormatError:
    return ImportFormatError(message, line=line, source=source)


def parse_line(text: str, *, line: int, source: str = "<input>") -> ConversationRecord:
    """Validate one JSON Lines record; errors name the line."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(f"not valid JSON ({exc.msg} at column {exc.colno})", line, source) from exc
    if not isinstance(data, dict):
        raise _fail("expected a JSON object", line, source)
    raw_messages = data.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _fail('expected a non-empty "messages" list', line, source)
    cid = data.get("id")
    if cid is not None and not isinstance(cid, str | int):
        raise _fail('"id" must be a string', line, source)
    system_prompt: str | None = None
    messages: list[dict[str, Any]] = []
    for index, raw in enumerate(raw_messages, start=1):
        where = f"message {index}"
        if not isinstance(raw, dict):
            raise _fail(f"{where}: expected an object", line, source)
        unknown = set(raw) - _MESSAGE_KEYS
        if unknown:
            raise _fail(f"{where}: unknown keys {sorted(unknown)}", line, source)
        role = raw.get("role")
        if role not in ROLES:
            raise _fail(f"{where}: unknown role {role!r}", line, source)
        content = raw.get("content")
        if content is None and role == "assistant" and raw.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise _fail(f"{where}: content must be a string", line, source)
        if role == "system" and index == 1:
            system_prompt = content
            continue
        messages.append(
            {key: raw[key] for key in _MESSAGE_KEYS if key in raw} | {"content": content}
        )
    settings = data.get("settings") or {}
    if not isinstance(settings, dict):
        raise _fail('"settings" must be an object', line, source)
    title = data.get("title")
    return ConversationRecord(
        id=None if cid is None else str(cid),
        title=title if isinstance(title, str) else None,
        system_prompt=system_prompt,
        settings=settings,
        messages=messages,
        line=line,
    )


def read_jsonl(stream: Iterable[str], *, source: str = "<input>") -> Iterator[ConversationRecord]:
    """Parse every non-blank line, raising ``ImportFormatError`` at the first bad one."""
    for number, text in enumerate(stream, start=1):
        if text.strip():
            yield parse_line(text, line=number, source=source)


def import_records(store: Store, records: Iterable[ConversationRecord]) -> list[str]:
    """Store parsed conversations in one transaction: all of them, or none on any error."""
    records = list(records)
    seen: set[str] = set()
    for record in records:
        if record.id is not None:
            if record.id in seen:
                raise ImportFormatError(f"duplicate id {record.id!r}", line=record.line)
            if store.has_conversation(record.id):
                raise ImportFormatError(
                    f"conversation {record.id!r} already exists", line=record.line
                )
            seen.add(record.id)
    ids: list[str] = []
    session = store._sessions()
    try:
        for record in records:
            row = ConversationRow(
                title=record.title, system_prompt=record.system_prompt, settings=record.settings
            )
            row.id = record.id if record.id is not None else uuid.uuid4().hex[:12]
            session.add(row)
            for position, message in enumerate(record.messages):
                session.add(MessageRow(conversation_id=row.id, position=position, **message))
            ids.append(row.id)
        session.commit()
    except SQLAlchemyError as exc:
        session.rollback()
        raise StoreError(f"import failed, nothing was stored: {exc}") from exc
    finally:
        session.close()
    return ids
