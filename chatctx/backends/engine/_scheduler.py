"""Continuous batching: one thread owns the llama.cpp context and advances every generation.

Each step decodes one token of every generation that is streaming (one ``llama_decode``),
then at most one chunk of one prompt being evaluated (its own ``llama_decode``), so a long
prefill, a changed summary inserted in front of kept turns included, stalls running streams
for one chunk at most. After a decode each generation samples from its own row of logits
with its own sampler chain; text goes to the generation's queue, which its reader drains
from any thread.

A reply must not depend on who else is being served. llama.cpp's logits depend on how a
prompt is cut into batches (a 300-token prompt as one batch or as 256 + 44 differs by up to
0.5 in a logit on this CPU build) and on the other sequences' tokens in the same batch (a
prompt chunk beside another sequence's chunk: 0.55), while the streaming tokens of several
sequences decoded together are bitwise equal to each one decoded alone (split KV cache). So
chunk boundaries are a function of the sequence's own positions only (multiples of the
engine's ``prefill_chunk``, ``PREFILL_CHUNK`` on the CPU, or ``BACKGROUND_CHUNK`` for
background work), every chunk is decoded with
no other sequence's tokens, and streaming tokens go together (bench/README.md, "A reply
does not depend on load").

Summaries and other background generations step aside: they join a step only while no
customer's prompt is being evaluated, and their prompts go in small chunks.
"""

from __future__ import annotations

import codecs
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chatctx.backends.base import GenerationResult, KVReport, Timings, Usage
from chatctx.backends.engine._native import NativeContext, NativeModel, Sampler
from chatctx.backends.engine._sequences import Insert
from chatctx.errors import ClosedError, ConfigError
from chatctx.settings import GenerationSettings

logger = logging.getLogger("chatctx.backends.engine")

PREFILL_CHUNK = 256  # prompt chunk boundaries on the CPU: multiples of this many positions
BACKGROUND_CHUNK = 32  # prompt tokens per step of a background generation
LOOKAHEAD = 4  # chunks a generation may run ahead of its reader before it waits

_END = object()  # queue sentinel: the generation ended (its result is set)


@dataclass(eq=False)
class Job:
    """One generation as the scheduler sees it."""

    seq_id: int
    prompt: list[int]
    settings: GenerationSettings
    eviction: str
    history_start: int | None
    background: bool = False
    grammar: str | None = None  # GBNF the sampled tokens must follow
    first_token_only: bool = False
    state: str = "new"  # new -> prefill -> decode -> done
    todo: list[int] = field(default_factory=list)  # prompt tokens still to evaluate
    pos: int = 0  # position of the next token to evaluate
    pending: int | None = None  # sampled, not yet evaluated
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop: str | None = None
    error: BaseException | None = None
    report: KVReport | None = None
    insert: Insert | None = None  # tokens to evaluate in front of parked turns, first
    evaluated: int = 0  # prompt tokens actually decoded (what llama.cpp evaluated)
    deadline: float | None = None  # time.monotonic(): stopped with "timeout" once passed
    waited: int = 0  # steps since this prefill last had a chunk (round robin)
    sampler: Sampler | None = None
    batch_max: int = 0  # most sequences decoded together in one step with this one
    prefill_chunks: list[int] = field(default_factory=list)  # prompt tokens per step
    cancelled: bool = False
    out: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    t0: float = field(default_factory=time.perf_counter)
    t_prefilled: float | None = None
    t_first: float | None = None
    decoder: Any = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )


@dataclass
class BatchCounters:
    """What the scheduler did, for the monitor."""

    steps: int = 0
    tokens: int = 0
    sequences: int = 0  # summed over steps: sequences / steps is the mean batch
    max_sequences: int = 0


