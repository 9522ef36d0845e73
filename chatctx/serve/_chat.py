"""``POST /v1/chat/completions``: stateful (``conversation``) and stateless turns.

Stateful: the conversation is stored under the tenant's name; leading system messages set
its system prompt, earlier user/assistant messages of the request are appended (less those
the conversation already ends with: a client may send the whole history every turn), the
last (user) message is the turn. The server builds the context itself.

Stateless: the request's messages become an ephemeral conversation in an in-memory store
(deleted after the reply), fitted to the budget like any other (older turns dropped, no
summary, no recall); its slot is named after the chat's opening, so a client resending
the whole history finds its prefix cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from chatctx._json import json_line
from chatctx.errors import ChatctxError, ConfigError, ConversationNotFound
from chatctx.serve._errors import APIError, error_body, from_chatctx, stored_already
from chatctx.serve._schemas import (
    ChatCompletionRequest,
    ChatMessage,
    completion,
    completion_chunk,
    usage_dict,
)
from chatctx.serve._service import STATELESS_CONTEXT, OwnedAs, Service, stateless_owner
from chatctx.serve._tenants import Tenant
from chatctx.serve._turn import Cut, TurnRun
from chatctx.session import Ask, ChatSession, ask_for, check_results, open_turn
from chatctx.settings import ContextSettings, ConversationSettings, GenerationSettings
from chatctx.store import Store

logger = logging.getLogger("chatctx.serve")


STATELESS_PREFIX = "stateless-"  # the stored ids of requests without a conversation


@dataclass
class _Plan:
    """A request split into what is stored and what is sent."""

    system_prompt: str | None
    earlier: list[dict[str, Any]]  # appended before the turn
    text: str | None  # the turn's user message; None when it sends tool results
    # Tool results that continue the open turn: (message index, call id, output).
    results: list[tuple[int, str, str]] = field(default_factory=list)
    # The calls the request's own messages leave waiting (stateless: its whole history).
    calls: list[str] | None = None


def split_messages(messages: list[ChatMessage], max_chars: int) -> _Plan:
    """What of ``messages`` is stored before the turn, the system prompt, and the turn."""
    systems: list[str] = []
    index = 0
    while index < len(messages) and messages[index].stored_role == "system":
        systems.append(messages[index].text())
        index += 1
    rest: list[ChatMessage] = messages[index:]
    for offset, message in enumerate(rest):
        if message.stored_role == "system":
            raise APIError(
                400,
                "system messages must come before the others",
                param=f"messages[{index + offset}].role",
                code="invalid_value",
            )
    for i, message in enumerate(messages):
        if len(message.text()) > max_chars:
            raise APIError(
                400,
                f"message {i} is longer than {max_chars} characters",
                param=f"messages[{i}].content",
                code="string_above_max_length",
            )
    system_prompt = "\n\n".join(systems) if systems else None
    if rest and rest[-1].role == "tool":
        return _results_plan(messages, rest, system_prompt)
    if not rest or rest[-1].role != "user":
        raise APIError(
            400,
            "the last message must be the user's, or tool results",
            param="messages",
            code="invalid_value",
        )
    if not rest[-1].text().strip():
        raise APIError(
            400, "the last message is empty", param=f"messages[{len(messages) - 1}].content"
        )
    return _Plan(
        system_prompt=system_prompt,
        earlier=[m.stored() for m in rest[:-1]],
        text=rest[-1].text(),
    )


def _results_plan(
    messages: list[ChatMessage], rest: list[ChatMessage], system_prompt: str | None
) -> _Plan:
    """A request ending in tool messages: the results of the calls its turn waits for."""
    first = len(rest)
    while first > 0 and rest[first - 1].role == "tool":
        first -= 1
    offset = len(messages) - len(rest)
    results = []
    for i in range(first, len(rest)):
        call_id = rest[i].tool_call_id
        if call_id is None:
            raise APIError(
                400,
                "a tool message needs the tool_call_id of the call it answers",
                param=f"messages[{offset + i}].tool_call_id",
                code="invalid_value",
            )
        results.append((offset + i, call_id, rest[i].text()))
    prior = rest[:first]
    calls = None
    if prior:  # the call message is in the request: the results must answer it
        if prior[-1].role != "assistant" or not prior[-1].tool_calls:
            raise APIError(
                400,
                "tool messages must follow the assistant message whose calls they answer",
                param=f"messages[{offset + first}].role",
                code="invalid_value",
            )
        calls = [call.id for call in prior[-1].tool_calls]
    return _Plan(
        system_prompt=system_prompt,
        earlier=[m.stored() for m in prior],
        text=None,
        results=results,
        calls=calls,
    )


def _generation(request: ChatCompletionRequest) -> GenerationSettings:
    try:
        return GenerationSettings.model_validate(request.generation_overrides())
    except ValidationError as exc:
        raise APIError(400, f"invalid sampling settings: {exc}", code="invalid_value") from exc


def _apply(
    session: ChatSession,
    plan: _Plan,
    generation: GenerationSettings,
    *,
    create: ContextSettings,
    known: bool = False,
    created: Callable[[], None] | None = None,
    replace_system: bool = False,
) -> None:
    """Store the request's system prompt and earlier messages (in the turn's worker thread,
    before the turn begins); its sampling settings go with the turn's user message.
    ``replace_system``: the request's system prompt replaces the stored one even when it has
    none (the Responses API's ``instructions`` are not carried from one request to the next).

    ``known``: this process has got or created the conversation before; it is read once,
    then written once if the request changes its system prompt (the turn reads it again
    itself, and another process may change it meanwhile, so nothing is kept from here).
    Otherwise, or when it was deleted since (by another process), it is got or created here
    (what ``ChatSession.open`` does), a new one with ``create`` as its context settings, and
    ``created`` is called once it exists. A request the conversation's settings refuse (a
    reply limit that leaves no room for a prompt, a user message that cannot fit the budget
    with the system prompt alone) is refused before anything is written.
    """
    store, cid = session.store, session.conversation_id
    conversation = None
    if known:
        with contextlib.suppress(ConversationNotFound):
            conversation = store.get_conversation(cid)
    if conversation is None:
        wanted = ConversationSettings(generation=generation, context=create)
        conversation, new = store.get_or_create_conversation(
            cid, system_prompt=plan.system_prompt, settings=wanted.to_json()
        )
        if created is not None:
            created()
    else:
        new = False
    stored = ConversationSettings.parse(conversation.settings)
    merged = ConversationSettings(generation=generation, context=stored.context)
    session.budget(merged)  # a reply limit that leaves no room for a prompt: ConfigError now
    system_prompt = plan.system_prompt
    if plan.text is not None:
        # A message too long for any prompt: ContextBudgetError now, before anything is written.
        session.check_fits(
            plan.text, merged, system_prompt=system_prompt or conversation.system_prompt
        )
    earlier = _unstored(store, cid, plan.earlier, conversation.message_count)
    if plan.results:
        # The calls answered: those of the request's own call message when it brings one
        # not stored yet (stateless, or a new one), else the stored turn's.
        if earlier:
            waiting = plan.calls
        else:
            turn = open_turn(store.last_turn(cid))
            waiting = turn.waiting_ids if turn is not None else None
        check_results(
            waiting,
            [call_id for _, call_id, _ in plan.results],
            where=lambda i: f"messages[{plan.results[i][0]}]",
            whole="messages",
        )
    if not new and system_prompt != conversation.system_prompt:
        if system_prompt is not None:
            store.update_conversation(cid, system_prompt=system_prompt)
        elif replace_system:
            store.update_conversation(cid, clear_system_prompt=True)
    if earlier:
        store.add_messages(cid, earlier)


def _unstored(
    store: Store, cid: str, earlier: list[dict[str, Any]], stored: int
) -> list[dict[str, Any]]:
    """``earlier`` less what the conversation already ends with: a client that sends the
    whole history every turn (as OpenAI's API wants) gets it stored once. The longest run
    of ``earlier``'s first messages equal (role and text) to the stored ones last is taken
    out."""
    if not earlier or not stored:
        return earlier
    count = min(len(earlier), stored)
    tail = [(m.role, m.content) for m in store.messages(cid, from_position=stored - count)]
    pairs = [(m["role"], m["content"]) for m in earlier]
    for k in range(min(count, len(tail)), 0, -1):
        if pairs[:k] == tail[-k:]:
            return earlier[k:]
    return earlier


@dataclass
class HTTPTurn:
    """Everything one request holds while its reply is generated."""

    service: Service
    tenant: Tenant
    include_usage: bool  # a stream ends with a usage chunk
    session: ChatSession
    run: TurnRun
    cancel: Cut
    conversation: str | None  # the client's id; None when stateless
    stored_id: str
    log: dict[str, Any]
    cleanup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    arrived: float = 0.0  # perf_counter() when the request began to be served
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    _closed: bool = False

    async def close(self) -> None:
        """End the reply if still going, then give back locks and slots (idempotent).

        Shielded: a client that hung up cancels the response's task, and every await after
        that would be cancelled again, leaving the reply unstored, the conversation unlocked
        before it is, and the key's turn uncounted down.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self.run.close()
            finally:
                self.service.turn_ended(self.cancel)
                for step in reversed(self.cleanup):
                    try:
                        await step()
                    except Exception as exc:
                        logger.warning("cleanup after a turn failed: %s", exc)
                self._account()

    def tool_calls(self) -> list[dict[str, Any]] | None:
        reply = self.run.reply
        if reply is None or not reply.tool_calls:
            return None
        return [call.to_openai() for call in reply.tool_calls]

    def usage(self) -> dict[str, Any] | None:
        reply = self.run.reply
        if reply is None or reply.turn is None:
            return None
        t = reply.turn
        return usage_dict(t.prompt_tokens, t.generated_tokens, t.reused_tokens)

    def extension(self) -> dict[str, Any]:
        reply = self.run.reply
        turn = reply.turn if reply is not None else None
        return {
            "conversation": self.conversation,
            "stop_reason": self.run.stop_reason,
            # A stop string ends the reply complete (the stored message says so too).
            "partial": self.run.cut not in (None, "stop")
            or (
                self.run.cut is None
                and reply is not None
                and reply.stop_reason not in ("eog", "length")
            ),
            "turn_id": turn.id if turn is not None else None,
            # What of the history was sent: a stateless one longer than the budget is trimmed.
            "kept_messages": len(reply.plan.kept_ids) if reply and reply.plan else None,
            "evicted_messages": len(reply.plan.evicted_ids) if reply and reply.plan else None,
            "evaluated_tokens": turn.evaluated_tokens if turn is not None else None,
            "ttft_ms": turn.ttft_ms if turn is not None else None,
            "slot": turn.slot if turn is not None else None,
            "swap_in": turn.swap_in if turn is not None else None,
        }

    def queue_ms(self) -> float | None:
        """Waiting in line: for this server's locks and claims, then for the session's
        conversation turn and slot (the turn record's ``queue_ms``)."""
        reply = self.run.reply
        turn = reply.turn if reply is not None else None
        if turn is None or turn.queue_ms is None or self.run.handed_at is None:
            return None
        return max(0.0, self.run.handed_at - self.arrived) * 1000 + turn.queue_ms

    def _account(self) -> None:
        reply = self.run.reply
        turn = reply.turn if reply is not None else None
        finish = self.run.finish_reason
        self.log.update(finish_reason=finish, stop_reason=self.run.stop_reason)
        if turn is None:
            return
        self.log.update(
            prompt_tokens=turn.prompt_tokens,
            cached_tokens=turn.reused_tokens,
            completion_tokens=turn.generated_tokens,
            ttft_ms=None if turn.ttft_ms is None else round(turn.ttft_ms, 1),
            slot=turn.slot,
        )
        self.service.metrics.observe_turn(
            mode="stateful" if self.conversation else "stateless",
            finish=finish,
            prompt=turn.prompt_tokens,
            cached=turn.reused_tokens,
            evaluated=turn.evaluated_tokens,
            completion=turn.generated_tokens,
            ttft_s=None if turn.ttft_ms is None else turn.ttft_ms / 1000,
        )
        self.service.record(
            {
                "tenant": self.tenant.name,
                "conversation": self.conversation,
                "at": time.time(),
                "prompt_tokens": turn.prompt_tokens,
                "cached_tokens": turn.reused_tokens,
                "evaluated_tokens": turn.evaluated_tokens,
                "completion_tokens": turn.generated_tokens,
                "hit_ratio": turn.reused_tokens / turn.prompt_tokens
                if turn.prompt_tokens
                else None,
                "ttft_ms": turn.ttft_ms,
                "queue_ms": self.queue_ms(),
                "slot": turn.slot,
                "swap_in": turn.swap_in,
                "finish_reason": finish,
            }
        )


def _drop(session: ChatSession, ephemeral: Store) -> None:
    """Close a stateless request's session and delete its conversation (if it got one)."""
    session.close()
    with contextlib.suppress(ConversationNotFound):
        ephemeral.delete_conversation(session.conversation_id)


@dataclass
class TurnSpec:
    """What a request asks of one turn, whichever API it came through."""

    plan: _Plan
    generation: GenerationSettings
    ask: Ask
    conversation: str | None  # the client's conversation id; None: stateless
    stored_id: str | None = None  # where it is stored (default: the tenant's name for it)
    stops: list[str] = field(default_factory=list)
    opening: list[tuple[str, str]] = field(default_factory=list)  # a stateless chat's slot
    replace_system: bool = False  # see ``_apply``
    include_usage: bool = False  # a stream ends with a usage chunk
    # Called in the turn's worker thread before and after the request's messages are stored.
    before_apply: Callable[[ChatSession], None] | None = None
    after_apply: Callable[[ChatSession], None] | None = None


def _chat_spec(
    request: ChatCompletionRequest, max_messages: int | None, max_chars: int
) -> TurnSpec:
    if max_messages is not None and len(request.messages) > max_messages:
        raise APIError(
            400,
            f"at most {max_messages} messages per request",
            param="messages",
            code="array_above_max_length",
        )
    plan = split_messages(request.messages, max_chars)
    generation = _generation(request)
    ask = make_ask(
        plan,
        tools=request.tools,
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
    )
    options = request.stream_options
    return TurnSpec(
        plan=plan,
        generation=generation,
        ask=ask,
        conversation=request.conversation,
        stops=request.stop_list(),
        opening=[(m.stored_role, m.text()) for m in request.messages[:2]],
        include_usage=options is not None and options.include_usage,
    )


def make_ask(
    plan: _Plan,
    *,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
) -> Ask:
    """The session's ask for ``plan``: its text or results, with the tools offered."""
    try:
        return ask_for(
            plan.text,
            results={call_id: output for _, call_id, output in plan.results} or None,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
        )
    except ConfigError as exc:
        raise APIError(400, str(exc), param=exc.field, code="invalid_value") from exc


async def open_turn_for(
    service: Service, tenant: Tenant, spec: TurnSpec, log: dict[str, Any]
) -> HTTPTurn:
    """Check limits, take locks and start the reply (its worker thread first stores what the
    request adds: errors there reach the first ``next_delta``, before any output)."""
    arrived = time.perf_counter()
    store, backend = service.require_ready()
    limits = service.config.limits
    plan, generation = spec.plan, spec.generation
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.request_timeout_s
    cleanup: list[Callable[[], Awaitable[None]]] = []

    async def unwind() -> None:
        with anyio.CancelScope(shield=True):
            for step in reversed(cleanup):
                with contextlib.suppress(Exception):
                    await step()

    service.limiter.acquire(tenant)

    async def release_tenant() -> None:
        service.limiter.release(tenant)

    cleanup.append(release_tenant)
    try:
        if spec.conversation is not None:
            stored_id = spec.stored_id or tenant.stored_id(spec.conversation)
            log["conversation"] = spec.conversation
            await service.locks.acquire(stored_id)

            async def release_lock() -> None:
                service.locks.release(stored_id)

            cleanup.append(release_lock)
            # Other serve processes on this database: one turn of a conversation at a time.
            cleanup.append(await service.claim_turn(store, stored_id))
            session, fresh = await service.session(stored_id)
            apply = functools.partial(
                _apply,
                session,
                plan,
                generation,
                create=ContextSettings(),
                known=not fresh,
                created=functools.partial(service.opened.add, stored_id),
                replace_system=spec.replace_system,
            )
        else:
            assert service.ephemeral is not None
            ephemeral = service.ephemeral
            stored_id = f"{STATELESS_PREFIX}{uuid.uuid4().hex}"
            owner = OwnedAs(backend, stateless_owner(tenant.name, spec.opening))
            # Made without the database: the turn's worker thread creates its conversation.
            session = ChatSession(
                store=ephemeral, engine=owner, conversation_id=stored_id, claim_turns=False
            )
            apply = functools.partial(_apply, session, plan, generation, create=STATELESS_CONTEXT)

            async def drop_ephemeral() -> None:
                await asyncio.to_thread(_drop, session, ephemeral)

            cleanup.append(drop_ephemeral)
        # The drain may have begun while this request waited for its conversation: a turn
        # that starts now would be one the drain neither waits for nor cuts.
        service.require_ready()
    except BaseException:
        await unwind()
        raise

    def before() -> None:
        if spec.before_apply is not None:
            spec.before_apply(session)
        apply()
        if spec.after_apply is not None:
            spec.after_apply(session)

    cancel = service.turn_started()
    run = TurnRun(
        session,
        spec.ask,
        stops=spec.stops,
        deadline=deadline,
        cancel=cancel,
        before=before,
        settings=generation,
    )
    return HTTPTurn(
        service=service,
        tenant=tenant,
        include_usage=spec.include_usage,
        session=session,
        run=run,
        cancel=cancel,
        conversation=spec.conversation,
        stored_id=stored_id,
        log=log,
        cleanup=cleanup,
        arrived=arrived,
    )


async def first_delta(turn: HTTPTurn, retry_after: int) -> str | None:
    """The reply's first text; what fails before any output is raised as an HTTP error
    (the turn closed), and so is a reply cut before its first token."""
    try:
        first = await turn.run.next_delta()  # errors before any output are HTTP errors
    except ChatctxError as exc:
        await turn.close()
        error = from_chatctx(exc, retry_after=retry_after)
        raise stored_already(error, turn.run.stored_user) from exc
    except BaseException:
        await turn.close()
        raise
    reply = turn.run.reply
    # A reply cut before its first token: none at all (the engine), or one with no text and
    # so no message (a llama-server stream stopped in its prefill still reports figures).
    if first is None and (reply is None or reply.message_id is None):
        await turn.close()
        if turn.run.cut == "timeout":
            error = APIError(504, "no reply within the request timeout", code="timeout")
        elif turn.run.cut == "drain":
            error = APIError(503, "the server is shutting down", code="draining")
        else:
            error = APIError(503, "the reply was not stored", code="not_stored")
        raise stored_already(error, turn.run.stored_user)
    return first


async def chat_completion(
    service: Service, tenant: Tenant, request: ChatCompletionRequest, log: dict[str, Any]
) -> Response:
    """Answer one chat completion request (JSON, or an SSE stream)."""
    log["stream"] = request.stream
    limits = service.config.limits
    spec = _chat_spec(request, limits.max_messages, limits.max_message_chars)
    turn = await open_turn_for(service, tenant, spec, log)
    retry_after = service.config.limits.retry_after_s
    first = await first_delta(turn, retry_after)
    if request.stream:
        return SSEResponse(_events(turn, first), turn)
    parts = [first] if first else []
    try:
        while (delta := await turn.run.next_delta()) is not None:
            parts.append(delta)
    except ChatctxError as exc:
        error = from_chatctx(exc, retry_after=retry_after)
        raise stored_already(error, turn.run.stored_user) from exc
    finally:
        await turn.close()
    return JSONResponse(
        completion(
            id=turn.id,
            model=service.model_id,
            text="".join(parts),
            finish_reason=turn.run.finish_reason,
            usage=turn.usage(),
            chatctx=turn.extension(),
            created=turn.created,
            tool_calls=turn.tool_calls(),
        )
    )


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json_line(data)}\n\n".encode()


