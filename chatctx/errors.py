"""chatctx's one error tree.

::

    ChatctxError
    ├── ConfigError            bad settings, unknown option values
    ├── StoreError             database problems
    │   ├── ConversationNotFound
    │   ├── ContextStateConflict  another writer saved the context state first
    │   └── ImportFormatError  a malformed JSON Lines record (carries the line number)
    ├── ModelError             missing/invalid GGUF, no chat template, load failure
    ├── ContextBudgetError     the prompt cannot fit the token budget
    ├── SummaryError           a summarizer failed (the previous summary stays)
    ├── KVCacheError           llama.cpp found no KV slot or rejected a KV operation
    ├── GenerationError        decoding failed or was aborted
    │   └── BackendUnavailable a backend (a llama-server) is down, loading or unreachable
    ├── DeadlineExceeded       a wait or a piece of work ran past its time limit
    └── ClosedError            a closed engine, context or session was used

Third-party errors are translated where they are raised (``engine/_native.py`` for llama.cpp,
``store/_db.py`` for SQLAlchemy), always ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "ChatctxError",
    "ClosedError",
    "ConfigError",
    "ContextBudgetError",
    "ContextStateConflict",
    "ConversationNotFound",
    "DeadlineExceeded",
    "GenerationError",
    "ImportFormatError",
    "KVCacheError",
    "ModelError",
    "StoreError",
    "SummaryError",
]


class ChatctxError(Exception):
    """Base class of every error chatctx raises."""


class ConfigError(ChatctxError):
    """A setting is missing or invalid; ``field`` names it where it is one of a request's
    (``tools[0].function.name``), for a server's answer."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class StoreError(ChatctxError):
    """The conversation store failed."""


class ContextStateConflict(StoreError):
    """A compare-and-set save of a context state found another writer's newer version."""

    def __init__(self, conversation_id: str, expected: int, found: int) -> None:
        super().__init__(
            f"context state of {conversation_id!r} is at version {found}, not {expected}: "
            "read it again and retry"
        )
        self.conversation_id = conversation_id
        self.expected = expected
        self.found = found


class ConversationNotFound(StoreError):
    """No conversation has this id."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"no conversation with id {conversation_id!r}")
        self.conversation_id = conversation_id


class ImportFormatError(StoreError):
    """A JSON Lines record could not be read; ``line`` is 1-based."""

    def __init__(self, message: str, *, line: int, source: str = "<input>") -> None:
        super().__init__(f"{source}:{line}: {message}" if line > 0 else f"{source}: {message}")
        self.line = line
        self.source = source


class ModelError(ChatctxError):
    """The model file is missing, invalid, or lacks what chatctx needs."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ContextBudgetError(ChatctxError):
    """The prompt does not fit the token budget; nothing was sent or stored."""

    def __init__(self, message: str, *, prompt_tokens: int, budget: int, n_ctx: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.budget = budget
        self.n_ctx = n_ctx


class SummaryError(ChatctxError):
    """A summarizer failed; the previous summary stays."""


class KVCacheError(ChatctxError):
    """llama.cpp could not place tokens in the KV cache (decode returned 1)."""

    def __init__(self, message: str, *, seq_id: int, n_tokens: int, code: int) -> None:
        super().__init__(message)
        self.seq_id = seq_id
        self.n_tokens = n_tokens
        self.code = code


class GenerationError(ChatctxError):
    """Decoding failed (invalid batch, abort, or a fatal llama.cpp error)."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class BackendUnavailable(GenerationError):
    """A backend could not serve: refused connection, still loading (503), dropped mid-reply.

    ``backend`` names it (its URL for a llama-server), ``reason`` is a short word for metrics
    and failover records ("refused", "loading", "disconnected", "timeout", "down"), ``status``
    the HTTP status where there was one. A router marks the backend down and moves the
    conversation; a turn that had produced no text yet is retried elsewhere.
    """

    def __init__(
        self, message: str, *, backend: str, reason: str, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.backend = backend
        self.reason = reason
        self.status = status


class DeadlineExceeded(ChatctxError):
    """A wait (for a slot) or a piece of work (a summary) ran past its time limit.

    ``what`` says which; ``seconds`` is the limit that passed.
    """

    def __init__(self, message: str, *, what: str, seconds: float | None = None) -> None:
        super().__init__(message)
        self.what = what
        self.seconds = seconds


class ClosedError(ChatctxError):
    """A closed engine, model context, sampler or session was used.

    Raised instead of handing llama.cpp a freed pointer (which would crash the process).
    """

    def __init__(self, what: str) -> None:
        super().__init__(f"the {what} is closed")
        self.what = what
