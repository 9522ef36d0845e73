"""HTTP to one llama-server: the client, and its errors translated into ``chatctx.errors``.

Every httpx exception and every error body of the server becomes a chatctx error here, in
one place (``translated()`` and ``raise_for_error()``)::

    httpx.ConnectError / ConnectTimeout      BackendUnavailable(reason="refused")
    503 (model loading)                      BackendUnavailable(reason="loading")
    httpx.ReadTimeout / WriteTimeout         BackendUnavailable(reason="timeout")
    connection lost while reading            BackendUnavailable(reason="disconnected")
    other 5xx, other transport errors        BackendUnavailable(reason="down")
    exceed_context_size_error                ContextBudgetError (n_prompt_tokens, n_ctx)
    other 4xx                                GenerationError (code = HTTP status)

A read timeout is ``BackendUnavailable("timeout")``, not ``DeadlineExceeded``: it says the
server stopped answering (a router fails over), while ``DeadlineExceeded`` is for chatctx's
own waits (a slot, a summary's deadline).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

from chatctx.errors import (
    BackendUnavailable,
    ChatctxError,
    ConfigError,
    ContextBudgetError,
    GenerationError,
)

try:
    import httpx
except ImportError:  # pragma: no cover - depends on the install
    httpx = None  # type: ignore[assignment]


def require_httpx() -> None:
    if httpx is None:  # pragma: no cover - depends on the install
        raise ConfigError("LlamaServerBackend needs httpx: pip install 'chatctx[llama-server]'")


@contextlib.contextmanager
def translated(backend: str, what: str) -> Iterator[None]:
    """Raise httpx's transport errors inside as ``BackendUnavailable`` naming ``backend``."""
    try:
        yield
    except ChatctxError:
        raise
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise BackendUnavailable(
            f"{what}: cannot connect to llama-server at {backend} ({exc})",
            backend=backend,
            reason="refused",
        ) from exc
    except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as exc:
        raise BackendUnavailable(
            f"{what}: llama-server at {backend} did not answer in time ({type(exc).__name__})",
            backend=backend,
            reason="timeout",
        ) from exc
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        raise BackendUnavailable(
            f"{what}: the connection to llama-server at {backend} was lost ({exc})",
            backend=backend,
            reason="disconnected",
        ) from exc
    except httpx.HTTPError as exc:
        raise BackendUnavailable(
            f"{what}: llama-server at {backend} failed ({type(exc).__name__}: {exc})",
            backend=backend,
            reason="down",
        ) from exc


def error_of(body: Any) -> dict[str, Any] | None:
    """The ``error`` object of a server reply (``{"error": {...}}``), None when there is none."""
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None


def raise_error(backend: str, what: str, status: int, error: dict[str, Any] | None) -> None:
    """Raise the chatctx error for a failed reply (``status``, the server's ``error`` object)."""
    error = error or {}
    message = str(error.get("message") or f"HTTP {status}")
    kind = str(error.get("type") or "")
    if kind == "exceed_context_size_error" or ("exceed" in message and "context" in message):
        n_prompt = int(error.get("n_prompt_tokens") or 0)
        n_ctx = int(error.get("n_ctx") or 0)
        raise ContextBudgetError(
            f"{what}: llama-server at {backend}: {message}",
            prompt_tokens=n_prompt,
            budget=n_ctx,
            n_ctx=n_ctx,
        )
    if status == 503:
        reason = "loading" if "load" in message.lower() else "down"
        raise BackendUnavailable(
            f"{what}: llama-server at {backend} is unavailable: {message}",
            backend=backend,
            reason=reason,
            status=status,
        )
    if status >= 500 or status == 0:
        raise BackendUnavailable(
            f"{what}: llama-server at {backend} failed: {message}",
            backend=backend,
            reason="down",
            status=status or None,
        )
    raise GenerationError(f"{what}: llama-server at {backend} refused it: {message}", code=status)


def check(response: httpx.Response, backend: str, what: str) -> Any:
    """The JSON body of a read ``response``; its error raised as a chatctx error."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code >= 400 or error_of(body) is not None:
        raise_error(backend, what, response.status_code, error_of(body))
    return body


def sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of an event stream, split at ``\n`` (a ``\r`` before it dropped) only.

    Not httpx's ``iter_lines``: it also splits at U+0085, U+2028 and U+2029, which
    llama-server writes raw inside its JSON when a reply holds one, and the event would
    arrive cut in two. A ``\n`` byte is never part of a longer UTF-8 character.
    """
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.removesuffix(b"\r").decode("utf-8", "replace")


def sse_event(line: str) -> dict[str, Any] | None:
    """The JSON object of one ``data: {...}`` line; None for pings, comments and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    try:
        event = json.loads(data)
    except ValueError as exc:  # not llama-server speaking (a proxy's page, a cut line)
        raise GenerationError(
            f"llama-server sent an event that is not JSON: {data[:200]!r}"
        ) from exc
    return event if isinstance(event, dict) else None