async def _events(turn: HTTPTurn, first: str | None) -> AsyncIterator[bytes]:
    service = turn.service
    model = service.model_id

    def chunk(**kwargs: Any) -> bytes:
        return _sse(completion_chunk(id=turn.id, model=model, created=turn.created, **kwargs))

    try:
        yield chunk(delta={"role": "assistant", "content": first or ""})
        try:
            while (delta := await turn.run.next_delta()) is not None:
                yield chunk(delta={"content": delta})
        except Exception as exc:  # the stream ends with an error event, never cut off
            await turn.close()
            if isinstance(exc, ChatctxError):
                error = from_chatctx(exc)
            else:
                logger.exception("a streamed reply failed")
                error = APIError(500, "internal error", code="internal_error")
            yield _sse(error_body(error.message, type=error.type, code=error.code))
            yield b"data: [DONE]\n\n"
            return
        await turn.close()
        # The last events in one write: the same bytes, one trip through the ASGI stack.
        calls = turn.tool_calls()
        last = b""
        if calls:  # whole, one delta: what the official client's helpers assemble
            last = chunk(delta={"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        last += chunk(delta={}, finish_reason=turn.run.finish_reason, chatctx=turn.extension())
        if turn.include_usage:
            last += chunk(usage=turn.usage())
        yield last + b"data: [DONE]\n\n"
    finally:
        await turn.close()


class SSEResponse(StreamingResponse):
    """A server-sent event stream that ends its turn however the response ends (a client
    gone before the first byte included)."""

    def __init__(self, content: AsyncIterator[bytes], turn: HTTPTurn) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.turn = turn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.turn.close()
