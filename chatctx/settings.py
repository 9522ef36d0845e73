"""Settings as pydantic models; environment variables use the ``CHATCTX_`` prefix."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from chatctx.errors import ConfigError
from chatctx.model.paths import default_home

__all__ = [
    "ContextSettings",
    "ConversationSettings",
    "EngineConfig",
    "GenerationSettings",
    "Settings",
    "default_home",
]

KVType = Literal["f16", "bf16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GenerationSettings(_Model):
    """How replies are sampled; stored with each conversation."""

    max_tokens: int = Field(256, ge=1, description="Most tokens one reply may have.")
    temperature: float = Field(0.7, ge=0.0, description="0 means greedy decoding.")
    top_k: int = Field(40, ge=0, description="Keep the k most likely tokens (0 = off).")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    min_p: float = Field(0.05, ge=0.0, le=1.0, description="Drop tokens below min_p x best.")
    repeat_penalty: float = Field(1.1, ge=0.0, description="Penalty for repeated tokens.")
    repeat_last_n: int = Field(64, ge=0, description="Window for the repeat penalty.")
    seed: int | None = Field(None, ge=0, description="Sampling seed; None = random.")


class ContextSettings(_Model):
    """How history is fitted into the token budget; stored with each conversation."""

    policy: Literal["watermarks", "trim-every-turn"] = Field(
        "watermarks",
        description="watermarks: evict whole turns down to `low` only when over `high`, so "
        "prompts extend each other between evictions; trim-every-turn: drop just enough "
        "every turn (the naive baseline).",
    )
    budget: int | None = Field(
        None, ge=16, description="Prompt token budget; None = n_ctx - reserve."
    )
    reserve: int | None = Field(
        None, ge=0, description="Tokens kept free for the reply; None = max_tokens."
    )
    high: float = Field(1.0, gt=0.0, le=1.0, description="Evict when the prompt exceeds this.")
    low: float = Field(0.6, gt=0.0, le=1.0, description="Evict down to this share of budget.")
    eviction: Literal["shift", "recompute"] = Field(
        "shift",
        description="shift: remove evicted turns from the KV cache in place and move the kept "
        "ones back (no re-prefill); recompute: re-evaluate everything after the first change.",
    )
    layout: Literal["auto", "summary-first", "append", "abridge"] = Field(
        "auto",
        description="Where the running summary goes. summary-first: one section after the "
        "system prompt (the in-process engine moves the kept turns behind a changed summary "
        "without re-evaluating them); append: each addition to the summary is sent where it "
        "was written, after the turns kept then, so a prompt only ever loses whole spans and "
        "grows at its end, which llama-server's cache reuse keeps (it cannot keep what "
        "follows inserted text); abridge (extractive summarizer only): no summary text at "
        "all, each evicted message that said one of its items stays in its place cut down to "
        "those sentences, so a prompt only ever loses text; auto: summary-first when the "
        "backend edits its cache in place, else append.",
    )
    summarizer: Literal["extractive", "llm", "none"] = Field(
        "extractive", description="What folds evicted turns into the running summary."
    )
    summary_max_tokens: int = Field(
        512, ge=16, description="Longest running summary (and at most 60% of the budget)."
    )
    summary_timeout_s: float = Field(60.0, gt=0, description="Give up summarizing after this.")
    truncate_oversized: bool = Field(
        False,
        description="Cut a single message that cannot fit in the middle (with a marker) "
        "instead of raising ContextBudgetError.",
    )
    recall: bool = Field(
        True,
        description="Search the evicted history for what matches the new message (by meaning "
        "or by words, see recall_search) and send the best matches right before it, after the "
        "cached history.",
    )
    recall_budget: int = Field(
        96,
        ge=0,
        description="Most tokens the recalled messages may take (0 = no recall). A message "
        "that asks back is owed this room: when the prompt leaves less, the watermark eviction "
        "is made on this turn instead of a few turns later (policy watermarks).",
    )
    recall_k: int = Field(5, ge=1, le=50, description="Most evicted messages one turn may recall.")
    recall_trigger: Literal["question", "any-question", "always"] = Field(
        "question",
        description="question: recall for a message that asks back (a question about the "
        "speaker, 'what's my dog called?', or pointing back, 'what was it again?'; or "
        "'remind me', 'i forgot what', 'you told me'; talk with a question in it, 'yeah I "
        "know right?', does not), and for another question only the closest sentence of each "
        "match by meaning at least recall_near_similarity close; any-question: every "
        "question in full; always: every message.",
    )
    recall_near_similarity: float = Field(
        0.5,
        ge=-1,
        le=1.01,
        description="With recall by meaning and trigger question: how close a match must be "
        "for a question that does not ask back to recall its closest sentence (above 1: never).",
    )
    recall_search: Literal["auto", "meaning", "words"] = Field(
        "auto",
        description="meaning: rank evicted messages by sentence-embedding similarity to the "
        "new one (all-MiniLM-L6-v2 through llama.cpp); words: full-text search (BM25); auto: "
        "meaning when an embedder is installed, else words.",
    )
    recall_min_similarity: float = Field(
        0.15,
        ge=-1,
        le=1,
        description="With recall by meaning: the least cosine similarity that counts as a match.",
    )

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> ContextSettings:
        if self.low > self.high:
            raise ValueError(f"low watermark {self.low} is above high watermark {self.high}")
        return self


class ConversationSettings(_Model):
    """Everything stored with a conversation: how replies are sampled and how history fits.

    Parsed once from the stored JSON (``parse``); changes are merged with ``updated``.
    """

    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    context: ContextSettings = Field(default_factory=ContextSettings)

    @classmethod
    def parse(cls, stored: Mapping[str, Any] | None) -> ConversationSettings:
        """Settings from a conversation's stored JSON; missing sections take the defaults."""
        data = dict(stored or {})
        try:
            return cls.model_validate(
                {"generation": data.get("generation") or {}, "context": data.get("context") or {}}
            )
        except ValidationError as exc:
            raise ConfigError(f"invalid conversation settings: {exc}") from exc

    def updated(
        self,
        *,
        generation: Mapping[str, Any] | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> ConversationSettings:
        """A copy with some fields changed (validated: a bad value is a ConfigError)."""
        try:
            return ConversationSettings(
                generation=GenerationSettings.model_validate(
                    self.generation.model_dump() | dict(generation or {})
                ),
                context=ContextSettings.model_validate(
                    self.context.model_dump() | dict(context or {})
                ),
            )
        except ValidationError as exc:
            raise ConfigError(f"invalid conversation settings: {exc}") from exc

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class EngineConfig(_Model):
    """How a GGUF is loaded into llama.cpp."""

    model_path: Path = Field(description="Path to a GGUF model file.")
    n_ctx: int = Field(
        4096,
        ge=64,
        description="Context of one conversation in tokens (rounded up to 256); the KV cache "
        "is sized for `slots` of them plus the summary sequence.",
    )
    n_batch: int = Field(512, ge=1, description="Most tokens submitted to one decode call.")
    n_ubatch: int = Field(512, ge=1, description="Physical micro-batch size.")
    prefill_chunk: int | None = Field(
        None,
        ge=1,
        description="Most prompt tokens of one conversation per decode call; running streams "
        "wait for one such call at most. Unset: 256 on the CPU, `n_batch` with layers on a "
        "GPU, where 256-token calls evaluate a prompt 1.3-1.5x slower (bench/README.md, 'On a "
        "GPU').",
    )
    slots: int = Field(
        1, ge=1, le=63, description="Conversations whose caches the engine holds at once."
    )
    n_seq_max: int = Field(
        2,
        ge=1,
        le=64,
        description="Sequences in the context: `slots` plus one reserved for summaries and "
        "reordering (derived from `slots`; 1 means no reserved sequence).",
    )
    kv_unified: bool = Field(
        True, description="All sequences share one KV buffer (else one stream each)."
    )
    summary_room: int | None = Field(
        None,
        ge=0,
        description="Cells kept for the summary sequence in a unified cache; None = "
        "min(n_ctx, 1792).",
    )
    swap_ram_mb: float = Field(
        256, ge=0, description="RAM for KV states of conversations that lost their slot."
    )
    swap_disk_mb: float = Field(
        4096, ge=0, description="Disk (under swap_dir) for states that do not fit in RAM."
    )
    swap_dir: Path | None = Field(
        None, description="Where swapped KV states are kept; None = $CHATCTX_HOME/kv."
    )
    slot_table: Path | None = Field(
        None,
        description="JSON snapshot of the slot pool for `chatctx stats --slots`; None = "
        "$CHATCTX_HOME/slots.json.",
    )
    n_gpu_layers: int = Field(-1, ge=-1, description="Layers offloaded to the GPU (-1 = all).")
    flash_attn: bool | None = Field(
        None,
        description="Flash attention; None = auto (on for a quantized V cache, else llama.cpp "
        "decides). Off with a quantized V cache is a ConfigError.",
    )
    type_k: KVType = Field("f16", description="KV cache type for keys.")
    type_v: KVType = Field("f16", description="KV cache type for values (quantized needs FA).")
    n_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads; None = one per physical core this process may use (its "
        "CPU affinity and quota).",
    )
    chat_format: Literal["llama-3", "chatml"] | None = Field(
        None, description="Built-in chat format to use when the GGUF has no chat template."
    )
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the GGUF's own."
    )
    rope_scaling: Literal["none", "linear", "yarn"] | None = Field(
        None, description="RoPE scaling type; None = the model's own (from the GGUF)."
    )
    rope_freq_base: float | None = Field(
        None, gt=0, description="RoPE base frequency; None = the model's own."
    )
    rope_freq_scale: float | None = Field(
        None, gt=0, description="RoPE frequency scale (linear: trained / wanted context)."
    )
    yarn_orig_ctx: int | None = Field(
        None, ge=1, description="YaRN: the context the model was trained on; None = the GGUF's."
    )

    @model_validator(mode="before")
    @classmethod
    def _kv_cache_types(cls, data: Any) -> Any:
        """Check KV types before llama.cpp sees them; auto flash attention for quantized V."""
        if not isinstance(data, dict):
            return data
        # Imported here: chatctx.backends.engine imports this module.
        from chatctx.model.memory import resolve_flash_attn

        if "slots" in data and "n_seq_max" in data:
            if int(data["n_seq_max"]) not in (int(data["slots"]), int(data["slots"]) + 1):
                raise ConfigError(
                    f"n_seq_max {data['n_seq_max']} does not match slots {data['slots']} "
                    "(n_seq_max is slots + 1: one sequence is reserved for summaries)"
                )
        elif "slots" in data:
            data = {**data, "n_seq_max": int(data["slots"]) + 1}
        elif "n_seq_max" in data:
            data = {**data, "slots": max(1, int(data["n_seq_max"]) - 1)}
        flash = data.get("flash_attn")
        if isinstance(flash, str):
            words = {"auto": None, "on": True, "true": True, "off": False, "false": False}
            if flash.lower() not in words:
                raise ConfigError(f"flash_attn must be on, off or auto, not {flash!r}")
            flash = words[flash.lower()]
        resolved = resolve_flash_attn(
            str(data.get("type_k", "f16")), str(data.get("type_v", "f16")), flash
        )
        return {**data, "flash_attn": resolved}

    @model_validator(mode="after")
    def _kv_cache_types_after(self) -> EngineConfig:
        # Validating an existing instance skips the dict path above: check again.
        from chatctx.model.memory import resolve_flash_attn

        if resolve_flash_attn(self.type_k, self.type_v, self.flash_attn) != self.flash_attn:
            raise ConfigError(f"type_v={self.type_v} needs flash_attn on (it is {self.flash_attn})")
        return self


class Settings(_Model):
    """Application settings, read from ``CHATCTX_*`` environment variables."""

    db: str = Field(description="SQLAlchemy URL of the conversation store (CHATCTX_DB).")
    model: Path | None = Field(None, description="GGUF to use; None = embedded default.")
    n_ctx: int = Field(4096, ge=64, description="Context size in tokens (CHATCTX_N_CTX).")
    n_gpu_layers: int = Field(-1, ge=-1, description="GPU layers (CHATCTX_N_GPU_LAYERS).")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``CHATCTX_*`` variables, with defaults for the rest."""
        env = os.environ if env is None else env
        values: dict[str, object] = {
            "db": env.get("CHATCTX_DB") or f"sqlite:///{default_home() / 'chatctx.db'}"
        }
        for key in ("model", "n_ctx", "n_gpu_layers"):
            raw = env.get(f"CHATCTX_{key.upper()}")
            if raw:
                values[key] = raw
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise ConfigError(f"invalid CHATCTX_* environment setting: {exc}") from exc
