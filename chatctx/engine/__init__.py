"""llama.cpp engine: model loading, chat templates, KV sequences, generation."""

from chatctx.engine._backend import Backend, Stream
from chatctx.engine._embedder import (
    Embedder,
    default_embedder_path,
    embedder_available,
    shared_embedder,
)
from chatctx.engine._engine import Engine, Generation
from chatctx.engine._gguf import model_facts, read_metadata
from chatctx.engine._kv import KVReport, ReusePlan, common_prefix, plan_reuse
from chatctx.engine._models import default_model_path, resolve_model_path
from chatctx.engine._results import GenerationResult, ModelInfo, Timings, Usage
from chatctx.engine._slots import Lease
from chatctx.engine._template import BUILTIN_FORMATS, ChatTemplate

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
