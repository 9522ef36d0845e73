"""OpenAI's Responses items, both ways: request items to chat messages, stored messages to items.

Items a client sends (``input`` of a response, the items of a conversation):

- ``message`` (``type`` may be left out): ``role`` user, assistant, system or developer;
  ``content`` a string or parts (``input_text``, ``output_text``, ``refusal``); text only.
- ``function_call``: a call the assistant made (``call_id``, ``name``, ``arguments``); calls
  in a row, after an assistant message or not, make one assistant message with calls.
- ``function_call_output``: a call's result (``call_id``, ``output``), a ``tool`` message.

Stored messages go out as items whose ids name their place in the conversation: ``msg_<n>``
for a message at position n, ``fc_<n>_<k>`` for its k-th call, ``fco_<n>`` for a result, so a
reply streamed before it is stored already has the id it will be listed under.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from chatctx.serve._errors import APIError
from chatctx.serve._schemas import ChatMessage
from chatctx.store import Message

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_ITEM_ID = re.compile(r"^(msg|fc|fco)_(\d{1,9})(?:_(\d{1,4}))?$")


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _text(value: Any, param: str) -> str:
    """A string, or the text of a list of text parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad("content must be a string or a list of text parts", param)
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise _bad(
                f"content parts of type {kind} are not supported (text only)",
                f"{param}[{i}].type",
                "unsupported_content",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise _bad("a text part needs its text", f"{param}[{i}].text")
        texts.append(text)
    return "".join(texts)


def _field(item: dict[str, Any], name: str, param: str, *, limit: int = 0) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value or (limit and len(value) > limit):
        size = f" of at most {limit} characters" if limit else ""
        raise _bad(f"{name} must be a non-empty string{size}", f"{param}.{name}")
    return value


def _message(data: dict[str, Any], param: str) -> ChatMessage:
    try:
        return ChatMessage.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not isinstance(p, int))
        raise _bad(first["msg"], f"{param}.{where}" if where else param) from None


def chat_messages(items: str | Sequence[Any], *, where: str = "input") -> list[ChatMessage]:
    """Items (or one user text) as chat messages, in order; a 400 naming the bad item."""
    if isinstance(items, str):
        return [_message({"role": "user", "content": items}, where)]
    out: list[ChatMessage] = []
    calls: list[dict[str, Any]] = []  # function_call items of the assistant message being made
    said: str | None = None  # that message's text

    def flush() -> None:
        nonlocal said
        if said is None and not calls:
            return
        out.append(
            _message(
                {"role": "assistant", "content": said or "", "tool_calls": list(calls) or None},
                where,
            )
        )
        calls.clear()
        said = None

    for i, item in enumerate(items):
        param = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _bad("an item must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad("role must be user, assistant, system or developer", f"{param}.role")
            text = _text(item.get("content"), f"{param}.content")
            if role == "assistant":
                flush()
                said = text
                continue
            flush()
            out.append(_message({"role": role, "content": text}, param))
        elif kind == "function_call":
            if said is None and not calls:
                said = ""
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise _bad("arguments must be a JSON string", f"{param}.arguments")
            calls.append(
                {
                    "id": _field(item, "call_id", param, limit=200),
                    "type": "function",
                    "function": {
                        "name": _field(item, "name", param, limit=64),
                        "arguments": arguments,
                    },
                }
            )
        elif kind == "function_call_output":
            flush()
            output = _text(item.get("output"), f"{param}.output")
            call_id = _field(item, "call_id", param, limit=200)
            out.append(
                _message({"role": "tool", "content": output, "tool_call_id": call_id}, param)
            )
        else:
            raise _bad(
                f"items of type {kind} are not supported (message, function_call, "
                "function_call_output)",
                f"{param}.type",
                "unsupported_value",
            )
    flush()
    return out


def split_system(messages: list[ChatMessage]) -> tuple[list[str], list[ChatMessage]]:
    """System and developer messages wherever they stand, and the others in order."""
    systems = [m.text() for m in messages if m.stored_role == "system"]
    return systems, [m for m in messages if m.stored_role != "system"]


def message_id(position: int) -> str:
    return f"msg_{position}"


def message_item(position: int, text: str, *, status: str = "completed") -> dict[str, Any]:
    """An assistant message item as a response's output carries it."""
    return {
        "type": "message",
        "id": message_id(position),
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(position: int, k: int, call: dict[str, Any]) -> dict[str, Any]:
    """A call of the assistant message at ``position`` (OpenAI's chat shape in)."""
    return {
        "type": "function_call",
        "id": f"fc_{position}_{k}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def message_items(message: Message) -> list[dict[str, Any]]:
    """The items one stored message is listed as (an assistant's text, then its calls)."""
    n = message.position
    status = "completed" if message.status == "complete" else "incomplete"
    if message.role == "tool":
        return [
            {
                "type": "function_call_output",
                "id": f"fco_{n}",
                "call_id": message.tool_call_id,
                "output": message.content,
                "status": status,
            }
        ]
    if message.role == "assistant":
        items = [message_item(n, message.content, status=status)] if message.content else []
        calls = message.tool_calls or []
        return items + [call_item(n, k, c) for k, c in enumerate(calls)]
    kind = "input_text"
    return [
        {
            "type": "message",
            "id": message_id(n),
            "role": message.role,
            "status": status,
            "content": [{"type": kind, "text": message.content}],
        }
    ]


def items_of(messages: Iterable[Message]) -> list[dict[str, Any]]:
    return [item for m in messages for item in message_items(m)]


def item_position(item_id: str) -> int | None:
    """The position of the message an item id names; None for no item id of ours."""
    found = _ITEM_ID.match(item_id)
    return None if found is None else int(found.group(2))


def page(
    items: list[dict[str, Any]], *, after: str | None, limit: int, order: str
) -> dict[str, Any]:
    """One page of ``items`` (in conversation order) as OpenAI lists them: ``order`` asc or
    desc, from the item after ``after`` (an unknown ``after``: an empty page)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }
