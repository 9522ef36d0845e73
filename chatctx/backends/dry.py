"""A backend that loads no weights: the tokenizer, a slot pool and a simulated KV cache.

Replay's dry run drives ``ChatSession`` through this backend, the same loop a live run takes
through ``Engine``. Each slot's cache is a mirror list brought to the prompt with the engine's
own planner (``plan_reuse``), with the accounting ``Engine`` reports for a teacher-forced
prefill: so a dry turn's reused, evaluated, evicted and shifted tokens equal a live one's.
With ``cache_edits="deletions"`` it keeps what llama-server's cache reuse keeps instead
(``plan_in_order``), and with ``"prefix"`` the common prefix only.
It assumes what chatctx sets up for a live run: a model whose cache can shift positions and a
free spare sequence on a unified cache (for turns that follow a changed summary).

Nothing is generated: a generation ends at once with no text (a teacher-forced turn stores
the logged reply), and a slot's cache holds exactly the prompt afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from chatctx._resource import Closeable
from chatctx.backends.base import (
    CACHE_EDITS,
    Codec,
    GenerationResult,
    KVReport,
    MemorySnapshot,
    ModelInfo,
    TextEmbedder,
    Timings,
    Usage,
)
from chatctx.backends.engine import local_embedder
from chatctx.backends.pool import PooledLeases, SlotPool
from chatctx.backends.swap import SwapHit
from chatctx.errors import ClosedError, ConfigError, GenerationError
from chatctx.model.kv import SERVER_MIN_CHUNK, plan_in_order, plan_reuse
from chatctx.model.memory import pad256
from chatctx.model.tools import CallGrammar
from chatctx.settings import GenerationSettings

__all__ = ["DryBackend", "DryGeneration"]

_NO_SWAP = SwapHit(None, None, None)
_NO_TIME = Timings(
    prefill_ms=0.0, ttft_ms=None, decode_ms=0.0, decode_tokens_per_s=None, total_ms=0.0
)


class DryGeneration:
    """A generation that evaluates its prompt in the simulated cache and samples nothing.

    Like ``Engine``'s, it starts when first iterated (or waited on); closed before that, it
    leaves the cache as it was and has no result.
    """

    def __init__(
        self,
        backend: DryBackend,
        prompt: list[int],
        seq_id: int,
        eviction: str,
        history_start: int | None,
    ) -> None:
        self.result: GenerationResult | None = None
        self.text = ""
        self._run = (backend, prompt, seq_id, eviction, history_start)
        self._started = False

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if not self._started:
            self._started = True
            backend, prompt, seq_id, eviction, history_start = self._run
            self.result = backend._prefill(prompt, seq_id, eviction, history_start)
        raise StopIteration

    def close(self) -> None:
        self._started = True

    def wait(self, *, first_token_only: bool = False) -> GenerationResult:
        for _ in self:
            pass
        if self.result is None:
            raise GenerationError("the generation was closed before it started")
        return self.result


class DryBackend(PooledLeases, Closeable):
    """``Backend`` for dry runs: ``codec`` tokenizes, ``slots`` simulated KV sequences.

    ``n_ctx`` is rounded up to 256, as ``Engine`` does. A conversation that loses its slot to
    another (more conversations than ``slots``) finds an empty cache when it comes back, as
    with an engine that cannot swap. There is no side sequence (``side_room`` 0).
    """

    def __init__(
        self,
        codec: Codec,
        *,
        n_ctx: int,
        model_path: Path | None = None,
        slots: int = 1,
        cache_edits: str = "in-place",
    ) -> None:
        if cache_edits not in CACHE_EDITS:
            raise ConfigError(f"cache_edits must be one of {', '.join(CACHE_EDITS)}")
        self._cache_edits = cache_edits
        self._codec = codec
        self._n_ctx = pad256(n_ctx)
        self.model_path = model_path
        self.slots = slots
        # The slots, then the spare sequence a live engine parks kept turns on (always empty
        # between turns): kv_usage lists the same sequences as Engine's.
        self._mirror: dict[int, list[int]] = {s: [] for s in range(slots + 1)}
        self._lock = threading.Lock()
        self._closed = False
        self.pool = SlotPool(
            slots, swap_out=self._swap_out, swap_in=lambda seq, owner: (_NO_SWAP, 0.0)
        )

    # facts --------------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def side_room(self) -> int:
        return 0

    @property
    def cache_edits(self) -> str:
        return self._cache_edits

    @property
    def model_name(self) -> str:
        return self.model_path.name if self.model_path is not None else "dry-run"

    @property
    def closed(self) -> bool:
        return self._closed

    def info(self) -> ModelInfo:
        """The vocabulary-only model: figures the GGUF's header gives, no weights loaded."""
        facts: dict[str, Any] = {}
        if self.model_path is not None:
            from chatctx.model.gguf import model_facts, read_metadata

            facts = model_facts(read_metadata(self.model_path))
        return ModelInfo(
            path=self.model_path or Path(self.model_name),
            architecture=str(facts.get("architecture") or "unknown"),
            description="vocabulary only (dry run: no weights loaded)",
            n_params=0,
            n_layer=facts.get("n_layer") or 0,
            n_ctx_train=facts.get("n_ctx_train") or 0,
            n_vocab=facts.get("vocab_size") or 0,
            n_ctx=self._n_ctx,
            n_seq_max=self.slots + 1,
            chat_template=getattr(getattr(self._codec, "template", None), "name", "unknown"),
            gpu_offload=False,
            kv_bytes_per_token_f16=facts.get("kv_bytes_per_token_f16"),
            slots=self.slots,
            kv_cells=0,
            extra={"dry_run": True},
        )

    def codec(self) -> Codec:
        return self._codec

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self._codec.prompt_tokens(messages)

    # slots --------------------------------------------------------------------------------

    # lease, release, pin, unpin: PooledLeases

    def _swap_out(self, seq_id: int, owner: str) -> None:
        with self._lock:
            self._mirror[seq_id].clear()

    # KV cache -----------------------------------------------------------------------------

    def cached_tokens(self, seq_id: int = 0) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._mirror[seq_id])

    def kv_usage(self, *, known: bool = False) -> dict[int, int]:
        with self._lock:
            return {seq: len(tokens) for seq, tokens in self._mirror.items()}

    def memory(self) -> MemorySnapshot | None:
        return None  # no model is loaded: there is nothing to measure

    def embedder(self) -> TextEmbedder | None:
        return local_embedder()

    def clear(self, seq_id: int | None = None) -> None:
        """Forget one sequence (or all)."""
        with self._lock:
            for seq in self._mirror if seq_id is None else [seq_id]:
                self._mirror[seq].clear()
        for seq in range(self.slots) if seq_id is None else [seq_id]:
            self.pool.forget(seq)

    # generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        *,
        seq_id: int = 0,
        settings: GenerationSettings | None = None,
        eviction: str = "shift",
        history_start: int | None = None,
        grammar: CallGrammar | None = None,
    ) -> DryGeneration:
        """Bring slot ``seq_id``'s simulated cache to ``prompt`` once iterated; no text
        (``grammar`` has nothing to hold)."""
        self._check_open()
        if not 0 <= seq_id < self.slots:
            raise ConfigError(f"sequence {seq_id} is not a slot: slots are 0..{self.slots - 1}")
        if eviction not in ("shift", "recompute"):
            raise ConfigError(f"eviction must be 'shift' or 'recompute', not {eviction!r}")
        if not prompt:
            raise GenerationError("empty prompt")
        if len(prompt) >= self._n_ctx:
            raise GenerationError(
                f"prompt of {len(prompt)} tokens does not fit n_ctx={self._n_ctx}"
            )
        return DryGeneration(self, list(prompt), seq_id, eviction, history_start)

    def _prefill(
        self, prompt: list[int], seq_id: int, eviction: str, history_start: int | None
    ) -> GenerationResult:
        # The accounting of Engine's prepare(), on a model that can shift and with the spare
        # sequence free: the moved runs are reused unless the policy is recompute.
        with self._lock:
            self._check_open()
            mirror = self._mirror[seq_id]
            if self._cache_edits == "in-place":
                plan = plan_reuse(mirror, prompt, history_start=history_start)
            else:  # what llama-server keeps, with chatctx's n_cache_reuse or without
                chunk = SERVER_MIN_CHUNK if self._cache_edits == "deletions" else 0
                plan = plan_in_order(mirror, prompt, min_chunk=chunk)
            if plan.chunks and eviction == "shift":
                reused = plan.prefix + plan.chunk_len
                moved = [end - start for start, end, delta in plan.moves() if delta]
                report = KVReport(
                    policy=eviction,
                    reused_tokens=reused,
                    evaluated_tokens=len(prompt) - reused,
                    evicted_tokens=len(mirror) - reused,
                    shifted_tokens=sum(moved),
                    shift_count=len(moved),
                )
            else:
                reused = plan.prefix
                report = KVReport(
                    policy=eviction,
                    reused_tokens=reused,
                    evaluated_tokens=len(prompt) - reused,
                    evicted_tokens=len(mirror) - reused,
                    shifted_tokens=0,
                    shift_count=0,
                    fallback="eviction policy is recompute" if plan.chunks else None,
                )
            # A teacher-forced prefill leaves exactly the prompt; the sampled token is never
            # evaluated.
            mirror[:] = prompt
        return GenerationResult(
            text="",
            tokens=(),
            usage=Usage(
                prompt_tokens=len(prompt),
                reused_tokens=reused,
                evaluated_tokens=len(prompt) - reused,
                generated_tokens=0,
            ),
            timings=_NO_TIME,
            stop_reason="length",
            kv=report,
        )

    def side_generate(
        self,
        prompt: Sequence[int],
        *,
        settings: GenerationSettings,
        background: bool = False,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> str:
        raise ConfigError("a dry run loads no model: it cannot generate (no side sequence)")

    def cancel_side(self, cancel: threading.Event) -> None:
        cancel.set()  # nothing runs on a side sequence here

    # lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.pool.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("dry backend")
