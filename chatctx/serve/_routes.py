"""The HTTP routes: chat completions, models, conversations, operations."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from chatctx.monitor import SlotTable, memory_snapshot, prometheus_text
from chatctx.serve._chat import chat_completion
from chatctx.serve._errors import not_found
from chatctx.serve._http import LOG_KEY
from chatctx.serve._items import items_of, page
from chatctx.serve._responses import (
    RESPONSE_ID,
    ResponsesRequest,
    create_response,
    input_tokens,
    stored_response,
)
from chatctx.serve._schemas import CONVERSATION_ID, ChatCompletionRequest, ErrorResponse
from chatctx.serve._service import Service
from chatctx.serve._tenants import Tenant
from chatctx.store import current_revision, head_revision

router = APIRouter()
_bearer = HTTPBearer(auto_error=False, description="An API key from --api-keys.")
ConversationId = Annotated[str, Path(pattern=CONVERSATION_ID, max_length=128)]
ERRORS: dict[int | str, dict[str, Any]] = {
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


@router.post("/v1/chat/completions", responses=ERRORS, tags=["chat"])
async def chat_completions(
    request: Request, body: ChatCompletionRequest, tenant: TenantDep, service: ServiceDep
) -> Response:
    """OpenAI's chat completions; with ``conversation`` the server keeps the history."""
    return await chat_completion(service, tenant, body, request.scope[LOG_KEY])


@router.get("/v1/models", tags=["models"])
async def list_models(tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    """The one model this server runs."""
    return {"object": "list", "data": [_model(service)]}


@router.get("/v1/models/{model}", responses=ERRORS, tags=["models"])
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


# responses ----------------------------------------------------------------------------------

ResponseId = Annotated[str, Path(pattern=RESPONSE_ID, max_length=40)]
Order = Annotated[Literal["asc", "desc"], Query()]
Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str | None, Query(max_length=64)]


@router.post("/v1/responses", responses=ERRORS, tags=["responses"])
async def responses_create(
    request: Request, body: ResponsesRequest, tenant: TenantDep, service: ServiceDep
) -> Response:
    """OpenAI's Responses API: ``previous_response_id`` or ``conversation`` go on from a
    stored history (a response that is not its conversation's last forks it)."""
    return await create_response(service, tenant, body, request.scope[LOG_KEY])


@router.post("/v1/responses/input_tokens", responses=ERRORS, tags=["responses"])
async def responses_input_tokens(
    body: ResponsesRequest, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """The prompt tokens ``POST /v1/responses`` would send for this body (nothing stored)."""
    return await input_tokens(service, tenant, body)


@router.get("/v1/responses/{response_id}", responses=ERRORS, tags=["responses"])
async def responses_get(
    response_id: ResponseId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """A stored response, as it was answered."""
    return (await stored_response(service, tenant, response_id)).body


@router.delete("/v1/responses/{response_id}", responses=ERRORS, tags=["responses"])
async def responses_delete(
    response_id: ResponseId, tenant: TenantDep, service: ServiceDep
) -> dict[str, Any]:
    """Forget a response (its messages stay in their conversation)."""
    store, _ = service.require_ready()
    if not await asyncio.to_thread(store.delete_response, tenant.stored_id(response_id)):
        raise not_found("response")
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", responses=ERRORS, tags=["responses"])
async def responses_input_items(
    response_id: ResponseId,
    tenant: TenantDep,
    service: ServiceDep,
    after: After = None,
    limit: Limit = 20,
    order: Order = "desc",
) -> dict[str, Any]:
    """The items a response was given (its new input, not the history before it)."""
    found = await stored_response(service, tenant, response_id)
    store, _ = service.require_ready()
    messages = await asyncio.to_thread(
        store.messages, found.conversation_id, from_position=found.start
    )
    given = [m for m in messages if m.position < found.output_start]
    return page(items_of(given), after=after, limit=limit, order=order)


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
