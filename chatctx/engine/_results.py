"""What a generation returns: token figures, timings, the result, and model facts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chatctx.engine._kv import KVReport


@dataclass(frozen=True, slots=True)
class Usage:
    """Token figures of one generation."""

    prompt_tokens: int
    reused_tokens: int  # taken from the KV cache as they were
    evaluated_tokens: int  # prefilled this turn
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    """Wall-clock figures of one turn, in milliseconds and tokens per second.

    From the engine, ``ttft_ms`` counts from its first step; a ``ChatSession`` reply counts
    it from the request (``send``/``stream`` called), so it includes ``slot_ms`` (waiting for
    a slot and restoring a swapped cache), ``build_ms`` (context building, summary
    included), ``store_ms`` (database writes before generation) and ``engine_ttft_ms`` (the
    engine's own share, which includes waiting for other streams' decode steps).
    """

    prefill_ms: float
    ttft_ms: float | None
    decode_ms: float
    decode_tokens_per_s: float | None
    total_ms: float
    build_ms: float = 0.0
    store_ms: float = 0.0
    summary_ms: float = 0.0
    engine_ttft_ms: float | None = None
    slot_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    tokens: tuple[int, ...]
    usage: Usage
    timings: Timings
    stop_reason: str  # eog | length | context_full | interrupted | closed
    kv: KVReport | None = None
    started_at: float = 0.0  # time.perf_counter() when the engine began this generation
    batch_max: int = 1  # most sequences decoded together in one step of this generation

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "stop_reason": self.stop_reason,
            "usage": asdict(self.usage),
            "timings": asdict(self.timings),
        }


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: Path
    architecture: str
    description: str
    n_params: int
    n_layer: int
    n_ctx_train: int
    n_vocab: int
    n_ctx: int
    n_seq_max: int
    chat_template: str  # "gguf", "override" or a built-in format name
    gpu_offload: bool
    kv_bytes_per_token_f16: int | None
    slots: int = 1  # conversations the KV cache is sized for, n_ctx tokens each
    kv_cells: int = 0  # cells llama.cpp allocated for all slots and the summary sequence
    extra: dict[str, Any] = field(default_factory=dict)


__all__ = ["GenerationResult", "ModelInfo", "Timings", "Usage"]
