"""``/v1/responses``: OpenAI's Responses API on chatctx's stored conversations.

A response is one turn of a stored conversation (``chatctx.store.StoredResponse``: the range
of its messages). Where its history comes from:

- ``previous_response_id``: the conversation that response belongs to. When that response is
  its conversation's last, the turn continues it (its cache is warm); otherwise the request
  forks the history: a new conversation of the messages up to that response, fitted,
  summarized and recalled on its own from then on.
- ``conversation``: a conversation made with ``POST /v1/conversations`` (or any stored one).
- neither: a new conversation, named after the response.

``store: false`` keeps nothing: the turn runs on an in-memory copy (as stateless chat
completions do), after the history of ``previous_response_id`` when there is one.
``instructions`` are the system prompt of this turn only. ``truncation: auto`` is chatctx's
own fitting (whole turns out, summary, recall); ``disabled`` (OpenAI's default) answers 400
when the whole history does not fit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse, Response

from chatctx._json import json_line
from chatctx.backends.swap import SwapEntry
from chatctx.errors import ChatctxError, ConfigError, ConversationNotFound
from chatctx.serve._chat import (
    HTTPTurn,
    SSEResponse,
    TurnSpec,
    first_delta,
    make_ask,
    open_turn_for,
    split_messages,
)
from chatctx.serve._errors import APIError, from_chatctx, not_found, stored_already
from chatctx.serve._items import call_item, chat_messages, message_item, split_system
from chatctx.serve._schemas import ChatMessage, _Strict
from chatctx.serve._service import Service
from chatctx.serve._tenants import Tenant
from chatctx.session import ChatSession
from chatctx.settings import ContextSettings, ConversationSettings, GenerationSettings
from chatctx.store import Store, StoredResponse

logger = logging.getLogger("chatctx.serve")

RESPONSE_ID = r"^resp_[0-9a-f]{32}$"


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (and ``/v1/responses/input_tokens``)."""

    model: str | None = Field(None, max_length=256, description="Any name: one model is served.")
    input: str | list[dict[str, Any]] = Field(
        description="The new input: a user text, or items (message, function_call, "
        "function_call_output)."
    )
    instructions: str | None = Field(None, description="This turn's system prompt.")
    previous_response_id: str | None = Field(None, max_length=200)
    conversation: str | dict[str, Any] | None = None
    store: bool = True
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    # Accepted and ignored: they ask for nothing chatctx would do otherwise.
    include: list[str] | None = None
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)
    service_tier: str | None = None
    # Known fields accepted only with their no-op values.
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(None, ge=1)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        check_metadata(value)
        return value

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        fmt = (self.text or {}).get("format")
        unsupported = {
            "text": fmt not in (None, {"type": "text"}),
            "reasoning": bool({k: v for k, v in (self.reasoning or {}).items() if v is not None}),
            "background": bool(self.background),
            "top_logprobs": bool(self.top_logprobs),
            "prompt": self.prompt is not None,
        }
        for name, refused in unsupported.items():
            if refused:
                raise PydanticCustomError(
                    "unsupported_parameter",
                    "{name} is not supported by chatctx serve",
                    {"name": name},
                )
        if self.previous_response_id is not None and self.conversation is not None:
            raise PydanticCustomError(
                "invalid_value",
                "previous_response_id and conversation cannot both be given",
                {"name": "conversation"},
            )
        return self

    def conversation_id(self) -> str | None:
        value = self.conversation
        if isinstance(value, dict):
            value = value.get("id")
            if not isinstance(value, str):
                raise APIError(400, "conversation.id must be a string", param="conversation.id")
        return value


