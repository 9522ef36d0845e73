"""The ASGI layer under the routes: request ids, body limit, drain refusal, access log.

The access log is one JSON object per request on the ``chatctx.serve.access`` logger:
method, path, route, status, duration, tenant, conversation, token counts, TTFT; never a
message's text.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatctx._json import json_line
from chatctx.serve._errors import APIError
from chatctx.serve._service import Service

access_logger = logging.getLogger("chatctx.serve.access")
LOG_KEY = "chatctx.log"  # the scope key routes add access log fields to
# Answered while draining: probes and scrapes go on until the process exits.
_ALWAYS = frozenset({"/health", "/ready", "/metrics"})


class ServeMiddleware:
    """Wraps the app: every HTTP request is timed, counted and logged."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id", "")[:64] or uuid.uuid4().hex[:16]
        log: dict[str, Any] = {}
        scope[LOG_KEY] = log
        status = 500
        limit = self.service.config.limits.max_body_bytes

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            if self.service.draining and scope["path"] not in _ALWAYS:
                error = APIError(
                    503,
                    "the server is shutting down",
                    code="draining",
                    headers={
                        "Retry-After": str(self.service.config.limits.retry_after_s),
                        "Connection": "close",
                    },
                )
                await error.response()(scope, receive, send_wrapper)
                return
            body = await _read_body(receive, limit, headers.get("content-length"))
            if body is None:
                error = APIError(
                    413,
                    f"the request body is larger than {limit} bytes",
                    code="request_too_large",
                    headers={"Connection": "close"},
                )
                await error.response()(scope, receive, send_wrapper)
                return
            await self.app(scope, _replay(body, receive), send_wrapper)
        finally:
            seconds = time.perf_counter() - started
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.service.metrics.observe_request(scope["method"], template, status, seconds)
            if access_logger.isEnabledFor(logging.INFO):  # off with --no-access-log
                entry = {
                    "ts": round(time.time(), 3),
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "route": template,
                    "status": status,
                    "ms": round(seconds * 1000, 1),
                    "client": (scope.get("client") or ("-",))[0],
                    **log,
                }
                access_logger.info(json_line(entry, default=str))


async def _read_body(receive: Receive, limit: int, declared: str | None) -> bytes | None:
    """The whole request body, or None when it is larger than ``limit`` bytes."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client went away: the app sees an empty body
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the buffered body, then waits for the disconnect."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
