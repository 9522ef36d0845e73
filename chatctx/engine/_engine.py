"""The llama.cpp engine: one model, one context, several sequences, a mirror of each.

For every sequence the engine keeps the exact token list that sits in the KV cache, so a
request reuses the longest common prefix and evaluates only the rest.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from chatctx._resource import Closeable
from chatctx.config import EngineConfig, GenerationSettings
from chatctx.engine import _gguf
from chatctx.engine._codec import PROBES, LlamaCodec, PromptCodec, open_codec
from chatctx.engine._kv import KVReport
from chatctx.engine._models import resolve_model_path
from chatctx.engine._native import NativeContext, NativeModel, Sampler, supports_gpu_offload
from chatctx.engine._results import GenerationResult, ModelInfo, Timings, Usage
from chatctx.engine._sequences import bring_to
from chatctx.engine._template import RenderedPrompt, template_for
from chatctx.errors import ChatctxError, ClosedError, ConfigError, GenerationError, ModelError

logger = logging.getLogger("chatctx.engine")


class Generation:
    """A running generation: iterate for text chunks; ``result`` is set when it ends.

    Closing it early (``close()``, ``break`` + garbage collection) ends it with stop reason
    ``interrupted``; the KV mirror stays exact either way.
    """

    def __init__(
        self,
        engine: Engine,
        seq_id: int,
        prompt: Sequence[int],
        settings: GenerationSettings,
        eviction: str = "shift",
        history_start: int | None = None,
        *,
        background: bool = False,
    ) -> None:
        self.result: GenerationResult | None = None
        self.text = ""
        self.first_token_only = False
        self.background = background
        self._iterator: Generator[str, None, None] = engine._run(
            self, seq_id, list(prompt), settings, eviction, history_start
        )

    def __iter__(self) -> Iterator[str]:
        return self._iterator

    def __next__(self) -> str:
        return next(self._iterator)

    def close(self) -> None:
        self._iterator.close()

    def wait(self, *, first_token_only: bool = False) -> GenerationResult:
        """Run to the end and return the result (or stop once the first token is sampled)."""
        self.first_token_only = first_token_only
        for _ in self._iterator:
            pass
        assert self.result is not None
        return self.result


class Engine(Closeable):
    """llama.cpp with a Llama-3-style GGUF: tokenizer, chat template and KV sequences.

    Use as a context manager; ``close()`` frees the context, then the model.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        meta = _gguf.read_metadata(config.model_path)  # clear error before llama.cpp sees it
        self.facts = _gguf.model_facts(meta)
        self.template = template_for(
            meta,
            chat_template=config.chat_template,
            chat_format=config.chat_format,
            path=str(config.model_path),
        )
        # Every call that touches the llama.cpp context holds this lock: one thread at a time
        # inside a llama_context, and close() waits for the step in progress.
        self._lock = threading.RLock()
        # Background work (summaries) steps aside while a turn's prefill runs: a turn waits
        # for at most one background step, never for a whole summary.
        self._turn = threading.Condition()
        self._prefilling = 0
        self._side = threading.Lock()  # one side generation (on the spare sequence) at a time
        self._spare_busy = False
        self._closed = False
        self._live: weakref.WeakSet[Generation] = weakref.WeakSet()
        self._stack = ExitStack()
        try:
            self.model = NativeModel(config.model_path, n_gpu_layers=config.n_gpu_layers)
            self._stack.callback(self.model.close)
            self.context = NativeContext(
                self.model,
                n_ctx=config.n_ctx,
                n_batch=config.n_batch,
                n_ubatch=config.n_ubatch,
                n_seq_max=config.n_seq_max,
                kv_unified=config.kv_unified,
                flash_attn=config.flash_attn,
                type_k=config.type_k,
                type_v=config.type_v,
                n_threads=config.n_threads,
                rope_scaling=config.rope_scaling,
                rope_freq_base=config.rope_freq_base,
                rope_freq_scale=config.rope_freq_scale,
                yarn_orig_ctx=config.yarn_orig_ctx,
            )
            self._stack.callback(self.context.close)  # LIFO: context before model
        except BaseException:
            self._stack.close()
            raise
        bos = self.model.bos
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        self.template.bos_token = self.model.token_text(bos) if bos >= 0 else ""
        self.template.eos_token = (
            self.model.token_text(int(eos_id)) if isinstance(eos_id, int) else ""
        )
        self._mirror: dict[int, list[int]] = {s: [] for s in range(config.n_seq_max)}
        self._codec: PromptCodec | None = None
        self.gpu_offload = supports_gpu_offload() and config.n_gpu_layers != 0
        logger.debug(
            "loaded %s: n_ctx=%d n_seq_max=%d template=%s gpu=%s",
            config.model_path,
            self.n_ctx,
            config.n_seq_max,
            self.template.name,
            self.gpu_offload,
        )

    @classmethod
    def load(cls, model: str | Path | None = None, **options: Any) -> Engine:
        """Load ``model`` (None = ``CHATCTX_MODEL`` or the embedded default) with options."""
        try:
            config = EngineConfig(model_path=resolve_model_path(model), **options)
        except ChatctxError:
            raise
        except ValueError as exc:
            raise ConfigError(f"invalid engine options: {exc}") from exc
        return cls(config)

    # lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """End live generations (stop reason ``closed``), then free the context and model."""
        with self._lock:
            self._closed = True
            for generation in list(self._live):
                # Runs its cleanup now (its stream then just ends); ValueError: it is running
                # in another thread, which sees the close at its next step.
                with contextlib.suppress(ValueError):
                    generation.close()
            self._stack.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("engine")

    def _check_seq(self, seq_id: int) -> None:
        self._check_open()
        self.context.check_seq(seq_id)

    # facts --------------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """Tokens one sequence can hold."""
        return self.context.n_ctx_seq

    def info(self) -> ModelInfo:
        d = self.model.describe()
        return ModelInfo(
            path=self.config.model_path,
            architecture=self.facts["architecture"],
            description=d["description"],
            n_params=d["n_params"],
            n_layer=d["n_layer"],
            n_ctx_train=d["n_ctx_train"],
            n_vocab=d["n_vocab"],
            n_ctx=self.n_ctx,
            n_seq_max=self.config.n_seq_max,
            chat_template=self.template.name,
            gpu_offload=self.gpu_offload,
            kv_bytes_per_token_f16=self.facts["kv_bytes_per_token_f16"],
        )

    # text ---------------------------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text (``<|eot_id|>``) is parsed when asked.

        Prompts built from messages go through ``prompt_tokens``, which parses only the
        template's own markup.
        """
        with self._lock:
            self._check_open()
            return self.model.tokenize(text, add_special=False, parse_special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        with self._lock:
            self._check_open()
            return self.model.detokenize(tokens, special=special)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> RenderedPrompt:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """The exact token ids llama.cpp will see for ``messages``.

        Message content is tokenized as text: only the template's markup becomes control
        tokens, so a message cannot forge a turn of another role.
        """
        return self.codec().prompt_tokens(messages, add_generation_prompt=add_generation_prompt)

    def codec(self) -> PromptCodec:
        """The fastest exact codec: tiktoken when it matches llama.cpp on probe texts."""
        if self._codec is None:

            def tokenize(text: str, special: bool) -> list[int]:
                return self.tokenize(text, special=special)

            try:
                codec: PromptCodec = open_codec(
                    self.config.model_path,
                    chat_template=self.config.chat_template,
                    chat_format=self.config.chat_format,
                    fallback=tokenize,
                )
                if any(codec.encode(p) != self.tokenize(p) for p in PROBES):
                    raise ModelError("tiktoken disagrees with llama.cpp on a probe text")
            except ModelError as exc:
                logger.info("using llama.cpp tokenization for counting: %s", exc)
                codec = LlamaCodec(
                    tokenize,
                    self.template,
                    specials=self.model.special_tokens(),
                    bos=self.model.bos,
                    add_bos=self.model.add_bos,
                    fingerprint=f"llama-{self.facts.get('vocab_size')}-"
                    f"{hashlib.sha256(self.template.source.encode()).hexdigest()[:8]}",
                )
            self._codec = codec
        return self._codec

    # KV cache -----------------------------------------------------------------------------

    def cached_tokens(self, seq_id: int = 0) -> tuple[int, ...]:
        """The tokens the KV cache holds for ``seq_id``, as the engine mirrors them."""
        with self._lock:
            self._check_seq(seq_id)
            return tuple(self._mirror[seq_id])

    def kv_cells(self, seq_id: int = 0) -> int:
        """Cells used by ``seq_id``, read from llama.cpp (pos_max - pos_min + 1)."""
        with self._lock:
            self._check_seq(seq_id)
            lo, hi = self.context.seq_pos_min(seq_id), self.context.seq_pos_max(seq_id)
            return 0 if hi < 0 else hi - lo + 1

    def kv_usage(self) -> dict[int, int]:
        """Cells used by every sequence, read from llama.cpp."""
        with self._lock:
            return {seq: self.kv_cells(seq) for seq in range(self.config.n_seq_max)}

    def clear(self, seq_id: int | None = None) -> None:
        """Forget one sequence (or all) in the KV cache."""
        with self._lock:
            self._check_open()
            if seq_id is None:
                self.context.clear()
                for mirror in self._mirror.values():
                    mirror.clear()
            else:
                self._check_seq(seq_id)
                self.context.seq_rm(seq_id, 0, -1)
                self._mirror[seq_id].clear()

    # generation ---------------------------------------------------------------------------

    @property
    def spare_seq(self) -> int | None:
        """The sequence kept free for side work (summaries, reordering), if there is one."""
        n = self.config.n_seq_max
        return n - 1 if n > 1 else None

    def side_generate(
        self,
        prompt: Sequence[int],
        *,
        settings: GenerationSettings,
        background: bool = False,
        deadline: float | None = None,
    ) -> str:
        """Generate on the spare sequence (a summary, say) and return the text.

        One side generation runs at a time; the spare sequence is emptied afterwards. In the
        background, the prefill goes in small chunks and every step waits while a turn's
        prefill runs, so a customer's turn waits for one step at most. ``deadline``
        (``time.monotonic()``) raises ``TimeoutError`` once passed, between steps.
        """
        spare = self.spare_seq
        if spare is None:
            raise ConfigError("side generations need an engine with n_seq_max >= 2")
        with self._side:
            with self._lock:
                self._check_open()
                self._spare_busy = True
            try:
                generation = self.generate(prompt, seq_id=spare, settings=settings)
                generation.background = background
                try:
                    for _ in generation:
                        if deadline is not None and time.monotonic() > deadline:
                            raise TimeoutError("side generation not done before its deadline")
                finally:
                    generation.close()
                return generation.text
            finally:
                with self._lock:
                    self._spare_busy = False
                    if not self._closed:
                        self.clear(spare)

    def _foreground(self, delta: int) -> None:
        with self._turn:
            self._prefilling += delta
            if not self._prefilling:
                self._turn.notify_all()

    def _wait_for_foreground(self) -> None:
        with self._turn:
            while self._prefilling and not self._closed:
                self._turn.wait(0.5)

    def generate(
        self,
        prompt: Sequence[int],
        *,
        seq_id: int = 0,
        settings: GenerationSettings | None = None,
        eviction: str = "shift",
        history_start: int | None = None,
    ) -> Generation:
        """Start generating after ``prompt`` on ``seq_id``; iterate the result for text.

        ``eviction="shift"`` reuses cached turns that moved (evicted turns before them are
        removed and the rest shifted in place); ``"recompute"`` re-evaluates everything after
        the common prefix. ``history_start`` (where the kept turns begin in the prompt) lets a
        shift also work when new tokens, such as a changed summary, precede them.
        """
        self._check_seq(seq_id)
        if eviction not in ("shift", "recompute"):
            raise ConfigError(f"eviction must be 'shift' or 'recompute', not {eviction!r}")
        if not prompt:
            raise GenerationError("empty prompt")
        if len(prompt) >= self.n_ctx:
            raise GenerationError(f"prompt of {len(prompt)} tokens does not fit n_ctx={self.n_ctx}")
        return Generation(
            self, seq_id, prompt, settings or GenerationSettings(), eviction, history_start
        )

    def prefill(
        self,
        prompt: Sequence[int],
        *,
        seq_id: int = 0,
        eviction: str = "shift",
        history_start: int | None = None,
    ) -> GenerationResult:
        """Bring the KV cache to ``prompt`` and sample nothing (teacher-forced replays)."""
        return self.generate(
            prompt,
            seq_id=seq_id,
            settings=GenerationSettings(max_tokens=1, temperature=0.0),
            eviction=eviction,
            history_start=history_start,
        ).wait(first_token_only=True)

    def _prefill(
        self, seq_id: int, prompt: list[int], eviction: str, history_start: int | None
    ) -> tuple[KVReport, int]:
        """Bring the KV cache of ``seq_id`` to ``prompt``; returns (report, logits index)."""
        return bring_to(
            self.context,
            self._mirror[seq_id],
            seq_id,
            prompt,
            eviction=eviction,
            history_start=history_start,
            spare=self.spare_seq,
            spare_free=not self._spare_busy,
            unified=self.config.kv_unified,
        )

    def _redecode_last(self, seq_id: int) -> tuple[int, int]:
        mirror = self._mirror[seq_id]
        last = len(mirror) - 1
        self.context.seq_rm(seq_id, last, -1)
        index = self.context.decode(seq_id, [mirror[last]], last, want_last_logits=True)
        return index, self.context.decode_count

    def _background_prefill(self, seq_id: int, prompt: list[int]) -> tuple[KVReport, int, int]:
        """Evaluate ``prompt`` from scratch in chunks, stepping aside for turns' prefills."""
        chunk = 32
        with self._lock:
            self._check_open()
            evicted = len(self._mirror[seq_id])
            self.context.seq_rm(seq_id, 0, -1)
            self._mirror[seq_id].clear()
        index = serial = -1
        for start in range(0, len(prompt), chunk):
            self._wait_for_foreground()
            with self._lock:
                self._check_open()
                part = prompt[start : start + chunk]
                last = start + chunk >= len(prompt)
                index = self.context.decode(seq_id, part, start, want_last_logits=last)
                serial = self.context.decode_count
                self._mirror[seq_id].extend(part)
        report = KVReport(
            policy="recompute",
            reused_tokens=0,
            evaluated_tokens=len(prompt),
            evicted_tokens=evicted,
            shifted_tokens=0,
            shift_count=0,
        )
        return report, index, serial

    def _resync(self, seq_id: int) -> None:
        # After a failed decode, drop whatever llama.cpp kept beyond the mirror.
        self.context.seq_rm(seq_id, len(self._mirror[seq_id]), -1)

    def _run(
        self,
        generation: Generation,
        seq_id: int,
        prompt: list[int],
        settings: GenerationSettings,
        eviction: str,
        history_start: int | None,
    ) -> Generator[str, None, None]:
        t0 = time.perf_counter()
        mirror = self._mirror[seq_id]
        tokens: list[int] = []
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        report: KVReport | None = None
        prefill_ms = 0.0
        t_first: float | None = None
        stop = "interrupted"
        self._live.add(generation)
        sampler: Sampler | None = None
        in_front = False
        try:
            if generation.background:
                report, index, serial = self._background_prefill(seq_id, prompt)
            else:
                # Background steps wait until this turn's first token is sampled.
                self._foreground(+1)
                in_front = True
                with self._lock:
                    self._check_open()
                    report, index = self._prefill(seq_id, prompt, eviction, history_start)
                    serial = self.context.decode_count  # logits belong to this decode
            prefill_ms = (time.perf_counter() - t0) * 1000
            with self._lock:
                self._check_open()
                sampler = Sampler(
                    self.model,
                    temperature=settings.temperature,
                    top_k=settings.top_k,
                    top_p=settings.top_p,
                    min_p=settings.min_p,
                    repeat_penalty=settings.repeat_penalty,
                    repeat_last_n=settings.repeat_last_n,
                    seed=settings.seed,
                )
            pending: int | None = None  # sampled, not yet decoded
            for _ in range(settings.max_tokens):
                if generation.background:
                    self._wait_for_foreground()
                # The lock is held for one step, never across a yield: other threads'
                # generations (on other sequences) and close() get their turn between tokens.
                with self._lock:
                    if self._closed:
                        stop = "closed"
                        break
                    if pending is not None:
                        if len(mirror) >= self.n_ctx:
                            stop = "context_full"
                            break
                        index = self.context.decode(
                            seq_id, [pending], len(mirror), want_last_logits=True
                        )
                        serial = self.context.decode_count
                        mirror.append(pending)
                        pending = None
                    if serial != self.context.decode_count:
                        # Another sequence decoded since (another thread, a background
                        # summary): its logits replaced ours. Decode our last token again.
                        index, serial = self._redecode_last(seq_id)
                    token = sampler.sample(self.context, index)
                    if t_first is None:
                        t_first = time.perf_counter()
                        if in_front:
                            self._foreground(-1)
                            in_front = False
                        if generation.first_token_only:
                            stop = "length"
                            break
                    if self.model.is_eog(token):
                        stop = "eog"
                        break
                    tokens.append(token)
                    chunk = decoder.decode(self.model.piece(token))
                    pending = token  # the last token's logits are never needed
                if chunk:
                    generation.text += chunk
                    yield chunk
            else:
                stop = "length"
            tail = decoder.decode(b"", final=True)
            if tail:
                generation.text += tail
                yield tail
        except BaseException:
            # A failed decode, or an interruption (Ctrl-C, close) between a decode and the
            # mirror's update: drop whatever llama.cpp holds beyond the mirror.
            with self._lock:
                if not self._closed:
                    self._resync(seq_id)
            raise
        finally:
            if in_front:
                self._foreground(-1)
            self._live.discard(generation)
            if sampler is not None:
                sampler.close()
            t_end = time.perf_counter()
            decode_s = t_end - t_first if t_first is not None else 0.0
            reused = report.reused_tokens if report else 0
            generation.result = GenerationResult(
                text=generation.text,
                tokens=tuple(tokens),
                usage=Usage(
                    prompt_tokens=len(prompt),
                    reused_tokens=reused,
                    evaluated_tokens=len(prompt) - reused if report else 0,
                    generated_tokens=len(tokens),
                ),
                timings=Timings(
                    prefill_ms=prefill_ms,
                    ttft_ms=(t_first - t0) * 1000 if t_first is not None else None,
                    engine_ttft_ms=(t_first - t0) * 1000 if t_first is not None else None,
                    decode_ms=decode_s * 1000,
                    decode_tokens_per_s=(len(tokens) - 1) / decode_s
                    if len(tokens) > 1 and decode_s > 0
                    else None,
                    total_ms=(t_end - t0) * 1000,
                ),
                stop_reason=stop,
                kv=report,
                started_at=t0,
            )
