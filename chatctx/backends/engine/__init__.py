"""llama.cpp in this process: the ``Engine`` backend and the llama.cpp wrappers under it.

::

    Engine, Generation        a Backend on one model loaded here (slots, KV edits, batching)
    Embedder                  sentence embeddings through llama.cpp (recall by meaning)
    shared_embedder           one Embedder per model file in this process
    local_embedder            the shared default Embedder, or None when none is installed
    NativeModel, NativeContext  owning wrappers over llama.cpp's model and context
    supports_gpu_offload      whether this llama.cpp build can offload to a GPU
    system_info, backend_devices, capture_llama_log, measure_allocations
                              what this llama.cpp build is and what it allocates
    EngineDirectory, live_directories  the per-engine directories of swapped caches

Names are imported on first use (PEP 562): ``import chatctx.backends.engine`` alone loads
nothing, and only the llama.cpp wrappers bring in llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatctx.backends.engine._embedder import Embedder, local_embedder, shared_embedder
    from chatctx.backends.engine._engine import Engine, Generation
    from chatctx.backends.engine._instance import EngineDirectory, live_directories
    from chatctx.backends.engine._native import NativeContext, NativeModel, supports_gpu_offload
    from chatctx.backends.engine._native_info import (
        backend_devices,
        capture_llama_log,
        measure_allocations,
        system_info,
    )

_WHERE = {
    "chatctx.backends.engine._embedder": ("Embedder", "local_embedder", "shared_embedder"),
    "chatctx.backends.engine._engine": ("Engine", "Generation"),
    "chatctx.backends.engine._instance": ("EngineDirectory", "live_directories"),
    "chatctx.backends.engine._native": ("NativeContext", "NativeModel", "supports_gpu_offload"),
    "chatctx.backends.engine._native_info": (
        "backend_devices",
        "capture_llama_log",
        "measure_allocations",
        "system_info",
    ),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = [
    "Embedder",
    "Engine",
    "EngineDirectory",
    "Generation",
    "NativeContext",
    "NativeModel",
    "backend_devices",
    "capture_llama_log",
    "live_directories",
    "local_embedder",
    "measure_allocations",
    "shared_embedder",
    "supports_gpu_offload",
    "system_info",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'chatctx.backends.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return __all__