class Scheduler:
    """Owns decoding for an engine: jobs are submitted, one thread steps them all.

    ``lock`` is the engine's lock; the scheduler holds it for one step at a time.
    ``admit(job)`` brings a new job's sequence to a prefix of its prompt (KV reuse) and
    returns the report, where evaluation resumes and what to insert first; ``released(job)``
    is called once a job that had an insert ended (the spare sequence is free again).
    """

    def __init__(
        self,
        context: NativeContext,
        model: NativeModel,
        mirrors: dict[int, list[int]],
        *,
        lock: threading.RLock,
        n_ctx: int,
        admit: Callable[[Job], tuple[KVReport, int, Insert | None]],
        released: Callable[[Job], None] = lambda job: None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        self.context = context
        self.prefill_chunk = min(prefill_chunk, context.n_batch)
        self.model = model
        self.mirrors = mirrors
        self.n_ctx = n_ctx
        self._admit = admit
        self._released = released
        self._lock = lock
        self._work = threading.Condition(lock)
        self._jobs: list[Job] = []
        self._closing = False
        self._thread: threading.Thread | None = None
        self._waiting = 0  # threads waiting for the engine lock: the scheduler gives way
        self._waiting_lock = threading.Lock()
        self.counters = BatchCounters()

    @property
    def waiting(self) -> int:
        return self._waiting

    def wait_for_lock(self, delta: int) -> None:
        """A thread starts (+1) or stops (-1) waiting for the engine lock."""
        with self._waiting_lock:
            self._waiting += delta

    # submitting ---------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._work:
            if self._closing:
                raise ClosedError("engine")
            if self.active(job.seq_id):
                raise ConfigError(f"sequence {job.seq_id} is busy with another generation")
            job.t0 = time.perf_counter()
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="chatctx-scheduler", daemon=True
                )
                self._thread.start()
            self._work.notify_all()

    def cancel(self, job: Job, *, wait: bool = True) -> None:
        """Stop ``job`` at the next step (stop reason ``interrupted``)."""
        job.cancelled = True
        if job.state == "done":
            return
        if self._thread is threading.current_thread():
            return  # never happens for readers; the next step ends it
        with self._work:
            self._work.notify_all()
        if wait:
            job.done.wait()

    def active(self, seq_id: int) -> bool:
        return any(j.seq_id == seq_id for j in self._jobs)

    def close(self) -> None:
        """End every job (stop reason ``closed``) and stop the thread."""
        with self._work:
            self._closing = True
            self._work.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._work:
            for job in list(self._jobs):
                self._finish(job, "closed")

    # the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._work:
                while not self._closing and not self._runnable():
                    # Readers that fell behind wake us when they catch up (or we look again).
                    self._work.wait(0.01 if self._jobs else None)
                if self._closing:
                    for job in list(self._jobs):
                        self._finish(job, "closed")
                    return
                try:
                    self._step()
                except BaseException as exc:  # never leave a reader waiting forever
                    logger.exception("scheduler step failed")
                    for job in list(self._jobs):
                        self._fail(job, exc)
            if self.waiting:
                time.sleep(0.0005)  # let a thread waiting for the lock take it

    def _runnable(self) -> bool:
        return any(self._may_run(job) for job in self._jobs)

    def _may_run(self, job: Job) -> bool:
        if job.cancelled or job.state in ("new", "insert", "prefill"):
            return True
        if job.deadline is not None and time.monotonic() > job.deadline:
            return True
        return job.out.qsize() < LOOKAHEAD

    def _step(self) -> None:
        now = time.monotonic()
        for job in [j for j in self._jobs if j.deadline is not None and now > j.deadline]:
            self._finish(job, "timeout")
        for job in [j for j in self._jobs if j.cancelled]:
            self._finish(job, "interrupted")
        for job in [j for j in self._jobs if j.state == "new"]:
            try:
                job.report, resume, job.insert = self._admit(job)
            except BaseException as exc:
                self._fail(job, exc)
                continue
            if job.insert is not None and not job.insert.done:
                job.todo, job.pos, job.state = job.insert.tokens, job.insert.start, "insert"
            elif job.insert is not None:  # every run came back at once: no gap to evaluate
                self._released(job)
                job.todo, job.pos = job.prompt[job.insert.resume :], job.insert.resume
                job.state = "prefill"
            else:
                job.todo, job.pos, job.state = job.prompt[resume:], resume, "prefill"
        evaluating = [j for j in self._jobs if j.state in ("insert", "prefill")]
        foreground_prefill = any(not j.background for j in evaluating)
        streams: list[tuple[Job, list[int], bool]] = []
        for job in list(self._jobs):  # _finish removes from the list
            if job.state != "decode" or not self._may_run(job):
                continue
            if job.background and foreground_prefill:
                continue
            if len(self.mirrors[job.seq_id]) >= self.n_ctx:
                self._finish(job, "context_full")
                continue
            assert job.pending is not None
            streams.append((job, [job.pending], True))
        if streams:
            self._decode(streams)
        chosen = self._next_prefill(evaluating, foreground_prefill)
        if chosen is not None and chosen.state != "done":
            step = (
                min(BACKGROUND_CHUNK, self.prefill_chunk)
                if chosen.background
                else self.prefill_chunk
            )
            end = min((chosen.pos // step + 1) * step, chosen.pos + len(chosen.todo))
            chunk = chosen.todo[: end - chosen.pos]
            last = chosen.state == "prefill" and len(chunk) == len(chosen.todo)
            self._decode([(chosen, chunk, last)], company=len(streams))

    @staticmethod
    def _next_prefill(evaluating: list[Job], foreground_prefill: bool) -> Job | None:
        """The prompt that gets this step's chunk: customers before background work, then
        whoever waited longest."""
        candidates = [j for j in evaluating if not (j.background and foreground_prefill)]
        for job in evaluating:
            job.waited += 1
        if not candidates:
            return None
        job = max(candidates, key=lambda j: (not j.background, j.waited))
        job.waited = 0
        return job

    def _decode(self, parts: list[tuple[Job, list[int], bool]], *, company: int = 0) -> None:
        try:
            indices = self.context.decode_many(
                [(job.seq_id, tokens, job.pos, logits) for job, tokens, logits in parts]
            )
        except Exception as exc:
            for job, _, _ in parts:
                self._resync(job.seq_id)
            if len(parts) == 1:
                self._fail(parts[0][0], exc)
                return
            # Find the generation that failed: the others go on, one decode each.
            for part in parts:
                if part[0].state != "done":
                    self._decode([part])
            return
        counters = self.counters
        counters.steps += 1
        counters.tokens += sum(len(tokens) for _, tokens, _ in parts)
        width = len(parts) + company  # sequences advanced in this step
        counters.sequences += len(parts)
        counters.max_sequences = max(counters.max_sequences, width)
        now = time.perf_counter()
        for (job, tokens, _), index in zip(parts, indices, strict=True):
            self.mirrors[job.seq_id].extend(tokens)
            job.pos += len(tokens)
            job.batch_max = max(job.batch_max, width)
            if job.state in ("insert", "prefill"):
                job.evaluated += len(tokens)
                job.prefill_chunks.append(len(tokens))
                del job.todo[: len(tokens)]
                if job.todo:
                    continue
                if job.state == "insert":
                    self._end_insert(job)
                    continue
                job.t_prefilled = now
            else:
                job.pending = None
            self._sample(job, index)

    def _end_insert(self, job: Job) -> None:
        # A gap's tokens are in: the parked run comes back behind them; then the next gap,
        # or the rest of the prompt (never empty) from where the last run ends.
        insert = job.insert
        assert insert is not None
        try:
            insert.restore()
        except Exception as exc:
            self._fail(job, exc)  # releases the spare (the insert is aborted)
            return
        if not insert.done:
            job.todo, job.pos = insert.tokens, insert.start
            return
        self._released(job)
        job.todo, job.pos, job.state = job.prompt[insert.resume :], insert.resume, "prefill"

    def _sample(self, job: Job, index: int) -> None:
        try:
            if job.sampler is None:
                s = job.settings
                job.sampler = Sampler(
                    self.model,
                    temperature=s.temperature,
                    top_k=s.top_k,
                    top_p=s.top_p,
                    min_p=s.min_p,
                    repeat_penalty=s.repeat_penalty,
                    repeat_last_n=s.repeat_last_n,
                    seed=s.seed,
                    grammar=job.grammar,
                )
            token = job.sampler.sample(self.context, index)
        except Exception as exc:
            self._fail(job, exc)
            return
        if job.t_first is None:
            job.t_first = time.perf_counter()
            if job.first_token_only:
                self._finish(job, "length")
                return
        if self.model.is_eog(token):
            self._finish(job, "eog")
            return
        job.tokens.append(token)
        chunk = job.decoder.decode(self.model.piece(token))
        if chunk:
            job.text += chunk
            job.out.put(chunk)
        if len(job.tokens) >= job.settings.max_tokens:
            self._finish(job, "length")
            return
        job.pending = token
        job.state = "decode"

    # ending -------------------------------------------------------------------------------

    def _resync(self, seq_id: int) -> None:
        # After a failed decode, drop whatever llama.cpp kept beyond the mirror.
        if not self.context.closed:
            self.context.seq_rm(seq_id, len(self.mirrors[seq_id]), -1)

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.error = exc
        self._finish(job, "error")

    def _finish(self, job: Job, stop: str) -> None:
        if job.state == "done":
            return
        tail = job.decoder.decode(b"", final=True)
        if tail:
            job.text += tail
            job.out.put(tail)
        if job.sampler is not None:
            job.sampler.close()
            job.sampler = None
        if job.insert is not None and not job.insert.done:
            try:
                job.insert.abort()
            finally:
                self._released(job)
        job.stop = stop
        job.state = "done"
        if job in self._jobs:
            self._jobs.remove(job)
        job.result = _result(job)
        job.out.put(_END)
        job.done.set()
        self._work.notify_all()


def _result(job: Job) -> GenerationResult:
    t_end = time.perf_counter()
    t0 = job.t0
    first = job.t_first
    decode_s = t_end - first if first is not None else 0.0
    report = job.report
    reused = report.reused_tokens if report else 0
    if job.insert is not None and job.state == "done":
        reused -= job.insert.unrestored  # parked runs dropped by an abort were never used
    n = len(job.tokens)
    return GenerationResult(
        text=job.text,
        tokens=tuple(job.tokens),
        usage=Usage(
            prompt_tokens=len(job.prompt),
            reused_tokens=reused,
            evaluated_tokens=job.evaluated,
            generated_tokens=n,
        ),
        timings=Timings(
            prefill_ms=((job.t_prefilled or t_end) - t0) * 1000 if report else 0.0,
            ttft_ms=(first - t0) * 1000 if first is not None else None,
            engine_ttft_ms=(first - t0) * 1000 if first is not None else None,
            decode_ms=decode_s * 1000,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            total_ms=(t_end - t0) * 1000,
        ),
        stop_reason=job.stop or "interrupted",
        kv=report,
        started_at=t0,
        batch_max=max(job.batch_max, 1),
    )
