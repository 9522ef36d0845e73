"""Resource-owning wrappers over llama-cpp-python's ctypes bindings.

This is the only module that calls llama.cpp directly, and the one place its failures become
chatctx errors. Every native resource is released by ``close()`` / a ``with`` block, never by
``__del__``; a context is always freed before its model.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as ll

from chatctx._resource import Closeable
from chatctx.errors import ClosedError, ConfigError, GenerationError, KVCacheError, ModelError
from chatctx.model.cpus import default_threads

logger = logging.getLogger("chatctx.llama")

# ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continue previous line
_LEVELS = {
    0: logging.DEBUG,
    1: logging.DEBUG,
    2: logging.DEBUG,
    3: logging.WARNING,
    4: logging.ERROR,
}
# llama.cpp reports why a load failed only through its log: keep the last error lines.
_recent_errors: deque[str] = deque(maxlen=8)
_last_level = logging.DEBUG
_init_lock = threading.Lock()
_initialized = False

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


@ll.llama_log_callback  # type: ignore[untyped-decorator]
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    global _last_level
    py_level = _last_level if level == 5 else _LEVELS.get(level, logging.DEBUG)
    _last_level = py_level
    message = text.decode("utf-8", errors="replace").rstrip()
    if not message:
        return
    if py_level >= logging.ERROR:
        _recent_errors.append(message)
    if logger.isEnabledFor(py_level):
        logger.log(py_level, "%s", message)


def init_backend() -> None:
    """Route llama.cpp's log into ``logging`` and initialise the backend, once per process."""
    global _initialized
    with _init_lock:
        if _initialized:
            return
        ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _initialized = True


def supports_gpu_offload() -> bool:
    return bool(ll.llama_supports_gpu_offload())


def _recent_error_text() -> str:
    text = "; ".join(_recent_errors)
    _recent_errors.clear()
    return f" (llama.cpp: {text})" if text else ""


