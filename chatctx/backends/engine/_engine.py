"""The llama.cpp engine: one model, one context, slots of conversations, a mirror of each.

For every sequence the engine keeps the exact token list that sits in the KV cache, so a
request reuses the longest common prefix and evaluates only the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from chatctx._resource import Closeable
from chatctx.backends.base import (
    GenerationResult,
    KVReport,
    MemorySnapshot,
    ModelInfo,
    RenderedPrompt,
    TextEmbedder,
    fit_side,
)
from chatctx.backends.device import memory_snapshot
from chatctx.backends.engine._embedder import local_embedder
from chatctx.backends.engine._native import NativeContext, NativeModel, supports_gpu_offload
from chatctx.backends.engine._pool import KVSlots
from chatctx.backends.engine._scheduler import PREFILL_CHUNK, BatchCounters, Job, Scheduler
from chatctx.backends.engine._sequences import Insert, prepare
from chatctx.backends.grammar import gbnf
from chatctx.backends.pool import PooledLeases
from chatctx.backends.swap import SwapEntry, fingerprint_mismatch
from chatctx.errors import (
    ChatctxError,
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    GenerationError,
    ModelError,
)
from chatctx.model import gguf
from chatctx.model.codec import PROBES, LlamaCodec, PromptCodec, open_codec
from chatctx.model.memory import kv_cells, pad256, summary_room_for
from chatctx.model.paths import resolve_model_path
from chatctx.model.template import template_for
from chatctx.model.tools import CallGrammar
from chatctx.settings import EngineConfig, GenerationSettings

logger = logging.getLogger("chatctx.backends.engine")

CLOSE_WAIT_S = 10.0  # close() waits this long for the turns it ended to give their slots back


class Generation:
    """A running generation: iterate for text chunks; ``result`` is set when it ends.

    The engine's scheduler advances it together with every other generation (one decode per
    step); reading it from any thread is safe. Closing it early (``close()``, or ``break``
    followed by garbage collection) ends it with stop reason ``interrupted``; the KV mirror
    stays exact either way.
    """

    def __init__(self, engine: Engine, job: Job) -> None:
        self.result: GenerationResult | None = None
        self.text = ""
        self._engine = engine
        self._job = job
        self._started = False
        self._submitted = False  # the scheduler has it: close() must wait for it to let go
        self._ended = False
        # Abandoned without close(): stop it at the next step, without waiting.
        self._finalizer = weakref.finalize(self, engine._scheduler.cancel, job, wait=False)

    @property
    def background(self) -> bool:
        return self._job.background

    @property
    def first_token_only(self) -> bool:
        return self._job.first_token_only

    @first_token_only.setter
    def first_token_only(self, value: bool) -> None:
        self._job.first_token_only = value

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        job = self._job
        if not self._started:
            # Started only once the scheduler has it: a refused submit (engine closing,
            # sequence busy) leaves nothing for close() to wait for.
            self._engine._submit(job)
            self._started = self._submitted = True
        if self._ended:
            raise StopIteration
        item = job.out.get()
        if isinstance(item, str):
            self.text += item
            return item
        self._ended = True
        self.result = job.result
        if job.error is not None:
            error = job.error
            job.error = None  # raised once
            raise error
        raise StopIteration

    def close(self) -> None:
        """Stop (stop reason ``interrupted``) and wait until the engine has let go of it.

        From another thread, the reader still gets the text generated before the stop:
        what a closed turn stores is what its client can read.
        """
        job = self._job
        if not self._submitted:  # never started (or closed before it started): nothing runs
            self._started = True
            self._ended = True
            return
        self._engine._scheduler.cancel(job)
        self.result = job.result

    def wait(self, *, first_token_only: bool = False) -> GenerationResult:
        """Run to the end and return the result (or stop once the first token is sampled)."""
        if not self._started:
            self._job.first_token_only = first_token_only
        for _ in self:
            pass
        if self.result is None:
            raise GenerationError("the generation was closed before it started")
        return self.result


class Engine(PooledLeases, Closeable):
    """llama.cpp with a Llama-3-style GGUF: tokenizer, chat template, KV slots, a scheduler.

    ``n_ctx`` is the context of one conversation; the KV cache holds ``slots`` of them plus
    a reserved sequence for summaries. Conversations lease slots (``lease``/``release``);
    a conversation that loses its slot is swapped to RAM or disk and restored when it comes
    back. Use as a context manager; ``close()`` ends running generations, keeps the slots'
    states on disk for the next run, then frees the context and the model.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        meta = gguf.read_metadata(config.model_path)  # clear error before llama.cpp sees it
        self.facts = gguf.model_facts(meta)
        self.template = template_for(
            meta,
            chat_template=config.chat_template,
            chat_format=config.chat_format,
            path=str(config.model_path),
        )
        # Every call that touches the llama.cpp context holds this lock; the scheduler holds
        # it for one decode step at a time.
        self._lock = threading.RLock()
        self._side = threading.Lock()  # one side generation (on the spare sequence) at a time
        self._spare_busy = False
        # The running side generation and the event that cancels it (see cancel_side).
        self._side_running: tuple[threading.Event | None, Generation] | None = None
        self._closed = False
        self._n_ctx = pad256(config.n_ctx)
        self.slots = min(config.slots, config.n_seq_max)
        reserved = config.n_seq_max - self.slots
        self._summary_room = summary_room_for(self._n_ctx, config.summary_room) if reserved else 0
        if reserved:
            cells = kv_cells(self._n_ctx, self.slots, config.kv_unified, self._summary_room)
        else:  # no reserved sequence: the slots alone
            cells = self.slots * self._n_ctx
        self._stack = ExitStack()
        try:
            self.model = NativeModel(config.model_path, n_gpu_layers=config.n_gpu_layers)
            self._stack.callback(self.model.close)
            self.context = NativeContext(
                self.model,
                n_ctx=cells,
                n_ctx_seq=self._n_ctx,
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
            self.kv_cells_total = self.context.n_ctx
            # Known once: asked of a closed engine too (a router picking a layout).
            self._cache_edits = "in-place" if self.context.can_shift() else "prefix"
            self._mirror: dict[int, list[int]] = {s: [] for s in range(config.n_seq_max)}
            self._codec: PromptCodec | None = None
            self.gpu_offload = supports_gpu_offload() and config.n_gpu_layers != 0
            # A GPU evaluates a whole n_batch for little more than a smaller chunk.
            chunk = config.prefill_chunk or (config.n_batch if self.gpu_offload else PREFILL_CHUNK)
            self._scheduler = Scheduler(
                self.context,
                self.model,
                self._mirror,
                lock=self._lock,
                n_ctx=self._n_ctx,
                admit=self._admit,
                released=self._released,
                prefill_chunk=chunk,
            )
            self.kv_slots = KVSlots(self)
            self._stack.callback(self.kv_slots.directory.close)  # a failed load lets go
            self.pool = self.kv_slots.pool
            self.swap = self.kv_slots.swap
        except BaseException:
            self._stack.close()  # nothing built here outlives a failed load
            raise
        logger.debug(
            "loaded %s: n_ctx=%d slots=%d cells=%d template=%s gpu=%s",
            config.model_path,
            self.n_ctx,
            self.slots,
            self.kv_cells_total,
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
        """End live generations (stop reason ``closed``), wait for the sessions running them
        to store their replies and give their slots back (10 s at most), keep the slots'
        states on disk, free everything."""
        if self._closed:
            return
        self._scheduler.close()
        # The sessions whose replies just ended store them (partial) and give their slots
        # back; the engine stays usable for that (their turn records read its cells).
        if not self.pool.wait_released(CLOSE_WAIT_S):
            logger.warning("closing the engine with slots still leased")
        self.pool.close()
        with self._locked():
            self._closed = True
            self.kv_slots.persist()
            self._stack.close()
        self.kv_slots.close()

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
        """Tokens one conversation (one slot) can hold."""
        return self._n_ctx

    @property
    def model_name(self) -> str:
        return self.config.model_path.name

    @property
    def cache_edits(self) -> str:
        """ "in-place": evicted spans are removed and kept runs shifted (a model whose cache
        cannot shift positions re-evaluates instead: "prefix")."""
        return self._cache_edits

    @property
    def side_room(self) -> int:
        """Tokens a side generation (a summary: prompt and output) may use."""
        if self.spare_seq is None:
            return 0
        return self._n_ctx if not self.config.kv_unified else self._summary_room

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
            slots=self.slots,
            kv_cells=self.kv_cells_total,
        )

    def fingerprint(self) -> dict[str, Any]:
        """What a saved sequence state depends on: the model, the KV layout and types."""
        path = self.config.model_path
        digest = hashlib.sha256()
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
        return {
            "model": path.name,
            "model_bytes": path.stat().st_size,
            "model_sha256_1mib": digest.hexdigest()[:16],
            "n_ctx": self._n_ctx,
            "kv_unified": self.config.kv_unified,
            "type_k": self.config.type_k,
            "type_v": self.config.type_v,
            "flash_attn": self.config.flash_attn,
        }

    # text ---------------------------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text (``<|eot_id|>``) is parsed when asked.

        Prompts built from messages go through ``prompt_tokens``, which parses only the
        template's own markup.
        """
        with self._locked():
            self._check_open()
            return self.model.tokenize(text, add_special=False, parse_special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        with self._locked():
            self._check_open()
            return self.model.detokenize(tokens, special=special)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> RenderedPrompt:
        return self.codec().render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )

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
        with self._locked():
            self._check_seq(seq_id)
            return tuple(self._mirror[seq_id])

    def kv_cells(self, seq_id: int = 0) -> int:
        """Cells used by ``seq_id``, read from llama.cpp (pos_max - pos_min + 1)."""
        with self._locked():
            self._check_seq(seq_id)
            lo, hi = self.context.seq_pos_min(seq_id), self.context.seq_pos_max(seq_id)
            return 0 if hi < 0 else hi - lo + 1

    def kv_usage(self, *, known: bool = False) -> dict[int, int]:
        """Cells used by every sequence, read from llama.cpp (in this process: known)."""
        with self._locked():
            return {seq: self.kv_cells(seq) for seq in range(self.config.n_seq_max)}

    def mirrored_cells(self) -> dict[int, int]:
        """Tokens each sequence holds, as chatctx mirrors llama.cpp's cache (no llama.cpp
        call: cheap enough for the slot table written after each turn)."""
        return {seq: len(tokens) for seq, tokens in list(self._mirror.items())}

    def export_sequence(
        self, seq_id: int, *, clear: bool = False
    ) -> tuple[tuple[int, ...], bytes | None, str | None]:
        """(tokens, llama.cpp's state, why no state) of sequence ``seq_id``: the state is None
        for an empty sequence, or with the reason when llama.cpp cannot save it. ``clear``
        empties the sequence after (a slot handed to another conversation)."""
        with self._locked():
            if self.context.closed:
                raise ClosedError("engine")
            tokens = tuple(self._mirror[seq_id])
            data: bytes | None = None
            error: str | None = None
            if tokens:
                try:
                    data = self.context.state_seq_get(seq_id)
                except ChatctxError as exc:
                    error = str(exc)
            if clear:
                self.context.seq_rm(seq_id, 0, -1)
                self._mirror[seq_id].clear()
        return tokens, data, error

    def import_sequence(self, seq_id: int, tokens: Sequence[int], data: bytes) -> str | None:
        """Load a state ``export_sequence`` gave into sequence ``seq_id`` (emptied first);
        None once it holds ``tokens``, else why llama.cpp refused it (the sequence is then
        left empty)."""
        with self._locked():
            self._check_open()
            context = self.context
            context.seq_rm(seq_id, 0, -1)
            self._mirror[seq_id].clear()
            ok = context.state_seq_set(seq_id, data)
            lo, hi = context.seq_pos_min(seq_id), context.seq_pos_max(seq_id)
            if ok and lo == 0 and hi == len(tokens) - 1:
                self._mirror[seq_id].extend(tokens)
                return None
            context.seq_rm(seq_id, 0, -1)
        return f"llama.cpp refused the saved state (positions {lo}..{hi} for {len(tokens)} tokens)"

    def memory(self) -> MemorySnapshot:
        """This process's resident set and the GPU's memory (NVML): the engine lives here."""
        return memory_snapshot()

    def embedder(self) -> TextEmbedder | None:
        """The local sentence embedder (all-MiniLM-L6-v2, on llama.cpp), when installed."""
        return local_embedder()

    def clear(self, seq_id: int | None = None) -> None:
        """Forget one sequence (or all) in the KV cache; a running generation's is refused."""
        with self._locked():
            self._check_open()
            seqs = range(self.config.n_seq_max) if seq_id is None else [seq_id]
            for seq in seqs:
                self._check_seq(seq)
                if self._scheduler.active(seq) or (seq == self.spare_seq and self._spare_busy):
                    raise ConfigError(f"sequence {seq} is in use by a running generation")
            for seq in seqs:
                self.context.seq_rm(seq, 0, -1)
                self._mirror[seq].clear()
                self.pool.forget(seq)

    # moving a conversation to another engine (a router's drain) ------------------------

    def export_state(self, conversation: str) -> SwapEntry | None:
        """Take ``conversation``'s KV state out of this engine (its slot or its swap): the
        state, or None when it holds none. Waits for its turn in flight to end."""
        self._check_open()
        self.pool.evict(conversation)
        return self.kv_slots.swap.take(conversation).entry

    def import_state(self, conversation: str, state: object) -> bool:
        """Keep a state ``export_state`` gave (of an engine with the same fingerprint) for
        ``conversation``'s next lease, which restores it instead of prefilling. False when
        the state is not one this engine can load."""
        self._check_open()
        if not isinstance(state, SwapEntry) or state.owner != conversation:
            return False
        if fingerprint_mismatch(state.fingerprint, self.kv_slots.swap.fingerprint):
            return False
        return self.kv_slots.swap.put(state) != "dropped"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # The scheduler steps back between decodes while another thread waits for the lock.
        self._scheduler.wait_for_lock(+1)
        try:
            self._lock.acquire()
        finally:
            self._scheduler.wait_for_lock(-1)
        try:
            yield
        finally:
            self._lock.release()

    # slots --------------------------------------------------------------------------------

    # lease, release, pin, unpin: PooledLeases

    def slot_table(self) -> dict[str, Any]:
        """The pool as the monitor shows it (``chatctx stats --slots``)."""
        return self.kv_slots.table(self._scheduler.counters)

    def write_slot_table(self) -> None:
        """Write ``slot_table()`` to the configured file (atomically); failures are logged."""
        self.kv_slots.write_table(self._scheduler.counters)

    # generation ---------------------------------------------------------------------------

    @property
    def spare_seq(self) -> int | None:
        """The sequence kept free for side work (summaries, reordering), if there is one."""
        n = self.config.n_seq_max
        return n - 1 if n > self.slots else None

    def side_generate(
        self,
        prompt: Sequence[int],
        *,
        settings: GenerationSettings,
        background: bool = False,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> str:
        """Generate on the spare sequence (a summary, say) and return the text.

        One side generation runs at a time; the spare sequence is emptied afterwards. In the
        background it joins the scheduler's steps only while no customer's prompt is being
        evaluated, in small chunks. ``deadline`` (``time.monotonic()``) is kept by the
        scheduler, also while the generation steps aside: once passed it stops with
        ``DeadlineExceeded``; ``cancel_side(cancel)`` stops it at the next step, in its prefill
        too, with ``GenerationError``.
        """
        spare = self.spare_seq
        if spare is None:
            raise ConfigError("side generations need a reserved sequence (n_seq_max > slots)")
        settings = fit_side(len(prompt), self.side_room, settings, "summary room")
        with self._side:
            while True:  # a changed summary's insert may hold the spare for a few steps
                with self._locked():
                    self._check_open()
                    if not self._spare_busy:
                        self._spare_busy = True
                        break
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        "side generation not started before its deadline", what="summary"
                    )
                time.sleep(0.005)
            try:
                generation = self._generation(
                    prompt, spare, settings, "recompute", None, background
                )
                generation._job.deadline = deadline
                # Registered before the check: a cancel_side either sees it or was seen.
                self._side_running = (cancel, generation)
                try:
                    if cancel is not None and cancel.is_set():
                        raise GenerationError("side generation cancelled")
                    for _ in generation:
                        pass
                    if generation.result is not None and generation.result.stop_reason == (
                        "timeout"
                    ):
                        raise DeadlineExceeded(
                            "side generation not done before its deadline", what="summary"
                        )
                    if cancel is not None and cancel.is_set():
                        raise GenerationError("side generation cancelled")
                finally:
                    self._side_running = None
                    generation.close()
                return generation.text
            finally:
                with self._locked():
                    self._spare_busy = False
                    if not self._closed:
                        self.context.seq_rm(spare, 0, -1)
                        self._mirror[spare].clear()

    def cancel_side(self, cancel: threading.Event) -> None:
        """Set ``cancel`` and stop the side generation started with it, if one runs (in its
        prefill too); the caller of ``side_generate`` gets ``GenerationError``."""
        cancel.set()
        running = self._side_running
        if running is not None and running[0] is cancel:
            self._scheduler.cancel(running[1]._job, wait=False)

    def generate(
        self,
        prompt: Sequence[int],
        *,
        seq_id: int = 0,
        settings: GenerationSettings | None = None,
        eviction: str = "shift",
        history_start: int | None = None,
        grammar: CallGrammar | None = None,
    ) -> Generation:
        """Start generating after ``prompt`` on ``seq_id``; iterate the result for text.

        ``eviction="shift"`` reuses cached turns that moved (evicted turns before them are
        removed and the rest shifted in place); ``"recompute"`` re-evaluates everything after
        the common prefix. ``history_start`` (where the kept turns begin in the prompt) lets a
        shift also work when new tokens, such as a changed summary, precede them.
        ``grammar`` holds every sampled token to what it allows (a required tool call).
        """
        self._check_seq(seq_id)
        if eviction not in ("shift", "recompute"):
            raise ConfigError(f"eviction must be 'shift' or 'recompute', not {eviction!r}")
        if not prompt:
            raise GenerationError("empty prompt")
        if len(prompt) >= self.n_ctx:
            raise GenerationError(f"prompt of {len(prompt)} tokens does not fit n_ctx={self.n_ctx}")
        rules = gbnf(grammar) if grammar is not None else None
        return self._generation(
            prompt, seq_id, settings or GenerationSettings(), eviction, history_start, False, rules
        )

    def _generation(
        self,
        prompt: Sequence[int],
        seq_id: int,
        settings: GenerationSettings,
        eviction: str,
        history_start: int | None,
        background: bool,
        grammar: str | None = None,
    ) -> Generation:
        job = Job(
            seq_id=seq_id,
            prompt=list(prompt),
            settings=settings,
            eviction=eviction,
            history_start=history_start,
            background=background,
            grammar=grammar,
        )
        return Generation(self, job)

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

    @property
    def prefill_chunk(self) -> int:
        """Most prompt tokens of one conversation per decode call (``EngineConfig``)."""
        return self._scheduler.prefill_chunk

    @property
    def batch_counters(self) -> BatchCounters:
        """Decode steps, tokens and sequences per step so far (continuous batching)."""
        return self._scheduler.counters

    def _submit(self, job: Job) -> None:
        with self._locked():
            self._check_open()
            self._scheduler.submit(job)

    def _admit(self, job: Job) -> tuple[KVReport, int, Insert | None]:
        """Bring the job's sequence to a prefix of its prompt (in the scheduler's step)."""
        self._check_seq(job.seq_id)
        spare = self.spare_seq
        admitted = prepare(
            self.context,
            self._mirror[job.seq_id],
            job.seq_id,
            job.prompt,
            eviction=job.eviction,
            history_start=job.history_start,
            spare=spare,
            spare_free=not self._spare_busy and spare != job.seq_id,
            unified=self.config.kv_unified,
        )
        if admitted[2] is not None:
            self._spare_busy = True  # the kept turns are parked there until the insert ends
        return admitted

    def _released(self, job: Job) -> None:
        # An insert ended (done, cancelled or failed): the spare sequence is free again.
        self._spare_busy = False
