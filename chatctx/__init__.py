"""chatctx: chatbot context and KV-cache management for llama.cpp and Llama 3 models."""

from chatctx.config import EngineConfig, GenerationSettings, Settings
from chatctx.engine import Engine, GenerationResult, ModelInfo, Timings, Usage
from chatctx.errors import (
    ChatctxError,
    ConfigError,
    ContextBudgetError,
    ConversationNotFound,
    GenerationError,
    ImportFormatError,
    KVCacheError,
    ModelError,
    StoreError,
)
from chatctx.session import ChatSession, Reply
from chatctx.store import Conversation, Message, Store, Turn

__version__ = "0.1.0"

__all__ = [
    "ChatSession",
    "ChatctxError",
    "ConfigError",
    "ContextBudgetError",
    "Conversation",
    "ConversationNotFound",
    "Engine",
    "EngineConfig",
    "GenerationError",
    "GenerationResult",
    "GenerationSettings",
    "ImportFormatError",
    "KVCacheError",
    "Message",
    "ModelError",
    "ModelInfo",
    "Reply",
    "Settings",
    "Store",
    "StoreError",
    "Timings",
    "Turn",
    "Usage",
    "__version__",
]
