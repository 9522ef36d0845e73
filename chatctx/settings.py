"""Settings as pydantic models; environment variables use the ``CHATCTX_`` prefix."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from chatctx.environment import variable
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

# The disk a conversation's swapped KV states may take, for the engine's pool and the
# llama-server slot files alike.
SWAP_DISK_MB = 4096.0

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
    tool_results_keep: int | None = Field(
        2,
        ge=0,
        description="When a prompt goes over `high` (policy watermarks), old tool results are "
        "cleared before whole turns are evicted: the call stays, the result is sent as a stub "
        "naming the tool, the call id and its size (the store keeps it whole, and recall can "
        "bring it back). This many of the newest results stay whole; None: never cleared.",
    )
    tool_result_clear_min: int = Field(
        64,
        ge=1,
        description="Tool results shorter than this many tokens are never cleared (a stub "
        "would save little).",
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
        "speaker, one that points back at something said before, or a request to be "
        "reminded; small talk with a question mark does not), and for another question "
        "only the closest sentence of each match by meaning at least recall_near_similarity "
        "close; any-question: every question in full; always: every message.",
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
        True,
        description="All sequences share one KV buffer (else one stream each: a reply then "
        "never depends on the other conversations served beside it, bit for bit).",
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
        SWAP_DISK_MB, ge=0, description="Disk (under swap_dir) for states that do not fit in RAM."
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
        values: dict[str, object] = {
            "db": variable("CHATCTX_DB", env) or f"sqlite:///{default_home() / 'chatctx.db'}"
        }
        for key in ("model", "n_ctx", "n_gpu_layers"):
            raw = variable(f"CHATCTX_{key.upper()}", env)
            if raw:
                values[key] = raw
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise ConfigError(f"invalid CHATCTX_* environment setting: {exc}") from exc


# A tenant name is a prefix of the stored conversation id (``tenant:id``): it may not hold
# the separator, so one tenant's ids can never be spelled as another's.
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
KEYS_ENV = "CHATCTX_API_KEYS"  # the JSON object itself
KEYS_FILE_ENV = "CHATCTX_API_KEYS_FILE"  # or a file holding it


class Limits(_Model):
    """What one request, one tenant and one conversation may take."""

    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest request body.")
    max_message_chars: int = Field(
        32_000, ge=1, description="Longest message content, in characters."
    )
    max_messages: int | None = Field(
        None,
        ge=1,
        description="Most messages in one request; None: no count (the body's size bounds a "
        "request, 413, and a stateless history longer than the budget is fitted to it: whole "
        "turns dropped from the front).",
    )
    max_concurrent_turns: int = Field(
        8,
        ge=1,
        description="Turns one tenant may have in flight at once; more get 429 with Retry-After.",
    )
    request_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A turn still running after this is cut: the reply so far is stored as "
        "partial and returned (finish_reason length); before any token, 504.",
    )
    conversation_wait_s: float = Field(
        30.0,
        ge=0,
        description="How long a turn waits for an earlier turn of the same conversation "
        "before 409.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long in-flight replies may go on before they are cut "
        "(stored as partial).",
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429 and 503.")


class ServeConfig(_Model):
    """Everything ``create_app`` and ``serve`` need; the CLI builds one from its options."""

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port (0 picks a free one).")
    db: str | None = Field(None, description="SQLAlchemy URL; None = CHATCTX_DB / default.")
    model: str | None = Field(None, description="GGUF path; None = CHATCTX_MODEL / embedded.")
    backend_urls: list[str] = Field(
        default_factory=list,
        description="llama-server URLs to run turns on instead of a local model (several: "
        "conversations are routed, each kept on the server holding its cache; none: "
        "CHATCTX_BACKENDS). The model is then the GGUF the servers run, read for its "
        "tokenizer.",
    )
    slot_save_path: str | None = Field(
        None,
        description="The llama-servers' --slot-save-path (the same path on each): a slot "
        "given to another conversation is saved there and restored when its conversation "
        "comes back. None: no swap (the server's own host-RAM prompt cache still works).",
    )
    summary_slot: bool = Field(
        False,
        description="With llama-servers: keep each server's last slot for background LLM "
        "summaries (conversations whose summarizer is 'llm'). Off: every slot serves "
        "customers, and an LLM summary runs on its conversation's own slot.",
    )
    swap_disk_mb: float = Field(
        SWAP_DISK_MB,
        gt=0,
        description="With slot_save_path: the most the swap files take (the oldest are "
        "deleted beyond it, where that folder is seen from this machine).",
    )
    slots: int = Field(
        4,
        ge=1,
        le=63,
        description="Conversations whose KV caches a local model holds at once (the others "
        "are swapped to RAM, then disk, and restored when they come back).",
    )
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Further Engine.load options for a local model (n_ctx, n_gpu_layers, ...; "
        "a 'slots' here wins over slots).",
    )
    model_id: str | None = Field(
        None, description="Name in /v1/models and responses; None = the model file's name."
    )
    api_keys: dict[str, str] | None = Field(
        None, description="Bearer key -> tenant; None = no keys (loopback only)."
    )
    limits: Limits = Field(default_factory=Limits)
    max_open_sessions: int = Field(
        256, ge=1, description="Conversations whose ChatSession is kept open between turns."
    )


def load_api_keys(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, str] | None:
    """Keys from ``path`` (a JSON object ``{"<key>": "<tenant>"}``), else from the
    environment (``CHATCTX_API_KEYS`` holding the object, or ``CHATCTX_API_KEYS_FILE``
    naming a file); None when none is configured. Malformed keys are a ``ConfigError``."""
    source: str
    keys, keys_file = variable(KEYS_ENV, env), variable(KEYS_FILE_ENV, env)
    if path is not None:
        source = str(path)
        text = _read(Path(path))
    elif keys:
        source, text = KEYS_ENV, keys
    elif keys_file:
        source = keys_file
        text = _read(Path(source))
    else:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: API keys are not JSON: {exc}") from exc
    if not isinstance(data, dict) or not data:
        raise ConfigError(f'{source}: expected a non-empty JSON object {{"<key>": "<tenant>"}}')
    for key, tenant in data.items():
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"{source}: an API key is empty or holds whitespace")
        if not isinstance(tenant, str) or not TENANT_PATTERN.match(tenant):
            raise ConfigError(
                f"{source}: tenant {tenant!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
    return dict(data)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read API keys from {path}: {exc.strerror or exc}") from exc


ReplayMode = Literal["teacher", "regenerate", "dry"]

# A replay's context: what ``ContextSettings`` says, but a budget of 1024 tokens when none
# is given (a replay sizes its own context from the budget, so it cannot derive one from it).
REPLAY_CONTEXT = ContextSettings(budget=1024)


class ReplayConfig(_Model):
    """How logged conversations are replayed. Context fields may be given flat
    (``ReplayConfig(budget=512, low=0.5)``): they are folded into ``context``."""

    mode: ReplayMode = Field(
        "teacher", description="teacher-forced, regenerate, or dry (no model)."
    )
    context: ContextSettings = Field(
        default_factory=lambda: REPLAY_CONTEXT.model_copy(),
        description="How each conversation is fitted to its budget (budget 1024 unless given; "
        "reserve None: 16 teacher-forced, else max_tokens).",
    )
    simulate: Literal["engine", "llama-server"] = Field(
        "engine",
        description="A dry run's simulated cache: the engine's in-place edits, or what "
        "llama-server's cache reuse keeps (the common prefix, then runs after deletions).",
    )
    max_turns: int | None = Field(None, ge=1, description="Replay at most this many user turns.")
    system: str | None = Field(None, description="System prompt replacing the logged one.")
    max_tokens: int = Field(128, ge=1, description="Longest regenerated reply.")
    back_to_back: bool = Field(
        False,
        description="Send each turn as soon as the last is done. By default a summary being "
        "written in the background (summarizer 'llm') is finished first, as the time a person "
        "takes to read and type would let it; back to back it may never finish.",
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_context(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        flat = {key: data[key] for key in ContextSettings.model_fields if key in data}
        given = data.get("context")
        if isinstance(given, ContextSettings):
            given = given.model_dump(exclude_unset=True)
        rest = {key: value for key, value in data.items() if key not in flat}
        if not flat and given is None:
            return rest
        return rest | {"context": {"budget": REPLAY_CONTEXT.budget, **(given or {}), **flat}}

    @model_validator(mode="after")
    def _has_budget(self) -> ReplayConfig:
        if self.context.budget is None:
            raise ValueError("a replay needs a token budget (context.budget)")
        return self

    @property
    def budget(self) -> int:
        assert self.context.budget is not None  # _has_budget
        return self.context.budget

    @property
    def reserve_tokens(self) -> int:
        if self.context.reserve is not None:
            return self.context.reserve
        return self.max_tokens if self.mode == "regenerate" else 16

    def session_context(self) -> ContextSettings:
        """The settings each replayed ``ChatSession`` gets: ``context``, its reserve resolved."""
        return self.context.model_copy(update={"reserve": self.reserve_tokens})