class NativeModel:
    """A loaded GGUF (``llama_model``) and its vocabulary."""

    def __init__(self, path: Path, *, n_gpu_layers: int = -1, vocab_only: bool = False) -> None:
        init_backend()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers < 0 else n_gpu_layers
        params.vocab_only = vocab_only
        _recent_errors.clear()
        ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not ptr:
            raise ModelError(
                f"llama.cpp could not load {path}{_recent_error_text()}", path=str(path)
            )
        self.ptr: Any = ptr
        self._vocab: Any = ll.llama_model_get_vocab(ptr)
        self.path = path
        # Per generated token: its bytes and whether it ends the reply, asked of llama.cpp
        # once per token id (two ctypes calls and a buffer less per token after that).
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}

    def close(self) -> None:
        if self.ptr is not None:
            ll.llama_model_free(self.ptr)
            self.ptr = None
            self._vocab = None

    @property
    def closed(self) -> bool:
        return self.ptr is None

    @property
    def live(self) -> Any:
        """The model pointer; ``ClosedError`` once freed (llama.cpp would crash on it)."""
        if self.ptr is None:
            raise ClosedError("model")
        return self.ptr

    @property
    def vocab(self) -> Any:
        if self._vocab is None:
            raise ClosedError("model")
        return self._vocab

    def special_tokens(self) -> dict[str, int]:
        """Texts of the control and user-defined tokens, with their ids."""
        vocab = self.vocab
        wanted = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED
        out: dict[str, int] = {}
        for token in range(int(ll.llama_vocab_n_tokens(vocab))):
            if int(ll.llama_vocab_get_attr(vocab, token)) & wanted:
                text = self.token_text(token)
                if text:
                    out.setdefault(text, token)
        return out

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = ll.llama_model_meta_val_str(self.live, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self.live, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        raw = ll.llama_model_chat_template(self.live, None)
        return raw.decode("utf-8") if raw else None

    def describe(self) -> dict[str, Any]:
        ptr = self.live
        desc = ctypes.create_string_buffer(256)
        ll.llama_model_desc(ptr, desc, len(desc))
        return {
            "description": desc.value.decode("utf-8", errors="replace"),
            "n_params": int(ll.llama_model_n_params(ptr)),
            "size_bytes": int(ll.llama_model_size(ptr)),
            "n_ctx_train": int(ll.llama_model_n_ctx_train(ptr)),
            "n_layer": int(ll.llama_model_n_layer(ptr)),
            "n_embd": int(ll.llama_model_n_embd(ptr)),
            "n_head": int(ll.llama_model_n_head(ptr)),
            "n_head_kv": int(ll.llama_model_n_head_kv(ptr)),
            "n_vocab": int(ll.llama_vocab_n_tokens(self.vocab)),
        }

    # vocabulary ----------------------------------------------------------------------------

    @property
    def bos(self) -> int:
        return int(ll.llama_vocab_bos(self.vocab))

    @property
    def add_bos(self) -> bool:
        return bool(ll.llama_vocab_get_add_bos(self.vocab))

    def is_eog(self, token: int) -> bool:
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(ll.llama_vocab_is_eog(self.vocab, token))
        return eog

    def token_text(self, token: int) -> str:
        raw = ll.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(
            self.vocab, data, len(data), buf, capacity, add_special, parse_special
        )
        if n < 0:
            capacity = -n
            buf = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(
                self.vocab, data, len(data), buf, capacity, add_special, parse_special
            )
        if n < 0:
            raise ModelError(f"tokenization failed ({n})", path=str(self.path))
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        if not special and (known := self._pieces.get(token)) is not None:
            return known
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        piece = buf.raw[:n]
        if not special:
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return b"".join(self.piece(t, special=special) for t in tokens).decode(
            "utf-8", errors="replace"
        )


def _check_decode(code: int, *, seq_id: int, n_tokens: int) -> None:
    """Translate ``llama_decode``'s return code; 0 is success."""
    if code == 0:
        return
    if code == 1:
        raise KVCacheError(
            f"no KV cache slot for {n_tokens} tokens of sequence {seq_id}: the context is full",
            seq_id=seq_id,
            n_tokens=n_tokens,
            code=code,
        )
    if code == 2:
        raise GenerationError("decoding was aborted", code=code)
    if code == -1:
        raise GenerationError(
            f"llama.cpp rejected the batch as invalid{_recent_error_text()}", code=code
        )
    raise GenerationError(f"llama_decode failed with code {code}{_recent_error_text()}", code=code)


class NativeContext:
    """A ``llama_context`` (the KV cache) with one reusable batch."""

    def __init__(
        self,
        model: NativeModel,
        *,
        n_ctx: int,
        n_batch: int,
        n_ubatch: int,
        n_seq_max: int,
        kv_unified: bool,
        flash_attn: bool | None,
        type_k: str,
        type_v: str,
        n_threads: int | None,
        rope_scaling: str | None = None,
        rope_freq_base: float | None = None,
        rope_freq_scale: float | None = None,
        yarn_orig_ctx: int | None = None,
        n_ctx_seq: int | None = None,
    ) -> None:
        from chatctx.model.memory import (
            KV_TYPE_IDS,
            check_kv_types,
            pad256,
            resolve_flash_attn,
            rope_warning,
        )

        # The planner's rules (chatctx plan uses the same): bad types and a quantized V cache
        # without flash attention are ConfigErrors here, not "Failed to create llama_context".
        flash_attn = resolve_flash_attn(type_k, type_v, flash_attn)
        info = model.describe()
        check_kv_types(type_k, type_v, *_head_sizes(model, info))
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch, n_batch)
        params.n_seq_max = n_seq_max
        params.kv_unified = kv_unified
        params.flash_attn_type = {None: -1, True: 1, False: 0}[flash_attn]
        params.type_k = KV_TYPE_IDS[type_k]
        params.type_v = KV_TYPE_IDS[type_v]
        # 0 / UNSPECIFIED leave llama.cpp on the GGUF's own RoPE settings.
        params.rope_scaling_type = _ROPE_SCALING[rope_scaling]
        params.rope_freq_base = rope_freq_base or 0.0
        params.rope_freq_scale = rope_freq_scale or 0.0
        params.yarn_orig_ctx = yarn_orig_ctx or 0
        # Positions one conversation can reach: a split stream's size; in a unified pool the
        # slot pool's share (n_seq_max - 1 conversations, one sequence kept for summaries).
        if n_ctx_seq is None:
            n_ctx_seq = (
                pad256(n_ctx // max(n_seq_max - 1, 1))
                if kv_unified
                else pad256(n_ctx // max(n_seq_max, 1))
            )
        warning = rope_warning(
            n_ctx_seq,
            info["n_ctx_train"],
            rope_scaling=rope_scaling,
            rope_freq_scale=rope_freq_scale,
            model_scaling=model.meta(f"{model.meta('general.architecture')}.rope.scaling.type"),
        )
        if warning:
            logging.getLogger("chatctx.backends.engine").warning("%s", warning)
        threads = n_threads or default_threads()
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        _recent_errors.clear()
        ptr = ll.llama_init_from_model(model.ptr, params)
        if not ptr:
            hint = ""
            if type_v != "f16" and flash_attn is False:
                hint = " (a quantized V cache needs flash_attn)"
            raise ModelError(
                f"failed to create the llama.cpp context{hint}{_recent_error_text()}",
                path=str(model.path),
            )
        self.ptr: Any = ptr
        self.model = model
        self.memory: Any = ll.llama_get_memory(ptr)
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self._batch = ll.llama_batch_init(n_batch, 0, 1)
        self._batch_live = True
        self._logit_rows: frozenset[int] = frozenset()  # batch rows with logits, last decode
        self.decode_count = 0  # decodes so far: logits belong to the latest one only
        # Sequences shifted since the last decode: llama.cpp applies a shift to the keys at
        # the next decode, so a state saved before it would hold unshifted keys.
        self.shift_pending: set[int] = set()

    @property
    def closed(self) -> bool:
        return self.ptr is None

    @property
    def live(self) -> Any:
        """The context pointer; ``ClosedError`` once freed (llama.cpp would crash on it)."""
        if self.ptr is None:
            raise ClosedError("llama.cpp context")
        return self.ptr

    @property
    def n_ctx(self) -> int:
        return int(ll.llama_n_ctx(self.live))

    @property
    def n_ctx_seq(self) -> int:
        return int(ll.llama_n_ctx_seq(self.live))

    def close(self) -> None:
        if self._batch_live:
            ll.llama_batch_free(self._batch)
            self._batch_live = False
        if self.ptr is not None:
            ll.llama_free(self.ptr)
            self.ptr = None
            self.memory = None
            self._logit_rows = frozenset()

    def check_seq(self, seq_id: int) -> None:
        """Refuse a sequence id llama.cpp would assert on (it aborts the process)."""
        if not isinstance(seq_id, int) or not 0 <= seq_id < self.n_seq_max:
            raise ConfigError(f"sequence {seq_id!r} outside 0..{self.n_seq_max - 1}")

    def _mem(self, *seq_ids: int) -> Any:
        if self.ptr is None:
            raise ClosedError("llama.cpp context")
        for seq_id in seq_ids:
            self.check_seq(seq_id)
        return self.memory

    # KV cache ------------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        return int(ll.llama_memory_seq_pos_min(self._mem(seq_id), seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(ll.llama_memory_seq_pos_max(self._mem(seq_id), seq_id))

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> None:
        if not ll.llama_memory_seq_rm(self._mem(seq_id), seq_id, p0, p1):
            raise KVCacheError(
                f"llama.cpp refused to remove positions [{p0}, {p1}) of sequence {seq_id}",
                seq_id=seq_id,
                n_tokens=0,
                code=-1,
            )

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        memory = self._mem(seq_id)
        if delta and not ll.llama_memory_can_shift(memory):
            # Decoding after a shift on a model that cannot shift aborts inside llama.cpp.
            raise KVCacheError(
                "this model's KV cache cannot shift positions", seq_id=seq_id, n_tokens=0, code=-1
            )
        ll.llama_memory_seq_add(memory, seq_id, p0, p1, delta)
        if delta:
            self.shift_pending.add(seq_id)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        ll.llama_memory_seq_cp(self._mem(src, dst), src, dst, p0, p1)

    def can_shift(self) -> bool:
        return bool(ll.llama_memory_can_shift(self._mem()))

    def clear(self) -> None:
        ll.llama_memory_clear(self._mem(), True)

    # decoding ------------------------------------------------------------------------------

    def decode(
        self, seq_id: int, tokens: Sequence[int], start_pos: int, *, want_last_logits: bool
    ) -> int:
        """Evaluate ``tokens`` at positions ``start_pos...`` of ``seq_id``.

        Returns the batch index holding the last token's logits (for sampling), or -1.
        Batches never exceed ``n_batch`` (a larger one aborts the process in llama.cpp).
        """
        ctx = self.live
        self.check_seq(seq_id)
        if not tokens:
            return -1
        batch = self._batch
        index = -1
        self._logit_rows = frozenset()
        self.decode_count += 1
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset : offset + self.n_batch]
            last_chunk = offset + self.n_batch >= len(tokens)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = start_pos + offset + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = 0
            if last_chunk and want_last_logits:
                batch.logits[len(chunk) - 1] = 1
                index = len(chunk) - 1
            batch.n_tokens = len(chunk)
            _check_decode(ll.llama_decode(ctx, batch), seq_id=seq_id, n_tokens=len(chunk))
            self.shift_pending.clear()
        self._logit_rows = frozenset({index}) if index >= 0 else frozenset()
        return index

    def decode_many(self, parts: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[int]:
        """Evaluate several sequences' tokens in one ``llama_decode``.

        ``parts``: ``(seq_id, tokens, start_pos, want_last_logits)``; together at most
        ``n_batch`` tokens. Returns, per part, the batch index of its last token's logits
        (or -1).
        """
        ctx = self.live
        total = sum(len(tokens) for _, tokens, _, _ in parts)
        if total > self.n_batch:
            raise GenerationError(f"a batch of {total} tokens exceeds n_batch={self.n_batch}")
        batch = self._batch
        self._logit_rows = frozenset()
        self.decode_count += 1
        indices: list[int] = []
        i = 0
        for seq_id, tokens, start_pos, want_logits in parts:
            self.check_seq(seq_id)
            for offset, token in enumerate(tokens):
                batch.token[i] = token
                batch.pos[i] = start_pos + offset
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = 0
                i += 1
            if want_logits and tokens:
                batch.logits[i - 1] = 1
                indices.append(i - 1)
            else:
                indices.append(-1)
        if not i:
            return indices
        batch.n_tokens = i
        first = parts[0][0] if len(parts) == 1 else -1
        _check_decode(ll.llama_decode(ctx, batch), seq_id=first, n_tokens=i)
        self.shift_pending.clear()
        self._logit_rows = frozenset(index for index in indices if index >= 0)
        return indices

    # sequence state (swap) ------------------------------------------------------------------

    def state_seq_get(self, seq_id: int) -> bytes:
        """The KV state of ``seq_id`` (cells, positions, keys and values) as bytes."""
        ctx = self.live
        self.check_seq(seq_id)
        if seq_id in self.shift_pending:
            raise KVCacheError(
                "sequence state cannot be saved between a shift and the next decode",
                seq_id=seq_id,
                n_tokens=0,
                code=-1,
            )
        size = int(ll.llama_state_seq_get_size(ctx, seq_id))
        buffer = (ctypes.c_uint8 * max(size, 1))()
        written = int(ll.llama_state_seq_get_data(ctx, buffer, size, seq_id))
        if written != size:
            raise KVCacheError(
                f"llama.cpp wrote {written} of {size} state bytes of sequence {seq_id}",
                seq_id=seq_id,
                n_tokens=0,
                code=-1,
            )
        return ctypes.string_at(buffer, written)  # one copy (slicing makes a list of ints)

    def state_seq_set(self, seq_id: int, data: bytes) -> bool:
        """Load a state saved by ``state_seq_get`` into (empty) ``seq_id``; False if refused."""
        ctx = self.live
        self.check_seq(seq_id)
        buffer = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        read = int(ll.llama_state_seq_set_data(ctx, buffer, len(data), seq_id))
        return read == len(data) and read > 0

    def has_logits(self, index: int) -> bool:
        """Whether the last decode asked for logits at batch ``index``."""
        return index in self._logit_rows

    def logits(self, index: int) -> list[float]:
        ctx = self.live
        if not self.has_logits(index):
            raise GenerationError(f"no logits at batch index {index}")
        ptr = ll.llama_get_logits_ith(ctx, index)
        if not ptr:
            raise GenerationError(f"no logits at batch index {index}")
        n_vocab = int(ll.llama_vocab_n_tokens(self.model.vocab))
        return list(ptr[:n_vocab])

    # llama.cpp's own counters (an oracle for chatctx's accounting) ----------------------------

    def perf_counts(self) -> tuple[int, int]:
        """Tokens llama.cpp itself evaluated in this context: ``(n_p_eval, n_eval)``.

        llama.cpp adds the tokens queued by decodes when it synchronizes (done here first):
        a synchronization after exactly one token counts it in ``n_eval``, after more in
        ``n_p_eval``, so their sum is the number of tokens decoded. Each is reported as at
        least 1, so a difference is exact only once both were non-zero. Counted even with
        ``no_perf`` (which only skips the timings).
        """
        ctx = self.live
        ll.llama_synchronize(ctx)
        data = ll.llama_perf_context(ctx)
        return int(data.n_p_eval), int(data.n_eval)

    def reset_perf(self) -> None:
        """Set llama.cpp's evaluated-token counters (and timings) back to zero."""
        ll.llama_perf_context_reset(self.live)


class Sampler(Closeable):
    """A llama.cpp sampler chain (one per generation, so random state never interleaves)."""

    def __init__(
        self,
        model: NativeModel,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        repeat_penalty: float,
        repeat_last_n: int,
        seed: int | None,
        grammar: str | None = None,
    ) -> None:
        """``grammar`` (GBNF, root rule ``root``) limits every sampled token to what it
        allows; a grammar llama.cpp cannot parse is a ``GenerationError``."""
        self.ptr: Any = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        add = ll.llama_sampler_chain_add
        if grammar is not None:
            constrained = ll.llama_sampler_init_grammar(
                model.vocab, grammar.encode("utf-8"), b"root"
            )
            if not constrained:
                ll.llama_sampler_free(self.ptr)
                self.ptr = None
                raise GenerationError("llama.cpp could not parse the grammar")
            add(self.ptr, constrained)
        if repeat_penalty != 1.0 and repeat_last_n > 0:
            n_vocab = int(ll.llama_vocab_n_tokens(model.vocab))
            add(
                self.ptr,
                ll.llama_sampler_init_penalties(n_vocab, repeat_last_n, repeat_penalty, 0.0, 0.0),
            )
        if temperature <= 0:
            add(self.ptr, ll.llama_sampler_init_greedy())
            return
        if top_k > 0:
            add(self.ptr, ll.llama_sampler_init_top_k(top_k))
        add(self.ptr, ll.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0:
            add(self.ptr, ll.llama_sampler_init_min_p(min_p, 1))
        add(self.ptr, ll.llama_sampler_init_temp(temperature))
        add(self.ptr, ll.llama_sampler_init_dist(ll.LLAMA_DEFAULT_SEED if seed is None else seed))

    def sample(self, context: NativeContext, index: int) -> int:
        # A bad index aborts the process inside llama.cpp: check it here first.
        if self.ptr is None:
            raise ClosedError("sampler")
        ctx = context.live
        if not context.has_logits(index) or not ll.llama_get_logits_ith(ctx, index):
            raise GenerationError(f"no logits at batch index {index}")
        return int(ll.llama_sampler_sample(self.ptr, ctx, index))

    def close(self) -> None:
        if self.ptr is not None:
            ll.llama_sampler_free(self.ptr)
            self.ptr = None


# Helpers for NativeContext and the memory planner ----------------------------------------------

_ROPE_SCALING: dict[str | None, int] = {None: -1, "none": 0, "linear": 1, "yarn": 2}


def _head_sizes(model: NativeModel, info: dict[str, Any]) -> tuple[int, int]:
    """(key_length, value_length) per head, from the GGUF (n_embd / n_head when absent)."""
    arch = model.meta("general.architecture") or "llama"
    default = info["n_embd"] // max(info["n_head"], 1)
    key = model.meta(f"{arch}.attention.key_length")
    value = model.meta(f"{arch}.attention.value_length")
    return (int(key) if key else default, int(value) if value else default)
