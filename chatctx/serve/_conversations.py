"""Conversations: OpenAI's Conversations API, and chatctx's own views of one.

OpenAI's shapes: create (``conv_…`` ids, with items and metadata), get, update metadata,
delete; items listed (``after``, ``limit``, ``order``), added, got. A conversation is any
stored one (those chat completions name with ``conversation`` too). chatctx's own: the list
of a tenant's conversations, ``export``, ``inspect`` and ``stats``; ``GET`` carries the
stored settings and messages besides OpenAI's fields.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from fastapi.encoders import jsonable_encoder
from fastapi.responses import Response
from pydantic import Field, field_validator

from chatctx._json import json_line
from chatctx.errors import ConversationNotFound
from chatctx.monitor import totals
from chatctx.serve._errors import APIError, not_found
from chatctx.serve._items import (
    chat_messages,
    item_position,
    items_of,
    message_items,
    page,
    split_system,
)
from chatctx.serve._responses import check_metadata
from chatctx.serve._routes import ERRORS, ServiceDep, TenantDep
from chatctx.serve._schemas import CONVERSATION_ID, _Strict
from chatctx.serve._service import Service
from chatctx.serve._tenants import Tenant
from chatctx.store import Store, export_conversation

router = APIRouter()
ConversationId = Annotated[str, Path(pattern=CONVERSATION_ID, max_length=128)]
ItemId = Annotated[str, Path(max_length=64)]


def _json(value: Any) -> dict[str, Any]:
    encoded: dict[str, Any] = jsonable_encoder(value)
    return encoded


class _Metadata(_Strict):
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        check_metadata(value)
        return value


class ConversationCreate(_Metadata):
    """``POST /v1/conversations``: initial items (system ones set its system prompt)."""

    items: list[dict[str, Any]] | None = Field(None, max_length=1000)


class ConversationUpdate(_Metadata):
    metadata: dict[str, str]


class ItemsCreate(_Strict):
    items: list[dict[str, Any]] = Field(min_length=1, max_length=1000)


def _conversation_object(conversation: str, c: Any) -> dict[str, Any]:
    created = c.created_at.timestamp() if c.created_at is not None else 0
    return {
        "id": conversation,
        "object": "conversation",
        "created_at": int(created),
        "metadata": c.metadata or {},
    }


def _to_store(
    items: list[dict[str, Any]], max_chars: int
) -> tuple[str | None, list[dict[str, Any]]]:
    """Items as the system prompt they set and the messages they add."""
    systems, messages = split_system(chat_messages(items, where="items"))
    for i, m in enumerate(messages):
        if len(m.text()) > max_chars:
            raise APIError(
                400,
                f"item {i} is longer than {max_chars} characters",
                param=f"items[{i}]",
                code="string_above_max_length",
            )
    return ("\n\n".join(systems) if systems else None), [m.stored() for m in messages]


@router.post("/v1/conversations", responses=ERRORS, tags=["conversations"])
async def create_conversation(
    body: ConversationCreate, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """A new conversation (``conv_…``), with its first items and metadata."""
    store, _ = service.require_ready()
    conversation = f"conv_{uuid.uuid4().hex}"
    stored_id = tenant.stored_id(conversation)
    system_prompt, messages = _to_store(body.items or [], service.config.limits.max_message_chars)

    def create() -> Any:
        store.create_conversation(
            stored_id, system_prompt=system_prompt, metadata=body.metadata or {}
        )
        if messages:
            store.add_messages(stored_id, messages)
        return store.get_conversation(stored_id)

    return _conversation_object(conversation, await asyncio.to_thread(create))


@router.post("/v1/conversations/{conversation}", responses=ERRORS, tags=["conversations"])
async def update_conversation(
    conversation: ConversationId, body: ConversationUpdate, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """Replace the conversation's metadata."""
    store, stored_id = await _owned(service, tenant, conversation)
    try:
        c = await asyncio.to_thread(store.update_conversation, stored_id, metadata=body.metadata)
    except ConversationNotFound:
        raise not_found() from None
    return _conversation_object(conversation, c)


