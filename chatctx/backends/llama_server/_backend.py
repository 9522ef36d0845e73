"""``LlamaServerBackend``: chatctx's ``Backend`` on one running llama.cpp ``llama-server``.

chatctx keeps doing what it does with the in-process engine (render, count, trim whole
turns, summarize, store, record) and sends each turn's exact token array to
``POST /completion`` with ``cache_prompt`` on and ``id_slot`` pinned to the slot the
conversation leased, so the server reuses that slot's cached prefix. The slots are the
server's (``total_slots`` from ``GET /props``); the last one is kept for summaries
(``side_generate``) so they never evict a customer's cache. A conversation needing a slot
when all are taken gets the least recently used idle one: the server overwrites that slot's
cache, and the conversation that had it re-evaluates its prompt when it comes back
(``Lease.reprefill_reason`` says so; a server with a host-RAM prompt cache, ``--cache-ram``,
may still bring it back: the turn's ``reused_tokens``, the server's ``cache_n``, tell; an
edited prompt is preceded by a request for the last one, which that cache finds, see
``_slot_files.SlotFiles._bring_back``). With
``swap=True`` the slot is saved to a file in the server's ``--slot-save-path`` first and
restored into the slot the conversation gets when it comes back (``Lease.swap_in`` "disk"):
the server's own prompt cache only looks for a better prompt when a slot would lose most of
what it holds, which short chats behind one long system prompt never do.

What differs from ``Engine``: the server reuses the common prefix and then, with
``n_cache_reuse`` (sent with every request, ``cache_reuse`` tokens: the server's own
``--cache-reuse`` need not be set), the cached runs that follow it in order, shifted back over
deleted spans; text inserted in front of cached runs hides them (``cache_edits`` is
"deletions", so a session lays its prompts out with the summary appended, see
``chatctx.context._layout``). ``KVReport.policy`` is ``"server"``, its reuse the server's own
``cache_n``, its shifts what the server's reuse walk moves (``plan_in_order``); a server that
kept less than that walk allows says so in ``KVReport.fallback``. Its repeat penalty's window
also covers the prompt (the engine's covers the reply only), so replies match the engine's
token for token at ``repeat_penalty=1.0``.
"""

from __future__ import annotations

import array
import collections
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from chatctx._resource import Closeable
from chatctx.backends.base import (
    Codec,
    KVReport,
    Lease,
    MemorySnapshot,
    ModelInfo,
    TextEmbedder,
    fit_side,
)
from chatctx.backends.engine import local_embedder
from chatctx.backends.grammar import gbnf
from chatctx.backends.llama_server._codec import server_codec
from chatctx.backends.llama_server._http import check, require_httpx, translated
from chatctx.backends.llama_server._slot_files import SlotFiles
from chatctx.backends.llama_server._stream import ServerStream
from chatctx.backends.pool import PooledLeases, SlotPool
from chatctx.errors import (
    BackendUnavailable,
    ChatctxError,
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    GenerationError,
)
from chatctx.model.codec import PROBES
from chatctx.model.gguf import model_facts, read_metadata
from chatctx.model.kv import SERVER_MIN_CHUNK, plan_in_order
from chatctx.model.paths import resolve_model_path
from chatctx.model.tools import CallGrammar
from chatctx.settings import SWAP_DISK_MB, GenerationSettings

logger = logging.getLogger("chatctx.backends.llama_server")

CLOSE_WAIT_S = 10.0  # close() waits this long for sessions to give their slots back
HEALTH_TIMEOUT_S = 5.0  # /health and /slots wait no longer: a hung server stalls nothing
SIDE_POLL_S = 0.05  # a summary waiting for the summary slot looks at its cancel this often
# Stop reasons of a summary that ran to its end; "context_full" is a length stop at the
# slot's edge (fit_side caps max_tokens there).
SIDE_DONE = frozenset({"eog", "length", "context_full"})


