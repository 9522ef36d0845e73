"""The HTTP routes: chat completions, models, conversations, operations."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from chatctx._json import json_line
from chatctx.errors import ConversationNotFound
from chatctx.monitor import SlotTable, memory_snapshot, prometheus_text, totals
from chatctx.serve._chat import chat_completion
from chatctx.serve._errors import not_found
from chatctx.serve._http import LOG_KEY
from chatctx.serve._schemas import CONVERSATION_ID, ChatCompletionRequest, ErrorResponse
from chatctx.serve._service import Service
from chatctx.serve._tenants import Tenant
from chatctx.store import Store, current_revision, export_conversation, head_revision

router = APIRouter()
_bearer = HTTPBearer(auto_error=False, description="An API key from --api-keys.")
ConversationId = Annotated[str, Path(pattern=CONVERSATION_ID, max_length=128)]
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 413, 429, 503)
}


def _json(value: Any) -> dict[str, Any]:
    encoded: dict[str, Any] = jsonable_encoder(value)
    return encoded


# Dependencies are coroutines although nothing in them waits: FastAPI runs a plain function
# in its thread pool, two thread hops per request for a dict lookup and a hash.


async def service_of(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


async def authenticate(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Tenant:
    service: Service = request.app.state.service
    tenant = service.tenancy.authenticate(request.headers.get("authorization"))
    request.scope[LOG_KEY]["tenant"] = tenant.label
    return tenant


TenantDep = Annotated[Tenant, Depends(authenticate)]
ServiceDep = Annotated[Service, Depends(service_of)]


# chat ---------------------------------------------------------------------------------------


@router.post("/v1/chat/completions", responses=_ERRORS, tags=["chat"])
async def chat_completions(
    request: Request, body: ChatCompletionRequest, tenant: TenantDep, service: ServiceDep
) -> Response:
    """OpenAI's chat completions; with ``conversation`` the server keeps the history."""
    return await chat_completion(service, tenant, body, request.scope[LOG_KEY])


@router.get("/v1/models", tags=["models"])
async def list_models(tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    """The one model this server runs."""
    return {"object": "list", "data": [_model(service)]}


@router.get("/v1/models/{model}", responses=_ERRORS, tags=["models"])
async def get_model(model: str, tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    if model != service.model_id:
        raise not_found("model")
    return _model(service)


def _model(service: Service) -> dict[str, Any]:
    return {
        "id": service.model_id,
        "object": "model",
        "created": int(service.started_at),
        "owned_by": "chatctx",
    }


# conversations ------------------------------------------------------------------------------


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


@router.get("/v1/conversations", responses=_ERRORS, tags=["conversations"])
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


@router.get("/v1/conversations/{conversation}", responses=_ERRORS, tags=["conversations"])
async def get_conversation(
    conversation: ConversationId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """The conversation's settings and its whole stored history."""
    store, stored_id = await _owned(service, tenant, conversation)

    def read() -> dict[str, Any]:
        c = store.get_conversation(stored_id)
        return {
            "id": conversation,
            "object": "conversation",
            "created_at": c.created_at,
            "updated_at": c.updated_at,
            "system_prompt": c.system_prompt,
            "settings": c.settings,
            "message_count": c.message_count,
            "messages": [_message(m) for m in store.messages(stored_id)],
        }

    return _json(await asyncio.to_thread(read))


@router.delete("/v1/conversations/{conversation}", responses=_ERRORS, tags=["conversations"])
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
    responses=_ERRORS,
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


@router.get("/v1/conversations/{conversation}/inspect", responses=_ERRORS, tags=["conversations"])
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


@router.get("/v1/conversations/{conversation}/stats", responses=_ERRORS, tags=["conversations"])
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


# operations ---------------------------------------------------------------------------------


@router.get("/health", tags=["operations"])
async def health() -> dict[str, str]:
    """The process answers (it may still be loading the model: see /ready)."""
    return {"status": "ok"}


@router.get("/ready", tags=["operations"])
async def ready(service: ServiceDep) -> JSONResponse:
    """200 once the model is loaded and the database is at the newest migration."""
    body: dict[str, Any] = {
        "ready": False,
        "model_loaded": service.loaded,
        "draining": service.draining,
        "error": service.load_error,
    }
    if service.loaded and service.store is not None:
        engine = service.store.engine
        current = await asyncio.to_thread(current_revision, engine)
        head = head_revision()
        body.update(db_revision=current, db_head=head, model=service.model_id)
        body["ready"] = current == head and not service.draining
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


def slot_table(service: Service) -> SlotTable | None:
    """The engine's slot pool now, when the backend keeps one."""
    backend = service.backend
    read = getattr(backend, "slot_table", None)
    if backend is None or backend.closed or read is None:
        return None
    return SlotTable.from_dict(read(), source="engine")


@router.get("/metrics", response_class=PlainTextResponse, tags=["operations"])
async def metrics(service: ServiceDep) -> PlainTextResponse:
    """Prometheus text: the monitor's KV-cache gauges, HTTP and turn series.

    Per-conversation series only on a server without keys (they name conversations).
    """

    def gather() -> str:
        if not service.loaded or service.backend is None or service.backend.closed:
            return ""
        backend = service.backend
        table = slot_table(service)
        conversations: dict[str, Any] = {}
        if service.tenancy.open and service.store is not None and table is not None:
            live = {r.conversation for r in table.slots if r.conversation}
            live |= {r.conversation for r in table.swapped}
            for cid in sorted(live):
                if service.store.has_conversation(cid):
                    conversations[cid] = service.store.turns(cid)
        return prometheus_text(
            conversations,
            live_cells=backend.kv_usage(),
            n_ctx=backend.info().kv_cells or None,
            live_memory=memory_snapshot(),
            slot_table=table,
        )

    kv = await asyncio.to_thread(gather)
    own = service.metrics.text(turns_in_flight=len(service.cancels), draining=service.draining)
    return PlainTextResponse(kv + own, media_type="text/plain; version=0.0.4")