async def _items(store: Store, stored_id: str) -> list[dict[str, Any]]:
    return items_of(await asyncio.to_thread(store.messages, stored_id))


@router.get("/v1/conversations/{conversation}/items", responses=ERRORS, tags=["conversations"])
async def list_items(
    conversation: ConversationId,
    tenant: TenantDep,
    service: ServiceDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> dict[str, Any]:
    """The conversation's items, newest first unless ``order=asc``; page on with ``after``."""
    store, stored_id = await _owned(service, tenant, conversation)
    return page(await _items(store, stored_id), after=after, limit=limit, order=order)


@router.post("/v1/conversations/{conversation}/items", responses=ERRORS, tags=["conversations"])
async def add_items(
    conversation: ConversationId, body: ItemsCreate, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """Append items (waits for a turn in flight); system items replace the system prompt."""
    store, stored_id = await _owned(service, tenant, conversation)
    system_prompt, messages = _to_store(body.items, service.config.limits.max_message_chars)
    await service.locks.acquire(stored_id)
    try:
        release = await service.claim_turn(store, stored_id)
        try:

            def add() -> list[Any]:
                if system_prompt is not None:
                    store.update_conversation(stored_id, system_prompt=system_prompt)
                return store.add_messages(stored_id, messages) if messages else []

            added = await asyncio.to_thread(add)
        finally:
            await release()
    except ConversationNotFound:
        raise not_found() from None
    finally:
        service.locks.release(stored_id)
    data = items_of(added)
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": False,
    }


@router.get(
    "/v1/conversations/{conversation}/items/{item_id}", responses=ERRORS, tags=["conversations"]
)
async def get_item(
    conversation: ConversationId, item_id: ItemId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    store, stored_id = await _owned(service, tenant, conversation)
    position = item_position(item_id)
    if position is not None:
        found = await asyncio.to_thread(store.messages, stored_id, from_position=position)
        for m in found[:1]:
            for item in message_items(m):
                if item["id"] == item_id and m.position == position:
                    return item
    raise not_found("item")


@router.delete(
    "/v1/conversations/{conversation}/items/{item_id}", responses=ERRORS, tags=["conversations"]
)
async def delete_item(
    conversation: ConversationId, item_id: ItemId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """Refused: a conversation's history stays whole (its summary, cache and recall stand on
    it). Fork it instead: a response with ``previous_response_id`` goes on from there."""
    await _owned(service, tenant, conversation)
    raise APIError(
        400,
        "chatctx keeps a conversation's items whole; delete the conversation, or go on from "
        "an earlier response with previous_response_id (a branch without what followed)",
        param="item_id",
        code="unsupported_operation",
    )


async def _owned(service: Service, tenant: Tenant, conversation: str) -> tuple[Store, str]:
    store, _ = service.require_ready()
    stored_id = tenant.stored_id(conversation)
    if not await asyncio.to_thread(store.has_conversation, stored_id):
        raise not_found()
    return store, stored_id


def _message(m: Any) -> dict[str, Any]:
    out = {
        "id": m.id,
        "position": m.position,
        "role": m.role,
        "content": m.content,
        "status": m.status,
        "created_at": m.created_at,
    }
    if m.name is not None:
        out["name"] = m.name
    return out


@router.get("/v1/conversations", responses=ERRORS, tags=["conversations"])
async def list_conversations(
    tenant: TenantDep,
    service: ServiceDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=128)] = None,
) -> dict[str, Any]:
    """This tenant's conversations ordered by id; page on with ``after`` = the last id."""
    store, _ = service.require_ready()
    prefix = tenant.stored_id("")
    rows = await asyncio.to_thread(
        store.conversations_page,
        prefix=prefix,
        after=None if after is None else prefix + after,
        limit=limit + 1,  # one more tells whether there is a next page
    )
    mine = [(tenant.client_id(c.id), c) for c in rows]
    page = mine[:limit]
    data = [
        {
            "id": cid,
            "object": "conversation",
            "created_at": c.created_at,
            "updated_at": c.updated_at,
            "metadata": c.metadata or {},
            "message_count": c.message_count,
        }
        for cid, c in page
    ]
    return _json(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(mine) > limit,
        }
    )


