"""llama.cpp in this process: model loading, chat templates, KV sequences, generation.

Names are imported on first use (PEP 562): ``import chatctx.engine`` alone loads nothing,
and only ``Engine`` (``_engine``, ``_native``) brings in llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatctx.backend import (
        Backend,
        GenerationResult,
        KVReport,
        Lease,
        ModelInfo,
        Stream,
        Timings,
        Usage,
    )
    from chatctx.engine._embedder import (
        Embedder,
        default_embedder_path,
        embedder_available,
        shared_embedder,
    )
    from chatctx.engine._engine import Engine, Generation
    from chatctx.engine._gguf import model_facts, read_metadata
    from chatctx.engine._kv import ReusePlan, common_prefix, plan_reuse
    from chatctx.engine._models import default_model_path, resolve_model_path
    from chatctx.engine._template import BUILTIN_FORMATS, ChatTemplate

_WHERE = {
    "chatctx.backend": (
        "Backend",
        "GenerationResult",
        "KVReport",
        "Lease",
        "ModelInfo",
        "Stream",
        "Timings",
        "Usage",
    ),
    "chatctx.engine._embedder": (
        "Embedder",
        "default_embedder_path",
        "embedder_available",
        "shared_embedder",
    ),
    "chatctx.engine._engine": ("Engine", "Generation"),
    "chatctx.engine._gguf": ("model_facts", "read_metadata"),
    "chatctx.engine._kv": ("ReusePlan", "common_prefix", "plan_reuse"),
    "chatctx.engine._models": ("default_model_path", "resolve_model_path"),
    "chatctx.engine._template": ("BUILTIN_FORMATS", "ChatTemplate"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = [
    "BUILTIN_FORMATS",
    "Backend",
    "ChatTemplate",
    "Embedder",
    "Engine",
    "Generation",
    "GenerationResult",
    "KVReport",
    "Lease",
    "ModelInfo",
    "ReusePlan",
    "Stream",
    "Timings",
    "Usage",
    "common_prefix",
    "default_embedder_path",
    "default_model_path",
    "embedder_available",
    "model_facts",
    "plan_reuse",
    "read_metadata",
    "resolve_model_path",
    "shared_embedder",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'chatctx.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return __all__