class LlamaServerBackend(SlotFiles, PooledLeases, Closeable):
    """A ``Backend`` on the llama-server at ``url`` (``http://127.0.0.1:8080``).

    ``model`` is the GGUF the server runs (or the same tokenizer and template): chatctx
    renders and counts with it locally; None means ``CHATCTX_MODEL`` or the embedded default.
    At start ``GET /props`` is read and a mismatch refused with ``ConfigError``: ``n_ctx``
    (tokens per slot) given and different from the server's, a vocabulary that tokenizes the
    probe texts differently from the server's ``/tokenize``, too few slots (two with
    ``summary_slot``). ``timeout`` bounds each read from the server (seconds; a silent
    server raises ``BackendUnavailable(reason="timeout")``); ``wait_ready`` waits that long
    for ``/health`` (a server still loading). ``slot_save_path`` is the server's
    ``--slot-save-path`` (``export_state``/``import_state``/``forget`` need it). ``embedder``
    ranks recall by meaning (default: the local all-MiniLM-L6-v2 when installed). ``name`` is
    how errors and records call it (default: the URL). ``cache_reuse`` is the ``n_cache_reuse``
    sent with each request: the shortest cached run the server shifts into place instead of
    evaluating again (0: the common prefix only, as a server without ``--cache-reuse``).
    ``swap`` saves a slot given to another conversation to a file in ``slot_save_path`` and
    restores it when its conversation comes back (one file per conversation, overwritten).
    ``swap_disk_mb`` bounds those files: beyond it the files of the conversations swapped out
    longest ago are deleted (they prefill when they come back), where the server's directory
    is seen from this machine; elsewhere a warning says the folder needs cleaning.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | Path | None = None,
        n_ctx: int | None = None,
        summary_slot: bool = True,
        timeout: float = 120.0,
        wait_ready: float = 0.0,
        slot_save_path: str | Path | None = None,
        embedder: TextEmbedder | None = None,
        name: str | None = None,
        chat_template: str | None = None,
        chat_format: str | None = None,
        cache_reuse: int = SERVER_MIN_CHUNK,
        swap: bool = False,
        swap_disk_mb: float = SWAP_DISK_MB,
    ) -> None:
        require_httpx()
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"LlamaServerBackend takes one URL (http://host:port), not {url!r}; "
                "several servers go behind a router"
            )
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, not {timeout}")
        if cache_reuse < 0:
            raise ConfigError(f"cache_reuse must be 0 or more tokens, not {cache_reuse}")
        self.cache_reuse = cache_reuse
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.model_path = resolve_model_path(model)
        self.slot_save_path = None if slot_save_path is None else Path(slot_save_path)
        if swap and self.slot_save_path is None:
            raise ConfigError(
                "swap=True needs slot_save_path: the server's --slot-save-path, where a slot "
                "given to another conversation is saved"
            )
        if swap_disk_mb <= 0:
            raise ConfigError(f"swap_disk_mb must be positive, not {swap_disk_mb}")
        self.swap = swap
        self.swap_disk_bytes = int(swap_disk_mb * 2**20)
        self._saved: dict[str, tuple[str, tuple[int, ...]]] = {}  # swapped out: file, tokens
        # Bytes of each conversation's swap file, the one saved longest ago first.
        self._files: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._warned_disk = False
        self._embedder = embedder
        self._closed = False
        self._closing = False  # close() began: no new work, running replies end
        self._lock = threading.Lock()
        self._side = threading.Lock()  # one summary at a time on the summary slot
        self._side_running: tuple[threading.Event | None, ServerStream] | None = None
        # Running generations (their workers hold them); one dropped unread never ran.
        self._streams: weakref.WeakSet[ServerStream] = weakref.WeakSet()
        self._lost: dict[str, str] = {}  # conversations whose slot went to another: why
        # Without swap: the last prompt of each conversation that lost its slot, and whether
        # the server's host-RAM prompt cache gives such a prompt back (see _bring_back).
        self._left: collections.OrderedDict[str, array.array[int]] = collections.OrderedDict()
        self._ram_cache = True
        self._mirror: dict[int, list[int]] = {}  # what chatctx believes each slot holds
        self._last_usage: dict[int, int] = {}
        self._usage_failed = False  # warned that /slots failed (once until it answers again)
        limit = httpx.Timeout(timeout, connect=min(timeout, 5.0))
        self._client = httpx.Client(
            base_url=self.url,
            timeout=limit,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        )
        # Replies stream on connections of their own, never kept alive: each stream knows
        # its socket from the moment it connects, so close() can shut it down mid-prefill.
        self._stream_client = httpx.Client(
            base_url=self.url,
            timeout=limit,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        try:
            if wait_ready > 0:
                self._wait_ready(wait_ready)
            self.props = self._get("/props", "reading /props")
            self._setup(n_ctx, summary_slot)
            self._codec = server_codec(
                self.model_path,
                lambda text, special: self.tokenize(text, special=special),
                chat_template=chat_template,
                chat_format=chat_format,
            )
            self._check_vocabulary()
        except BaseException:
            self._client.close()
            self._stream_client.close()
            raise
        logger.debug(
            "llama-server %s: n_ctx=%d slots=%d summary slot=%s build=%s",
            self.name,
            self._n_ctx,
            self.slots,
            self.summary_seq,
            self.props.get("build_info"),
        )

    # setup --------------------------------------------------------------------------------

    def _setup(self, n_ctx: int | None, summary_slot: bool) -> None:
        props = self.props
        total = props.get("total_slots")
        defaults = props.get("default_generation_settings") or {}
        served = defaults.get("n_ctx")
        if not isinstance(total, int) or not isinstance(served, int):
            raise ConfigError(
                f"{self.name}/props has no total_slots or default_generation_settings.n_ctx: "
                "is this a llama-server?"
            )
        if n_ctx is not None and n_ctx != served:
            raise ConfigError(
                f"llama-server at {self.name} holds {served} tokens per slot, not n_ctx={n_ctx}: "
                f"start it with -c {n_ctx * total} -np {total} (or leave n_ctx unset)"
            )
        needed = 2 if summary_slot else 1
        if total < needed:
            raise ConfigError(
                f"llama-server at {self.name} has {total} slot(s); chatctx needs {needed} "
                "(one kept for summaries): start it with -np 2 or more, or summary_slot=False"
            )
        self._n_ctx = served
        self.total_slots = total
        self.slots = total - 1 if summary_slot else total
        self.summary_seq: int | None = total - 1 if summary_slot else None
        self._mirror = {s: [] for s in range(total)}
        self.pool = SlotPool(self.slots, swap_out=self._swap_out, swap_in=self._swap_in)

    def _check_vocabulary(self) -> None:
        """The local model must tokenize as the server's: probe texts through both."""
        for probe in PROBES:
            local = self._codec.encode(probe)
            served = self.tokenize(probe, special=True)
            if local != served:
                raise ConfigError(
                    f"the local model {self.model_path.name} tokenizes differently from the "
                    f"llama-server at {self.name} (which runs {self.props.get('model_path')}): "
                    f"{probe!r} is {local[:12]} here, {served[:12]} there; pass model= the "
                    "GGUF the server runs"
                )

    def _wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.health()
                return
            except BackendUnavailable:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    # HTTP ---------------------------------------------------------------------------------

    def _get(self, path: str, what: str, *, timeout: float | None = None) -> Any:
        with translated(self.name, what):
            response = (
                self._client.get(path)
                if timeout is None
                else self._client.get(
                    path, timeout=min(timeout, self._client.timeout.read or timeout)
                )
            )
            return check(response, self.name, what)

    def _post(self, path: str, body: Mapping[str, Any], what: str) -> Any:
        with translated(self.name, what):
            return check(self._client.post(path, json=dict(body)), self.name, what)

    def health(self) -> None:
        """Return when the server answers ``/health``; else ``BackendUnavailable``
        (reason ``refused``, ``loading`` while it loads the model, ``down``, ``timeout``
        after ``HEALTH_TIMEOUT_S``: a server busy with prompts still answers it at once)."""
        self._get("/health", "health check", timeout=HEALTH_TIMEOUT_S)

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """The server's ``/tokenize`` of ``text`` (no BOS added)."""
        body = self._post(
            "/tokenize",
            {"content": text, "add_special": False, "parse_special": special},
            "tokenize",
        )
        return [int(t) for t in body.get("tokens", [])]

    # facts --------------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """Tokens one slot of the server holds (its ``-c`` divided among ``-np`` slots)."""
        return self._n_ctx

    @property
    def side_room(self) -> int:
        return self._n_ctx if self.summary_seq is not None else 0

    @property
    def cache_edits(self) -> str:
        return "deletions" if self.cache_reuse > 0 else "prefix"

    @property
    def model_name(self) -> str:
        return self.model_path.name

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closing:
            raise ClosedError("llama-server backend")

    def info(self) -> ModelInfo:
        """The local GGUF's facts with the server's layout (slots, n_ctx, build)."""
        facts = model_facts(read_metadata(self.model_path))
        return ModelInfo(
            path=self.model_path,
            architecture=str(facts.get("architecture") or "unknown"),
            description=f"llama-server at {self.name}",
            n_params=0,
            n_layer=facts.get("n_layer") or 0,
            n_ctx_train=facts.get("n_ctx_train") or 0,
            n_vocab=facts.get("vocab_size") or 0,
            n_ctx=self._n_ctx,
            n_seq_max=self.total_slots,
            chat_template=getattr(self._codec.template, "name", "gguf"),
            gpu_offload=False,
            kv_bytes_per_token_f16=facts.get("kv_bytes_per_token_f16"),
            slots=self.slots,
            kv_cells=self._n_ctx * self.total_slots,
            extra={
                "backend": "llama-server",
                "url": self.url,
                "build_info": self.props.get("build_info"),
                "server_model_path": self.props.get("model_path"),
                "total_slots": self.total_slots,
                "summary_slot": self.summary_seq,
            },
        )

    def codec(self) -> Codec:
        return self._codec

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self._codec.prompt_tokens(messages)

    # slots --------------------------------------------------------------------------------

    # lease, release, pin, unpin: PooledLeases over the server's slots (the summary one aside)

    def slot_of(self, conversation: str) -> int | None:
        """The slot holding ``conversation``'s cache, None when it has none."""
        slot = self.pool.slot_of(conversation)
        return None if slot is None else slot.seq_id

    def kv_usage(self, *, known: bool = False) -> dict[int, int]:
        """Tokens each server slot holds (``GET /slots``: ``n_prompt_tokens``).

        ``known``: the tokens chatctx sent to each slot and received from it (the mirror
        ``generate`` plans cache reuse with; equal to ``n_prompt_tokens`` once a generation
        has ended), no request made. A turn's record reads these: ``GET /slots`` waits for
        the server's loop to finish its step, a slot held idle meanwhile.

        Otherwise best effort: a server that cannot answer (within ``HEALTH_TIMEOUT_S``)
        gives the last figures read (logged).
        """
        if known:
            with self._lock:
                return {seq: len(tokens) for seq, tokens in self._mirror.items()}
        try:
            slots = self._get("/slots", "reading /slots", timeout=HEALTH_TIMEOUT_S)
        except ChatctxError as exc:  # down, or /slots refused (a proxy, a build without it)
            log = logger.debug if self._usage_failed else logger.warning
            self._usage_failed = True
            log("kv usage of %s unknown: %s", self.name, exc)
            return dict(self._last_usage)
        self._usage_failed = False
        usage = {
            int(s["id"]): int(s.get("n_prompt_tokens") or 0)
            for s in slots
            if isinstance(s, dict) and "id" in s
        }
        self._last_usage = usage
        return usage

    def memory(self) -> MemorySnapshot | None:
        """None: the model's memory is the server's process, not this one."""
        return None

    def embedder(self) -> TextEmbedder | None:
        """The given embedder, else the local all-MiniLM-L6-v2 when installed."""
        return self._embedder if self._embedder is not None else local_embedder()

    def clear(self, seq_id: int | None = None) -> None:
        """Forget one slot's cache (or every slot's): erased on the server where it has a
        ``--slot-save-path`` (the only way it allows), else just no longer reused."""
        self._check_open()
        seqs = range(self.total_slots) if seq_id is None else [seq_id]
        for seq in seqs:
            self._check_slot(seq, summary=True)
            if any(s._body.get("id_slot") == seq for s in list(self._streams)):
                raise ConfigError(f"slot {seq} is in use by a running generation")
        for seq in seqs:
            self._erase(seq)
            with self._lock:
                self._mirror[seq] = []
            if seq < self.slots:
                self.pool.forget(seq)

    def _erase(self, seq: int) -> None:
        if self.slot_save_path is not None:
            self._post(f"/slots/{seq}?action=erase", {}, f"erasing slot {seq}")

    def _check_slot(self, seq_id: int, *, summary: bool = False) -> None:
        top = self.total_slots if summary else self.slots
        if not 0 <= seq_id < top:
            raise ConfigError(
                f"slot {seq_id} is not a conversation slot of {self.name}: "
                f"slots are 0..{self.slots - 1}"
                + (
                    f", {self.summary_seq} is kept for summaries"
                    if self.summary_seq is not None
                    else ""
                )
            )

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
    ) -> ServerStream:
        """Stream a reply to ``prompt`` (token ids) from server slot ``seq_id``.

        A prompt longer than the slot raises ``ContextBudgetError`` (the server's verdict).
        ``grammar`` goes to the server as a GBNF grammar (its sampler holds the reply to it).
        """
        self._check_open()
        self._check_slot(seq_id)
        if eviction not in ("shift", "recompute"):
            raise ConfigError(f"eviction must be 'shift' or 'recompute', not {eviction!r}")
        if not prompt:
            raise GenerationError("empty prompt")
        # history_start is for an engine that moves runs behind inserted text; the server
        # walks its cache in order (see plan_in_order).
        rules = gbnf(grammar) if grammar is not None else None
        return self._stream(prompt, seq_id, settings or GenerationSettings(), rules)

    def _stream(
        self,
        prompt: Sequence[int],
        seq_id: int,
        settings: GenerationSettings,
        grammar: str | None = None,
    ) -> ServerStream:
        tokens = [int(t) for t in prompt]
        body: dict[str, Any] = {
            "prompt": tokens,
            "id_slot": seq_id,
            "cache_prompt": True,
            "stream": True,
            "return_tokens": True,
            "timings_per_token": True,  # an interrupted reply still has its figures
            "n_predict": settings.max_tokens,
            "temperature": settings.temperature,
            "top_k": settings.top_k,
            "top_p": settings.top_p,
            "min_p": settings.min_p,
            "repeat_penalty": settings.repeat_penalty,
            "repeat_last_n": settings.repeat_last_n,
            "n_cache_reuse": self.cache_reuse,
        }
        if settings.seed is not None:
            body["seed"] = settings.seed
        if grammar is not None:
            body["grammar"] = grammar
        with self._lock:
            before = list(self._mirror[seq_id])
        brought = None if before else self._bring_back(seq_id, tokens)
        before, asked = brought or (before, 0)

        def report(cache_n: int, prompt_n: int) -> KVReport:
            plan = plan_in_order(before, tokens, min_chunk=self.cache_reuse)
            expected = plan.prefix + plan.chunk_len
            moved = [end - start for start, end, delta in plan.moves() if delta]
            # Fewer: the slot lost its cache meanwhile, or a build without per-request
            # n_cache_reuse; more: its host-RAM prompt cache gave back a lost prompt.
            as_walked = cache_n == expected
            return KVReport(
                policy="server",
                reused_tokens=cache_n,
                evaluated_tokens=prompt_n + asked,  # with what bringing the prompt back took
                evicted_tokens=max(0, len(before) - cache_n),
                shifted_tokens=sum(moved) if as_walked else 0,
                shift_count=len(moved) if as_walked else 0,
                fallback=None
                if cache_n >= expected
                else f"llama-server reused {cache_n} of the {expected} cached tokens its "
                f"cache reuse could keep",
            )

        stream = ServerStream(
            self._stream_client,
            self.name,
            body,
            prompt=tokens,
            n_ctx=self._n_ctx,
            report=report,
            done=self._ended,
            asked=asked,
        )
        with self._lock:
            self._check_open()
            self._streams.add(stream)
        return stream

    def _ended(self, stream: ServerStream) -> None:
        seq = int(stream._body["id_slot"])
        result = stream.result
        with self._lock:
            self._streams.discard(stream)
            if result is None:
                return
            if result.kv is None:  # the server said nothing: what it holds is unknown
                self._mirror[seq] = []
                return
            kept = list(stream._body["prompt"])
            generated = list(result.tokens)
            # Fewer tokens than generated: the server never sent some (a character split over
            # several). The slot holds those known (each was evaluated to sample the next),
            # then a tail chatctx cannot know: the mirror claims only what it knows.
            complete = len(generated) == result.usage.generated_tokens
            if complete and result.stop_reason != "eog":
                # The last token sampled was never evaluated: the cache ends before it.
                generated = generated[:-1]
            self._mirror[seq] = kept + generated
            if stream.slot is not None and stream.slot != seq:
                logger.warning("llama-server answered slot %d from slot %d", seq, stream.slot)

    def side_generate(
        self,
        prompt: Sequence[int],
        *,
        settings: GenerationSettings,
        background: bool = False,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> str:
        """A summary on the summary slot; ``deadline`` (``time.monotonic()``) stops it with
        ``DeadlineExceeded``, also while it waits behind another summary, and
        ``cancel_side(cancel)`` with ``GenerationError``. The text is returned only when the
        reply ran to its end (end of generation or its token limit)."""
        self._check_open()
        seq = self.summary_seq
        if seq is None:
            raise ConfigError("side generations need the summary slot (summary_slot=True)")
        settings = fit_side(len(prompt), self.side_room, settings, "summary slot")
        self._take_side(deadline, cancel)
        try:
            stream = self._stream(prompt, seq, settings)
            self._side_running = (cancel, stream)
            timer: threading.Timer | None = None
            try:
                if cancel is not None and cancel.is_set():
                    raise GenerationError("side generation cancelled")
                if deadline is not None:
                    timer = threading.Timer(max(0.0, deadline - time.monotonic()), stream.close)
                    timer.daemon = True
                    timer.start()
                for _ in stream:
                    pass
            finally:
                if timer is not None:
                    timer.cancel()
                self._side_running = None
                stream.close()
        finally:
            self._side.release()
        if cancel is not None and cancel.is_set():
            raise GenerationError("side generation cancelled")
        # Only a reply that ran to its end is a summary: one stopped (even before it began,
        # with no result at all) has no text a summarizer may take for "nothing to add".
        stop = None if stream.result is None else stream.result.stop_reason
        if stop in SIDE_DONE:
            return stream.text
        if self._closing:
            raise ClosedError("llama-server backend")
        if deadline is not None and stop in (None, "interrupted"):
            raise DeadlineExceeded("side generation not done before its deadline", what="summary")
        raise GenerationError(f"side generation stopped before its end ({stop or 'not started'})")

    def _take_side(self, deadline: float | None, cancel: threading.Event | None) -> None:
        """Wait for the summary slot (one summary at a time): ``DeadlineExceeded`` once
        ``deadline`` passes, ``GenerationError`` once ``cancel`` is set, ``ClosedError`` once
        the backend closes, whichever comes first."""
        while True:
            if cancel is not None and cancel.is_set():
                raise GenerationError("side generation cancelled")
            wait = SIDE_POLL_S
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(
                        "side generation not started before its deadline", what="summary"
                    )
                wait = min(wait, left)
            if self._side.acquire(timeout=wait):
                return
            self._check_open()

    def cancel_side(self, cancel: threading.Event) -> None:
        cancel.set()
        running = self._side_running
        if running is not None and running[0] is cancel:
            running[1].close()

    # lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """End running replies (stop reason ``closed``), wait for their sessions to store
        them and give their slots back (10 s at most), then close the HTTP client."""
        with self._lock:
            if self._closing:
                return
            # Set first: a generate() from now on is refused, so every stream is in the
            # snapshot below and gets closed.
            self._closing = True
            streams = list(self._streams)
        for stream in streams:
            stream.close(reason="closed")
        if not self.pool.wait_released(CLOSE_WAIT_S):
            logger.warning("closing the llama-server backend with slots still leased")
        self.pool.close()
        with self._lock:
            self._closed = True
        self._client.close()
        self._stream_client.close()

    def lease(self, conversation: str, *, timeout: float | None = None) -> Lease:
        lease = super().lease(conversation, timeout=timeout)
        return replace(lease, backend=self.name)