@router.get("/v1/conversations/{conversation}", responses=ERRORS, tags=["conversations"])
async def get_conversation(
    conversation: ConversationId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """OpenAI's conversation object, with chatctx's stored settings and whole history."""
    store, stored_id = await _owned(service, tenant, conversation)

    def read() -> dict[str, Any]:
        c = store.get_conversation(stored_id)
        return {
            **_conversation_object(conversation, c),
            "updated_at": c.updated_at,
            "system_prompt": c.system_prompt,
            "settings": c.settings,
            "message_count": c.message_count,
            "messages": [_message(m) for m in store.messages(stored_id)],
        }

    return _json(await asyncio.to_thread(read))


@router.delete("/v1/conversations/{conversation}", responses=ERRORS, tags=["conversations"])
async def delete_conversation(
    conversation: ConversationId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """Delete the conversation and everything stored with it (waits for a turn in flight)."""
    store, stored_id = await _owned(service, tenant, conversation)
    await service.locks.acquire(stored_id)
    try:
        await service.forget(stored_id)
        try:
            await asyncio.to_thread(store.delete_conversation, stored_id)
        except ConversationNotFound:
            raise not_found() from None
    finally:
        service.locks.release(stored_id)
    return {"id": conversation, "object": "conversation.deleted", "deleted": True}


@router.get(
    "/v1/conversations/{conversation}/export",
    responses=ERRORS,
    tags=["conversations"],
    response_class=Response,
)
async def export(conversation: ConversationId, tenant: TenantDep, service: ServiceDep) -> Response:
    """The conversation as one JSON Lines record (``chatctx import`` reads it back)."""
    store, stored_id = await _owned(service, tenant, conversation)
    record = await asyncio.to_thread(export_conversation, store, stored_id)
    record["id"] = conversation
    line = json_line(record, default=str) + "\n"
    return Response(line, media_type="application/x-ndjson")


@router.get("/v1/conversations/{conversation}/inspect", responses=ERRORS, tags=["conversations"])
async def inspect(
    conversation: ConversationId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """The last context plan, the running summary and every eviction (``chatctx inspect``)."""
    store, stored_id = await _owned(service, tenant, conversation)

    def read() -> dict[str, Any]:
        c = store.get_conversation(stored_id)
        state = store.context_state(stored_id)
        turns = store.turns(stored_id)
        summaries = store.summaries(stored_id)
        plans = [(n, t.plan) for n, t in enumerate(turns, start=1) if t.plan]
        summary = None
        if state.summary is not None:
            summary = asdict(state.summary)
            summary.pop("conversation_id", None)
        return {
            "conversation": conversation,
            "messages": c.message_count,
            "window_start": state.window_start,
            "pending_ids": list(state.pending_ids),
            "summary": summary,
            "summary_versions": len(summaries),
            "current_plan": plans[-1][1] if plans else None,
            "evictions": [{"turn": n, **p} for n, p in plans if p.get("evicted")],
        }

    return _json(await asyncio.to_thread(read))


@router.get("/v1/conversations/{conversation}/stats", responses=ERRORS, tags=["conversations"])
async def stats(
    conversation: ConversationId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """Every turn's token, KV and timing figures with totals (``chatctx stats``)."""
    store, stored_id = await _owned(service, tenant, conversation)
    turns = await asyncio.to_thread(store.turns, stored_id)
    rows = []
    for number, t in enumerate(turns, start=1):
        row = asdict(t)
        row.pop("conversation_id", None)
        rows.append({"turn": number, **row})
    return _json({"conversation": conversation, "turns": rows, "totals": totals(turns).as_dict()})
