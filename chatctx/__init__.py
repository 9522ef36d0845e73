"""chatctx: chatbot context and KV-cache management for llama.cpp and Llama 3 models.

Names are imported on first use (PEP 562): ``import chatctx`` (or ``chatctx.session``,
``chatctx.store``) never loads llama.cpp; ``chatctx.Engine`` does.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatctx.backends.base import (
        Backend,
        Codec,
        GenerationResult,
        Lease,
        ModelInfo,
        Stream,
        TextEmbedder,
        Timings,
        Usage,
    )
    from chatctx.backends.engine import Engine
    from chatctx.backends.llama_server import LlamaServerBackend
    from chatctx.backends.router import Router
    from chatctx.context import Summarizer
    from chatctx.errors import (
        BackendUnavailable,
        ChatctxError,
        ClosedError,
        ConfigError,
        ContextBudgetError,
        ContextStateConflict,
        ConversationNotFound,
        DeadlineExceeded,
        GenerationError,
        ImportFormatError,
        KVCacheError,
        ModelError,
        StoreError,
        SummaryError,
    )
    from chatctx.session import ChatSession, Reply
    from chatctx.settings import (
        ContextSettings,
        ConversationSettings,
        EngineConfig,
        GenerationSettings,
        Settings,
    )
    from chatctx.store import Conversation, Message, Store, Turn

# Declared once, in pyproject.toml; a source tree that was never installed has no metadata.
try:
    __version__ = _metadata.version("chatctx")
except _metadata.PackageNotFoundError:  # pragma: no cover
    __version__ = "0+unknown"

_WHERE = {
    "chatctx.backends.base": (
        "Backend",
        "Codec",
        "GenerationResult",
        "Lease",
        "ModelInfo",
        "Stream",
        "TextEmbedder",
        "Timings",
        "Usage",
    ),
    "chatctx.settings": (
        "ContextSettings",
        "ConversationSettings",
        "EngineConfig",
        "GenerationSettings",
        "Limits",
        "ReplayConfig",
        "ServeConfig",
        "Settings",
    ),
    "chatctx.context": ("Summarizer",),
    "chatctx.backends.engine": ("Engine",),
    "chatctx.errors": (
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
    ),
    "chatctx.backends.llama_server": ("LlamaServerBackend",),
    "chatctx.backends.router": ("Router",),
    "chatctx.session": ("ChatSession", "Reply"),
    "chatctx.store": ("Conversation", "Message", "Store", "Turn"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = [
    "Backend",
    "BackendUnavailable",
    "ChatSession",
    "ChatctxError",
    "ClosedError",
    "Codec",
    "ConfigError",
    "ContextBudgetError",
    "ContextSettings",
    "ContextStateConflict",
    "Conversation",
    "ConversationNotFound",
    "ConversationSettings",
    "DeadlineExceeded",
    "Engine",
    "EngineConfig",
    "GenerationError",
    "GenerationResult",
    "GenerationSettings",
    "ImportFormatError",
    "KVCacheError",
    "Lease",
    "Limits",
    "LlamaServerBackend",
    "Message",
    "ModelError",
    "ModelInfo",
    "ReplayConfig",
    "Reply",
    "Router",
    "ServeConfig",
    "Settings",
    "Store",
    "StoreError",
    "Stream",
    "Summarizer",
    "SummaryError",
    "TextEmbedder",
    "Timings",
    "Turn",
    "Usage",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'chatctx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
