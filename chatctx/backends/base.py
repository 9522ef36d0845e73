"""The seam between a conversation and whatever runs the model: engine-free and public.

``ChatSession`` needs a codec, a slot per turn, generation, side completions for summaries
and the room a slot holds, nothing more. Three backends stand on this module: ``Engine``
(llama.cpp in this process), replay's dry run (the tokenizer and a simulated cache, no
weights), and ``LlamaServerBackend`` (llama.cpp's own server over HTTP). Importing it loads
neither llama.cpp nor any engine code::

    Backend        lease/release a slot, generate, side_generate, codec, kv_usage, close
    Stream         a generation in progress: iterate for text, then ``result``
    Codec          render messages (a ``RenderedPrompt``) and count tokens exactly
    TextEmbedder   sentence vectors for recall by meaning (injectable)

and the values a turn carries: ``Lease``, ``GenerationResult`` (``Usage``, ``Timings``,
``KVReport``), ``ModelInfo``, ``MemorySnapshot``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from chatctx.model.kv import KVReport
from chatctx.model.template import RenderedPrompt
from chatctx.model.tools import CallGrammar, ToolFormat

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from chatctx.settings import GenerationSettings

__all__ = [
    "CACHE_EDITS",
    "Backend",
    "Codec",
    "GenerationResult",
    "KVReport",
    "Lease",
    "MemorySnapshot",
    "ModelInfo",
    "RenderedPrompt",
    "Stream",
    "TextEmbedder",
    "Timings",
    "Usage",
    "fit_side",
]


# Strongest first: what a slot's cache keeps of a changed prompt (``Backend.cache_edits``).
CACHE_EDITS = ("in-place", "deletions", "prefix")


# prompts ----------------------------------------------------------------------------------


@runtime_checkable
class Codec(Protocol):
    """A model's chat template and exact tokenizer: what the context builder counts with.

    ``fingerprint`` names the tokenizer and template (cached counts are keyed by it).
    """

    fingerprint: str

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> RenderedPrompt:
        """The prompt text for ``messages``, knowing where their content lies; ``tools``
        (OpenAI function tools) written where the model's template puts them."""
        ...

    @property
    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls (``chatctx.model.tools``)."""
        ...

    def encode_prompt(self, text: RenderedPrompt) -> list[int]:
        """The token ids the model evaluates for a rendered prompt (BOS included)."""
        ...

    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """``encode_prompt(render(messages))``."""
        ...

    def count(self, text: str) -> int:
        """Tokens of ``text`` as plain text (special-token strings stay characters)."""
        ...


# what a turn carries ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lease:
    """A slot leased for one turn of conversation ``owner``; give it back with ``release``."""

    owner: str
    seq_id: int
    swap_in: str | None = None  # "ram" | "disk": the cache was restored from a swap
    swap_in_ms: float | None = None
    swap_in_bytes: int | None = None
    reprefill_reason: str | None = None  # a saved state existed but could not be used
    ticket: int = 0  # tells this lease from a later one of the same slot
    backend: str | None = None  # which backend holds the slot, where several serve


@dataclass(frozen=True, slots=True)
class Usage:
    """Token figures of one generation."""

    prompt_tokens: int
    reused_tokens: int  # taken from the KV cache as they were
    evaluated_tokens: int  # prefilled this turn: what the backend actually decoded
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    """Wall-clock figures of one turn, in milliseconds and tokens per second.

    From the backend, ``ttft_ms`` counts from its first step; a ``ChatSession`` reply counts
    it from the request (``send``/``stream`` called), so it includes ``slot_ms`` (waiting for
    a slot and restoring a swapped cache), ``build_ms`` (context building, summary
    included), ``store_ms`` (database writes before generation) and ``engine_ttft_ms`` (the
    backend's own share, which includes waiting for other streams' decode steps).
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
    """A finished generation: its text and tokens, what it cost, and why it stopped."""

    text: str
    tokens: tuple[int, ...]
    usage: Usage
    timings: Timings
    stop_reason: str  # eog | length | context_full | interrupted | closed | error
    kv: KVReport | None = None
    started_at: float = 0.0  # time.perf_counter() when the backend began this generation
    batch_max: int = 1  # most sequences decoded together in one step of this generation
    slot: int | None = None  # the backend's own slot, where it chose one (llama-server)

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "stop_reason": self.stop_reason,
            "usage": asdict(self.usage),
            "timings": asdict(self.timings),
        }


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a backend runs: the model's facts and how its KV cache is laid out."""

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
    kv_cells: int = 0  # cells allocated for all slots and the summary sequence
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """Memory figures of a backend at one moment, in bytes (None where unknown)."""

    rss_bytes: int | None
    gpu_used_bytes: int | None
    gpu_free_bytes: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_side(
    prompt_tokens: int, side_room: int, settings: GenerationSettings, where: str
) -> GenerationSettings:
    """``settings`` for a side generation (a summary) of a ``prompt_tokens`` prompt in
    ``side_room`` tokens: ``max_tokens`` cut to what is left; ``GenerationError`` when the
    prompt itself does not fit (``where`` names the room in the message)."""
    from chatctx.errors import GenerationError

    room = side_room - prompt_tokens
    if room < 1:
        raise GenerationError(
            f"side prompt of {prompt_tokens} tokens does not fit the {where} ({side_room} tokens)"
        )
    if settings.max_tokens > room:
        return settings.model_copy(update={"max_tokens": room})
    return settings


