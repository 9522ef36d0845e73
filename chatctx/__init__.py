"""chatctx: chatbot context and KV-cache management for llama.cpp and Llama 3 models.

Names are imported on first use (PEP 562): ``import chatctx`` (or ``chatctx.session``,
``chatctx.store``) never loads llama.cpp; ``chatctx.Engine`` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatctx.backend import (
        Backend,
        Codec,
        GenerationResult,
        Lease,
        ModelInfo,
        Stream,
        Timings,
        Usage,
    )
    from chatctx.config import EngineConfig, GenerationSettings, Settings
    from chatctx.engine import Engine
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
    )
    from chatctx.router import Router
    from chatctx.session import ChatSession, Reply
    from chatctx.store import Conversation, Message, Store, Turn

__version__ = "0.1.0"

_WHERE = {
    "chatctx.backend": (
        "Backend",
        "Codec",
        "GenerationResult",
        "Lease",
        "ModelInfo",
        "Stream",
        "Timings",
        "Usage",
    ),
    "chatctx.config": ("EngineConfig", "GenerationSettings", "Settings"),
    "chatctx.engine": ("Engine",),
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
    ),
    "chatctx.router": ("Router",),
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
    "ContextStateConflict",
    "Conversation",
    "ConversationNotFound",
    "DeadlineExceeded",
    "Engine",
    "EngineConfig",
    "GenerationError",
    "GenerationResult",
    "GenerationSettings",
    "ImportFormatError",
    "KVCacheError",
    "Lease",
    "Message",
    "ModelError",
    "ModelInfo",
    "Reply",
    "Router",
    "Settings",
    "Store",
    "StoreError",
    "Stream",
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
