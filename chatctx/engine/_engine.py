"""The llama.cpp engine: one model, one context, several sequences, a mirror of each.

For every sequence the engine keeps the exact token list that sits in the KV cache, so a
request reuses the longest common prefix and evaluates only the rest.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chatctx._resource import Closeable
from chatctx.config import EngineConfig, GenerationSettings
from chatctx.engine import _gguf
from chatctx.engine._codec import PROBES, LlamaCodec, PromptCodec, open_codec
from chatctx.engine._kv import KVReport, plan_reuse
from chatctx.engine._models import resolve_model_path
from chatctx.engine._native import NativeContext, NativeModel, Sampler, supports_gpu_offload
from chatctx.engine._template import BUILTIN_FORMATS, ChatTemplate
from chatctx.errors import ChatctxError, ConfigError, GenerationError, ModelError

logger = logging.getLogger("chatctx.engine")


@dataclass(frozen=True, slots=True)
class Usage:
    """Token figures of one generation."""

    prompt_tokens: int
    reused_tokens: int  # taken from the KV cache as they were
    evaluated_tokens: int  # prefilled this turn
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    """Wall-clock figures of one generation, in milliseconds and tokens per second."""

    prefill_ms: float
    ttft_ms: float | None
    decode_ms: float
    decode_tokens_per_s: float | None
    total_ms: float


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    tokens: tuple[int, ...]
    usage: Usage
    timings: Timings
    stop_reason: str  # eog | length | context_full | interrupted
    kv: KVReport | None = None

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
    extra: dict[str, Any] = field(default_factory=dict)


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
    ) -> None:
        self.result: GenerationResult | None = None
        self.text = ""
        self.first_token_only = False
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
        template_source, template_name = self._pick_template(meta, config)
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
            )
            self._stack.callback(self.context.close)  # LIFO: context before model
        except BaseException:
            self._stack.close()
            raise
        bos = self.model.bos
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        self.template = ChatTemplate(
            template_source,
            bos_token=self.model.token_text(bos) if bos >= 0 else "",
            eos_token=self.model.token_text(int(eos_id)) if isinstance(eos_id, int) else "",
            name=template_name,
        )
        self._mirror: dict[int, list[int]] = {s: [] for s in range(config.n_seq_max)}
        self._codec: PromptCodec | None = None
        self.gpu_offload = supports_gpu_offload() and config.n_gpu_layers != 0
        logger.debug(
            "loaded %s: n_ctx=%d n_seq_max=%d template=%s gpu=%s",
            config.model_path,
            self.n_ctx,
            config.n_seq_max,
            template_name,
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

    @staticmethod
    def _pick_template(meta: Mapping[str, Any], config: EngineConfig) -> tuple[str, str]:
        if config.chat_template:
            return config.chat_template, "override"
        source = meta.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return source, "gguf"
        if config.chat_format:
            return BUILTIN_FORMATS[config.chat_format], config.chat_format
        raise ModelError(
            f"{config.model_path} has no chat template; pass chat_format='llama-3' or "
            "'chatml' (--chat-format) or a chat_template, chatctx never guesses one",
            path=str(config.model_path),
        )

    # lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        self._stack.close()

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
        """Token ids of ``text``; special-token text (``<|eot_id|>``) is parsed when asked."""
        return self.model.tokenize(text, add_special=False, parse_special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return self.model.detokenize(tokens, special=special)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """The exact token ids llama.cpp will see for ``messages``."""
        tokens = self.tokenize(self.render(messages, add_generation_prompt=add_generation_prompt))
        bos = self.model.bos
        if self.model.add_bos and bos >= 0 and (not tokens or tokens[0] != bos):
            tokens.insert(0, bos)
        return tokens

    def codec(self) -> PromptCodec:
        """The fastest exact codec: tiktoken when it matches llama.cpp on probe texts."""
        if self._codec is None:
            try:
                codec: PromptCodec = open_codec(
                    self.config.model_path,
                    chat_template=self.config.chat_template,
                    chat_format=self.config.chat_format,
                    fallback=self.tokenize,
                )
                if any(codec.encode(p) != self.tokenize(p) for p in PROBES):
                    raise ModelError("tiktoken disagrees with llama.cpp on a probe text")
            except ModelError as exc:
                logger.info("using llama.cpp tokenization for counting: %s", exc)
                codec = LlamaCodec(
                    self.tokenize,
                    self.template,
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
        return tuple(self._mirror[seq_id])

    def kv_cells(self, seq_id: int = 0) -> int:
        """Cells used by ``seq_id``, read from llama.cpp (pos_max - pos_min + 1)."""
        lo, hi = self.context.seq_pos_min(seq_id), self.context.seq_pos_max(seq_id)
        return 0 if hi < 0 else hi - lo + 1

    def kv_usage(self) -> dict[int, int]:
        """Cells used by every sequence, read from llama.cpp."""
        return {seq: self.kv_cells(seq) for seq in range(self.config.n_seq_max)}

    def clear(self, seq_id: int | None = None) -> None:
        """Forget one sequence (or all) in the KV cache."""
        if seq_id is None:
            self.context.clear()
            for mirror in self._mirror.values():
                mirror.clear()
        else:
            self.context.seq_rm(seq_id, 0, -1)
            self._mirror[seq_id].clear()

    # generation ---------------------------------------------------------------------------

    @property
    def spare_seq(self) -> int | None:
        """The sequence kept free for side work (summaries, reordering), if there is one."""
        n = self.config.n_seq_max
        return n - 1 if n > 1 else None

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
        if seq_id not in self._mirror:
            raise ConfigError(f"sequence {seq_id} outside 0..{self.config.n_seq_max - 1}")
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
        mirror = self._mirror[seq_id]
        ctx = self.context
        plan = plan_reuse(mirror, prompt, history_start=history_start)
        fallback = None
        if plan.chunk is not None:
            if eviction == "recompute":
                fallback = "eviction policy is recompute"
            elif not ctx.can_shift():
                fallback = "this model's KV cache cannot shift positions"
            elif plan.inserted and (self.spare_seq in (None, seq_id) or not self.config.kv_unified):
                fallback = "new tokens precede the kept turns and no spare unified sequence"
        if plan.chunk is None or fallback is not None:
            reused = plan.prefix
            evicted = len(mirror) - reused
            ctx.seq_rm(seq_id, reused, -1)
            del mirror[reused:]
            index = ctx.decode(seq_id, prompt[reused:], reused, want_last_logits=True)
            mirror.extend(prompt[reused:])
            report = KVReport(
                policy=eviction,
                reused_tokens=reused,
                evaluated_tokens=len(prompt) - reused,
                evicted_tokens=evicted,
                shifted_tokens=0,
                shift_count=0,
                fallback=fallback,
            )
            return report, index
        start, end = plan.chunk
        evicted = len(mirror) - plan.prefix - plan.chunk_len
        ctx.seq_rm(seq_id, end, -1)  # the old tail (previous reply) goes first
        if plan.inserted == 0:
            ctx.seq_rm(seq_id, plan.prefix, start)
            ctx.seq_add(seq_id, start, end, plan.delta)
            mirror[:] = mirror[: plan.prefix] + mirror[start:end]
        else:
            # llama.cpp only appends at pos_max + 1: park the kept turns on the spare
            # sequence, evaluate the inserted tokens, then move the turns back behind them.
            spare = self.spare_seq
            assert spare is not None
            ctx.seq_rm(spare, 0, -1)
            ctx.seq_cp(seq_id, spare, start, end)
            ctx.seq_rm(seq_id, plan.prefix, -1)
            kept = mirror[start:end]
            del mirror[plan.prefix :]
            try:
                ctx.decode(
                    seq_id, prompt[plan.prefix : plan.dest], plan.prefix, want_last_logits=False
                )
                mirror.extend(prompt[plan.prefix : plan.dest])
                ctx.seq_add(spare, start, end, plan.delta)
                ctx.seq_cp(spare, seq_id, plan.dest, plan.dest + plan.chunk_len)
                mirror.extend(kept)
            finally:
                ctx.seq_rm(spare, 0, -1)
        index = ctx.decode(seq_id, prompt[plan.resume :], plan.resume, want_last_logits=True)
        mirror.extend(prompt[plan.resume :])
        report = KVReport(
            policy=eviction,
            reused_tokens=plan.prefix + plan.chunk_len,
            evaluated_tokens=len(prompt) - plan.prefix - plan.chunk_len,
            evicted_tokens=evicted,
            shifted_tokens=plan.chunk_len if plan.delta else 0,
            shift_count=1 if plan.delta else 0,
        )
        logger.debug(
            "seq %d: kept %d, removed %d, shifted %d by %d, evaluated %d",
            seq_id,
            plan.prefix,
            evicted,
            plan.chunk_len,
            plan.delta,
            report.evaluated_tokens,
        )
        return report, index

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
        try:
            report, index = self._prefill(seq_id, prompt, eviction, history_start)
            prefill_ms = (time.perf_counter() - t0) * 1000
            with Sampler(
                self.model,
                temperature=settings.temperature,
                top_k=settings.top_k,
                top_p=settings.top_p,
                min_p=settings.min_p,
                repeat_penalty=settings.repeat_penalty,
                repeat_last_n=settings.repeat_last_n,
                seed=settings.seed,
            ) as sampler:
                for step in range(settings.max_tokens):
                    token = sampler.sample(self.context, index)
                    if t_first is None:
                        t_first = time.perf_counter()
                        if generation.first_token_only:
                            stop = "length"
                            break
                    if self.model.is_eog(token):
                        stop = "eog"
                        break
                    tokens.append(token)
                    chunk = decoder.decode(self.model.piece(token))
                    if chunk:
                        generation.text += chunk
                        yield chunk
                    if step == settings.max_tokens - 1:
                        stop = "length"  # the last token's logits are never needed
                        break
                    if len(mirror) >= self.n_ctx:
                        stop = "context_full"
                        break
                    index = self.context.decode(seq_id, [token], len(mirror), want_last_logits=True)
                    mirror.append(token)
            tail = decoder.decode(b"", final=True)
            if tail:
                generation.text += tail
                yield tail
        except ChatctxError:
            self._resync(seq_id)
            raise
        finally:
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
                    decode_ms=decode_s * 1000,
                    decode_tokens_per_s=(len(tokens) - 1) / decode_s
                    if len(tokens) > 1 and decode_s > 0
                    else None,
                    total_ms=(t_end - t0) * 1000,
                ),
                stop_reason=stop,
                kv=report,
            )