# the protocols ----------------------------------------------------------------------------


@runtime_checkable
class TextEmbedder(Protocol):
    """Unit-length sentence vectors: what recall by meaning compares.

    ``fingerprint`` names the model (stored vectors are keyed by it); ``prefetch`` embeds in
    the background so that a later ``embed`` of the same texts is a cache hit.
    """

    @property
    def fingerprint(self) -> str: ...

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]: ...

    def prefetch(self, texts: Sequence[str]) -> None: ...


class Stream(Protocol):
    """A generation in progress: iterate for text; ``result`` once it ended.

    It starts when first iterated (or waited on). ``close()`` stops it (stop reason
    ``interrupted``) and returns once the backend has let go of it; a stream closed before
    it started has no result.
    """

    result: GenerationResult | None
    text: str

    def __iter__(self) -> Iterator[str]: ...

    def __next__(self) -> str: ...

    def close(self) -> None: ...

    def wait(self, *, first_token_only: bool = False) -> GenerationResult: ...


@runtime_checkable
class Backend(Protocol):
    """What a conversation needs from the model runtime.

    Slots: ``lease(conversation)`` gives a turn a slot (``Lease.seq_id``) that holds the
    conversation's cache, ``release`` gives it back. ``generate`` on that slot reuses
    whatever of the prompt the slot holds; ``side_generate`` runs a summary where it never
    evicts a customer's cache. Errors are ``chatctx.errors``; nothing else escapes.
    """

    @property
    def n_ctx(self) -> int:
        """Tokens one slot holds: the conversation's prompt and reply together."""
        ...

    @property
    def side_room(self) -> int:
        """Tokens a side completion (a summary) may use; 0 when there is no side sequence."""
        ...

    @property
    def model_name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    @property
    def cache_edits(self) -> str:
        """What of a changed prompt the slot's cache keeps, which decides the prompt layout
        (``ContextSettings.layout`` "auto"): ``"in-place"``, cached runs are moved behind
        inserted text (the in-process engine); ``"deletions"``, runs after a deleted span
        are moved back, but text inserted in front of them hides them (llama-server's cache
        reuse); ``"prefix"``, the common prefix only."""
        ...

    def info(self) -> ModelInfo: ...

    def codec(self) -> Codec: ...

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...

    def lease(self, conversation: str, *, timeout: float | None = None) -> Lease: ...

    def release(self, lease: Lease) -> None: ...

    def pin(self, conversation: str, seq_id: int) -> None: ...

    def unpin(self, conversation: str) -> None: ...

    def generate(
        self,
        prompt: Sequence[int],
        *,
        seq_id: int = 0,
        settings: GenerationSettings | None = None,
        eviction: str = "shift",
        history_start: int | None = None,
        grammar: CallGrammar | None = None,
    ) -> Stream: ...

    def side_generate(
        self,
        prompt: Sequence[int],
        *,
        settings: GenerationSettings,
        background: bool = False,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> str: ...

    def cancel_side(self, cancel: threading.Event) -> None: ...

    def kv_usage(self, *, known: bool = False) -> dict[int, int]:
        """Cells (tokens) each sequence holds now. ``known``: as far as this process knows
        without asking anyone (a remote server's slots as chatctx last sent and received
        them): what a turn's record reads, so that a turn waits for no round trip."""
        ...

    def clear(self, seq_id: int | None = None) -> None:
        """Forget one slot's cache (or every slot's); a running generation's is refused."""
        ...

    def memory(self) -> MemorySnapshot | None:
        """The backend's memory figures now (this process's for an in-process engine)."""
        ...

    def embedder(self) -> TextEmbedder | None:
        """The embedder recall by meaning uses with this backend, None when there is none."""
        ...

    def close(self) -> None: ...