def check_metadata(value: dict[str, str] | None) -> None:
    """OpenAI's limits: at most 16 pairs, keys of 64 characters, values of 512."""
    if value is None:
        return
    if len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
        raise PydanticCustomError(
            "invalid_metadata",
            "metadata takes at most 16 pairs, keys of at most 64 characters and values of "
            "at most 512",
            {},
        )


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) as chat tools (``function`` nested)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"tools of type {tool.get('type')} are not supported (function only)",
                param=f"tools[{i}].type",
                code="unsupported_value",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(
            400,
            "tool_choice must be none, auto, required or {type: function, name}",
            param="tool_choice",
            code="unsupported_value",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class _Moved(ConfigError):
    """The previous response's conversation went on meanwhile: fork it instead."""


@dataclass
class _Request:
    """A responses request resolved: what the turn stores and where."""

    body: ResponsesRequest
    id: str
    messages: list[ChatMessage]  # the new input, less system messages
    system_prompt: str | None
    previous: StoredResponse | None = None
    stored_id: str | None = None  # None: nothing kept (store false)
    conversation: str | None = None  # the Conversations API id to echo
    history: list[dict[str, Any]] = field(default_factory=list)  # store false: the chain
    created_at: int = field(default_factory=lambda: int(time.time()))
    # Read in the turn's worker thread: where its input and output begin.
    start: int = 0
    output_start: int = 0


def _resolve(tenant: Tenant, body: ResponsesRequest, max_chars: int) -> _Request:
    items = chat_messages(body.input)
    if not items:
        raise APIError(400, "input has no items", param="input", code="invalid_value")
    systems, messages = split_system(items)
    texts = [t for t in [body.instructions, *systems] if t]
    return _Request(
        body=body,
        id=new_response_id(),
        messages=messages,
        system_prompt="\n\n".join(texts) if texts else None,
    )


async def _place(service: Service, tenant: Tenant, request: _Request, *, fork: bool) -> None:
    """Where the turn's history comes from and where it is stored (see the module doc)."""
    store, _ = service.require_ready()
    body = request.body
    conversation = body.conversation_id()
    if conversation is not None:
        if not body.store:
            raise APIError(400, "store: false cannot add to a conversation", param="store")
        stored_id = tenant.stored_id(conversation)
        if not await asyncio.to_thread(store.has_conversation, stored_id):
            raise not_found("conversation")
        request.stored_id, request.conversation = stored_id, conversation
        return
    if body.previous_response_id is None:
        request.stored_id = tenant.stored_id(request.id) if body.store else None
        return
    previous = await asyncio.to_thread(
        store.get_response, tenant.stored_id(body.previous_response_id)
    )
    if previous is None:
        raise APIError(
            404,
            f"previous response {body.previous_response_id!r} not found",
            param="previous_response_id",
            code="not_found",
        )
    request.previous = previous
    if not body.store:
        messages = await asyncio.to_thread(store.messages, previous.conversation_id)
        request.history = [m.to_openai() for m in messages if m.position < previous.end]
        return
    count = (
        await asyncio.to_thread(store.get_conversation, previous.conversation_id)
    ).message_count
    if count == previous.end and not fork:
        request.stored_id = previous.conversation_id
        return
    request.stored_id = tenant.stored_id(request.id)
    await asyncio.to_thread(
        store.fork_conversation, previous.conversation_id, request.stored_id, upto=previous.end
    )
    await asyncio.to_thread(
        copy_cache, service.backend, previous.conversation_id, request.stored_id
    )


def copy_cache(backend: Any, source: str, target: str) -> bool:
    """Give a branch a copy of the cache of the conversation it was forked from, so its first
    turn reuses the prefix they share (best effort: False when nothing was copied).

    The engine's state is taken out of its slot (or swap) and kept again for both; a
    llama-server's slot is saved to a file and restored into a slot of the branch's.
    """
    export = getattr(backend, "export_state", None)
    keep = getattr(backend, "import_state", None)
    if export is None or keep is None:
        return False  # a router: the branch is prefilled where it is placed
    try:
        state = export(source)
        if state is None:
            return False
        if isinstance(state, SwapEntry):  # taken out of the engine: it goes back as well
            keep(source, state)
            state = dataclasses.replace(state, owner=target)
        return bool(keep(target, state))
    except ChatctxError as exc:
        logger.warning("the branch %s starts without a cache: %s", target, exc)
        return False


def _spec(service: Service, tenant: Tenant, request: _Request) -> TurnSpec:
    body = request.body
    limits = service.config.limits
    history = [ChatMessage.model_validate(m) for m in request.history]
    system = (
        [ChatMessage(role="system", content=request.system_prompt)] if request.system_prompt else []
    )
    plan = split_messages([*system, *history, *request.messages], limits.max_message_chars)
    overrides = {
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
    }
    generation = GenerationSettings.model_validate(
        {k: v for k, v in overrides.items() if v is not None}
    )
    tools = _chat_tools(body.tools)
    ask = make_ask(
        plan,
        tools=tools,
        tool_choice=_chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )
    expected = request.previous.end if request.previous is not None else None
    added = 1 if plan.text is not None else len(plan.results)
    session_of: dict[str, ChatSession] = {}

    def count(session: ChatSession) -> int:
        try:
            return session.store.get_conversation(session.conversation_id).message_count
        except ConversationNotFound:
            return 0

    def before(session: ChatSession) -> None:
        session_of["s"] = session
        request.start = count(session)
        if request.stored_id is not None and expected is not None and request.start != expected:
            raise _Moved("the previous response's conversation went on meanwhile")
        if body.truncation != "auto":
            _whole(session, _stored_history(session), plan, generation, tools)

    def after(session: ChatSession) -> None:
        request.output_start = count(session) + added

    client_id = None if request.stored_id is None else tenant.client_id(request.stored_id)
    return TurnSpec(
        plan=plan,
        generation=generation,
        ask=ask,
        conversation=client_id,
        stored_id=request.stored_id,
        opening=[(m.stored_role, m.text()) for m in [*system, *history, *request.messages][:2]],
        # Instructions hold for this turn only; a conversation's system items stay.
        replace_system=request.conversation is None,
        before_apply=before,
        after_apply=after,
    )


def _added(plan: Any) -> list[dict[str, Any]]:
    """The chat messages a request adds to its conversation (earlier items, then its user
    message or its results)."""
    added = [{k: v for k, v in m.items() if v is not None} for m in plan.earlier]
    if plan.text is not None:
        return [*added, {"role": "user", "content": plan.text}]
    return added + [{"role": "tool", "tool_call_id": c, "content": o} for _, c, o in plan.results]


def _whole(
    session: ChatSession,
    history: list[dict[str, Any]],
    plan: Any,
    generation: GenerationSettings,
    tools: list[dict[str, Any]] | None,
) -> int:
    """``truncation: disabled``: the prompt tokens of ``history`` and what the request adds,
    sent whole; a ``ContextBudgetError`` (400) when they do not fit."""
    store, cid = session.store, session.conversation_id
    try:
        context = ConversationSettings.parse(store.get_conversation(cid).settings).context
    except ConversationNotFound:
        context = ContextSettings()
    settings = ConversationSettings(generation=generation, context=context)
    return session.check_whole(
        history + _added(plan), settings, system_prompt=plan.system_prompt, tools=tools
    )


def _stored_history(session: ChatSession, upto: int | None = None) -> list[dict[str, Any]]:
    try:
        messages = session.store.messages(session.conversation_id)
    except ConversationNotFound:
        return []
    return [m.to_openai() for m in messages if upto is None or m.position < upto]


# the response object ------------------------------------------------------------------------


def usage_of(turn: HTTPTurn) -> dict[str, Any] | None:
    reply = turn.run.reply
    if reply is None or reply.turn is None:
        return None
    t = reply.turn
    return {
        "input_tokens": t.prompt_tokens,
        "input_tokens_details": {"cached_tokens": t.reused_tokens},
        "output_tokens": t.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": t.prompt_tokens + t.generated_tokens,
    }


def response_object(
    service: Service,
    request: _Request,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
    chatctx: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body = request.body
    out: dict[str, Any] = {
        "id": request.id,
        "object": "response",
        "created_at": request.created_at,
        "status": status,
        "error": error,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": body.instructions,
        "metadata": body.metadata or {},
        "model": service.model_id,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "conversation": None if request.conversation is None else {"id": request.conversation},
        "store": body.store,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "truncation": body.truncation or "disabled",
        "text": {"format": {"type": "text"}},
        "usage": usage,
    }
    if chatctx is not None:
        out["chatctx"] = chatctx
    return out


def _output(request: _Request, text: str, turn: HTTPTurn) -> list[dict[str, Any]]:
    position = request.output_start
    calls = turn.tool_calls() or []
    status = "completed" if turn.run.finish_reason in ("stop", "tool_calls") else "incomplete"
    items = [] if calls and not text else [message_item(position, text, status=status)]
    return items + [call_item(position, k, c) for k, c in enumerate(calls)]


def _finished(service: Service, request: _Request, turn: HTTPTurn, text: str) -> dict[str, Any]:
    incomplete = turn.run.finish_reason == "length"
    reason = "max_output_tokens" if turn.run.stop_reason == "length" else "interrupted"
    return response_object(
        service,
        request,
        status="incomplete" if incomplete else "completed",
        output=_output(request, text, turn),
        usage=usage_of(turn),
        incomplete=reason if incomplete else None,
        chatctx=turn.extension(),
    )


async def _keep(
    service: Service, request: _Request, turn: HTTPTurn, answer: dict[str, Any]
) -> None:
    """Store the response (its messages are stored already)."""
    if request.stored_id is None:
        return
    store = service.store
    assert store is not None
    reply = turn.run.reply
    end = request.output_start + (1 if reply is not None and reply.message_id is not None else 0)
    stored = StoredResponse(
        id=turn.tenant.stored_id(request.id),
        conversation_id=request.stored_id,
        previous_response_id=request.body.previous_response_id,
        start=request.start,
        output_start=request.output_start,
        end=end,
        status=answer["status"],
        body={k: v for k, v in answer.items() if k != "chatctx"},
    )
    await asyncio.to_thread(store.add_response, stored)


async def create_response(
    service: Service, tenant: Tenant, body: ResponsesRequest, log: dict[str, Any]
) -> Response:
    """Answer ``POST /v1/responses`` (JSON, or its event stream)."""
    log["stream"] = body.stream
    request = _resolve(tenant, body, service.config.limits.max_message_chars)
    retry_after = service.config.limits.retry_after_s
    for attempt in range(2):
        await _place(service, tenant, request, fork=attempt > 0)
        turn = await open_turn_for(service, tenant, _spec(service, tenant, request), log)
        try:
            first = await first_delta(turn, retry_after)
            break
        except APIError as exc:
            if not isinstance(exc.__cause__, _Moved) or attempt:
                raise
    if body.stream:
        return SSEResponse(_events(service, request, turn, first), turn)
    parts = [first] if first else []
    try:
        while (delta := await turn.run.next_delta()) is not None:
            parts.append(delta)
    except ChatctxError as exc:
        error = from_chatctx(exc, retry_after=retry_after)
        raise stored_already(error, turn.run.stored_user) from exc
    finally:
        await turn.close()
    answer = _finished(service, request, turn, "".join(parts))
    await _keep(service, request, turn, answer)
    return JSONResponse(answer)


class _Events:
    """The numbered events of one streamed response."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json_line(data)}\n\n".encode()


async def _events(
    service: Service, request: _Request, turn: HTTPTurn, first: str | None
) -> AsyncIterator[bytes]:
    """created, in_progress, the message item's text as it comes, its calls, then completed
    (or incomplete: cut at ``max_output_tokens``).

    The client's ``responses.stream()`` helper needs ``response.created`` first and
    ``response.completed`` last; an error after the first event is an ``error`` event, then
    ``response.failed``.
    """
    event = _Events()
    start = response_object(service, request, status="in_progress", output=[])
    opened = False
    position = request.output_start
    item_id = message_item(position, "")["id"]
    text = ""

    def open_message() -> bytes:
        nonlocal opened
        opened = True
        item = message_item(position, "", status="in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": []}
        return event("response.output_item.added", output_index=0, item=item) + event(
            "response.content_part.added",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part=part,
        )

    def delta(piece: str) -> bytes:
        return event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=0,
            content_index=0,
            delta=piece,
            logprobs=[],
        )

    try:
        yield event("response.created", response=start) + event(
            "response.in_progress", response=start
        )
        head = b""
        if first:
            text = first
            head = open_message() + delta(first)
            yield head
        try:
            while (piece := await turn.run.next_delta()) is not None:
                out = b"" if opened else open_message()
                text += piece
                yield out + delta(piece)
        except Exception as exc:  # the stream ends with an error event, never cut off
            await turn.close()
            error = (
                from_chatctx(exc)
                if isinstance(exc, ChatctxError)
                else APIError(500, "internal error", code="internal_error")
            )
            failed = response_object(
                service,
                request,
                status="failed",
                output=[],
                error={"code": error.code or "server_error", "message": error.message},
            )
            yield event("error", code=error.code, message=error.message, param=None) + event(
                "response.failed", response=failed
            )
            return
        await turn.close()
        answer = _finished(service, request, turn, text)
        await _keep(service, request, turn, answer)
        last = b""
        for index, item in enumerate(answer["output"]):
            if item["type"] == "message":
                if not opened:
                    last += open_message()
                done_text = item["content"][0]["text"]
                last += event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=done_text,
                    logprobs=[],
                )
                last += event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=item["content"][0],
                )
            else:
                added = {**item, "arguments": "", "status": "in_progress"}
                last += event("response.output_item.added", output_index=index, item=added)
                last += event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
                last += event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            last += event("response.output_item.done", output_index=index, item=item)
        # OpenAI's last event: completed, or incomplete (the reply cut at its token limit).
        yield last + event(f"response.{answer['status']}", response=answer)
    finally:
        await turn.close()


# reading back ------------------------------------------------------------------------------


async def stored_response(service: Service, tenant: Tenant, response_id: str) -> StoredResponse:
    store, _ = service.require_ready()
    found = await asyncio.to_thread(store.get_response, tenant.stored_id(response_id))
    if found is None:
        raise not_found("response")
    return found


async def input_tokens(service: Service, tenant: Tenant, body: ResponsesRequest) -> dict[str, Any]:
    """``POST /v1/responses/input_tokens``: the prompt tokens this request would send.

    Under ``truncation: disabled`` the whole history and the input, as the turn checks them
    (a 400 when they do not fit). Under ``auto`` the prompt the turn would build: planned on
    the conversation itself (its summary and evictions included) when the request goes on
    from its last message with a user message; otherwise on a copy of the history it
    continues. Tool results under ``auto`` count the history whole (an upper bound: the turn
    may fit it). Nothing is stored.
    """
    store, backend = service.require_ready()
    request = _resolve(tenant, body, service.config.limits.max_message_chars)
    conversation = body.conversation_id()
    source: str | None = None
    upto: int | None = None
    if conversation is not None:
        source = tenant.stored_id(conversation)
        if not await asyncio.to_thread(store.has_conversation, source):
            raise not_found("conversation")
    elif body.previous_response_id is not None:
        previous = await stored_response(service, tenant, body.previous_response_id)
        source, upto = previous.conversation_id, previous.end
    spec = _spec(service, tenant, request)
    plan, generation, tools = spec.plan, spec.generation, _chat_tools(body.tools)

    def on(cid: str, where: Store) -> ChatSession:
        return ChatSession(store=where, engine=backend, conversation_id=cid, claim_turns=False)

    def count() -> int:
        if source is not None:
            real = on(source, store)
            history = _stored_history(real, upto)
            if body.truncation != "auto" or plan.text is None:
                return _whole(real, history, plan, generation, tools)
            c = store.get_conversation(source)
            tip = upto is None or c.message_count == upto
            if tip and not plan.earlier and c.system_prompt == plan.system_prompt:
                return len(real.plan(plan.text).tokens)
            settings = ConversationSettings.parse(c.settings).context
        else:
            history, settings = [], ContextSettings()
            if body.truncation != "auto" or plan.text is None:
                ephemeral_store = service.ephemeral
                assert ephemeral_store is not None
                return _whole(on("-", ephemeral_store), [], plan, generation, tools)
        # A copy: the history it continues and the earlier items, then the plan.
        ephemeral = service.ephemeral
        assert ephemeral is not None
        cid = f"tokens-{uuid.uuid4().hex}"
        kept = ConversationSettings(generation=generation, context=settings)
        ephemeral.create_conversation(
            cid, system_prompt=plan.system_prompt, settings=kept.to_json()
        )
        session = on(cid, ephemeral)
        try:
            added = _added(plan)[:-1]  # all but the user message the plan is for
            if history or added:
                ephemeral.add_messages(cid, history + added)
            return len(session.plan(plan.text).tokens)
        finally:
            session.close()
            ephemeral.delete_conversation(cid)

    return {"object": "response.input_tokens", "input_tokens": await asyncio.to_thread(count)}
