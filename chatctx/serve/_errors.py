"""HTTP errors in OpenAI's shape, and the one place chatctx errors become them.

Every error response is ``{"error": {"message", "type", "param", "code"}}``; nothing else
(no traceback, no framework page) reaches a client::

    APIError                  raised by the routes with status, type, param and code
    chatctx errors            -> from_chatctx(): ConversationNotFound 404,
                                 ContextBudgetError 400 context_length_exceeded,
                                 ConfigError 400, ClosedError / ModelError / KVCacheError /
                                 StoreError / BackendUnavailable 503 (Retry-After; with
                                 x-should-retry: false once the user message is stored),
                                 GenerationError and the rest 500
    RequestValidationError    -> 400 with the offending field as ``param``
    HTTPException (404, 405)  -> the same shape
    anything else             -> 500 "internal error" (logged with its traceback)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatctx.errors import (
    BackendUnavailable,
    ChatctxError,
    ClosedError,
    ConfigError,
    ContextBudgetError,
    ConversationNotFound,
    KVCacheError,
    ModelError,
    StoreError,
)

logger = logging.getLogger("chatctx.serve")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def not_found(what: str = "conversation") -> APIError:
    # The same answer whether the id never existed or belongs to another tenant.
    return APIError(404, f"no {what} with that id", code=f"{what}_not_found")


def from_chatctx(exc: ChatctxError, *, retry_after: int = 1) -> APIError:
    """The HTTP error for a chatctx error (the only place they are translated)."""
    if isinstance(exc, ConversationNotFound):
        return not_found()
    if isinstance(exc, ContextBudgetError):
        return APIError(
            400,
            f"{exc} (prompt {exc.prompt_tokens} tokens, budget {exc.budget}, n_ctx {exc.n_ctx})",
            param="messages",
            code="context_length_exceeded",
        )
    if isinstance(exc, ConfigError):
        return APIError(400, str(exc), param=exc.field, code="invalid_value")
    unavailable = (ClosedError, ModelError, KVCacheError, StoreError, BackendUnavailable)
    if isinstance(exc, unavailable):
        logger.warning("answered 503: %s: %s", type(exc).__name__, exc)
        return APIError(
            503,
            "the service cannot answer now, try again",
            code=type(exc).__name__,
            headers={"Retry-After": str(retry_after)},
        )
    logger.error("answered 500: %s: %s", type(exc).__name__, exc)
    return APIError(500, "the model failed to answer", code=type(exc).__name__)


def stored_already(error: APIError, stored: bool) -> APIError:
    """``error`` told not to be retried when its turn's user message was ``stored``: a
    client that sends the request again (the official ones do, after a 5xx) would store it
    twice."""
    if stored:
        error.headers.pop("Retry-After", None)
        error.headers["x-should-retry"] = "false"
    return error


# Errors raised by chatctx's own request checks (``_schemas``): their code is their type.
_CUSTOM = frozenset(
    {
        "unsupported_parameter",
        "invalid_stop",
        "invalid_stream_options",
        "unsupported_content",
        "invalid_text",
        "invalid_value",
        "invalid_metadata",
    }
)


def _param(loc: Sequence[Any]) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a request that did not validate, OpenAI style."""
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    kind = str(first.get("type", ""))
    loc = list(first.get("loc", ()))
    param = _param(loc)
    if kind == "extra_forbidden":
        return APIError(
            400,
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    ctx = first.get("ctx") or {}
    if kind in _CUSTOM:
        named = param if param and param != "body" else ctx.get("name")
        return APIError(400, str(first.get("msg")), param=named, code=kind)
    body_kinds = ("model_attributes_type", "dict_type", "model_type")
    if kind == "json_invalid" or (param is None and kind in body_kinds):
        return APIError(400, "the request body is not a JSON object", code="invalid_json")
    if kind == "missing":
        return APIError(400, f"missing required parameter: {param}", param=param, code=kind)
    message = str(first.get("msg", "invalid value"))
    return APIError(400, f"{message} ({param})" if param else message, param=param, code=kind)


def install_handlers(app: FastAPI) -> None:
    """Answer every error raised in the app in OpenAI's shape."""

    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def chatctx_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ChatctxError)
        return from_chatctx(exc).response()

    async def invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).response()

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return APIError(404, "no such endpoint", code="unknown_url").response()
        if exc.status_code == 405:
            return APIError(405, "method not allowed", code="method_not_allowed").response()
        return APIError(exc.status_code, str(exc.detail)).response()

    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error", exc_info=exc)
        return APIError(500, "internal error", code="internal_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(ChatctxError, chatctx_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
