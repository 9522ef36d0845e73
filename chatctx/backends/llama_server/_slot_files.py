"""A llama-server's slot files: swapping a slot out to a file and back in (``swap``),
saving and restoring a conversation's state, and forgetting a conversation; without
``swap``, bringing a conversation's prompt back from the server's host-RAM prompt cache
when its prompt was edited (``_bring_back``).

The server writes and reads the files in its ``--slot-save-path``; chatctx names them and,
where that folder is seen from this machine, bounds and deletes them. Mixed into
``LlamaServerBackend`` (``_backend.py``), which owns what is declared here.
"""

from __future__ import annotations

import array
import collections
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatctx.backends.base import Lease
from chatctx.backends.pool import SlotPool
from chatctx.backends.swap import SwapEntry, SwapHit
from chatctx.errors import BackendUnavailable, ChatctxError, GenerationError
from chatctx.model.kv import common_prefix, plan_in_order

logger = logging.getLogger("chatctx.backends.llama_server")

CLOSE_WAIT_S = 10.0  # forget/export/import wait this long for a turn to give the slot back
_NO_SWAP = SwapHit(None, None, None)
LOST = "slot taken by another conversation (llama-server keeps no swap)"
NOT_SAVED = "slot taken by another conversation and not saved (the save failed)"
DROPPED = "swap file deleted: the swap files took over swap_disk_mb"
LEFT_MAX = 256  # conversations whose last prompt is remembered after losing their slot


class SlotFiles:
    """``LlamaServerBackend``'s slot files (mixed in)."""

    name: str
    swap: bool
    slot_save_path: Path | None
    swap_disk_bytes: int
    pool: SlotPool
    _lock: threading.Lock
    _mirror: dict[int, list[int]]
    _saved: dict[str, tuple[str, tuple[int, ...]]]
    _files: collections.OrderedDict[str, int]
    _warned_disk: bool
    _lost: dict[str, str]
    _left: collections.OrderedDict[str, array.array[int]]
    _ram_cache: bool
    cache_reuse: int

    if TYPE_CHECKING:  # defined by the class this is mixed into

        def _post(self, path: str, body: Mapping[str, Any], what: str) -> Any: ...

        def _check_open(self) -> None: ...

        def _erase(self, seq: int) -> None: ...

        def slot_of(self, conversation: str) -> int | None: ...

        def lease(self, conversation: str, *, timeout: float | None = None) -> Lease: ...

        def release(self, lease: Lease) -> None: ...

    def _swap_out(self, seq_id: int, owner: str) -> None:
        # The next conversation's prompt overwrites the slot: saved first with ``swap``, else
        # lost (the server's host-RAM prompt cache may still keep it).
        with self._lock:
            tokens = tuple(self._mirror[seq_id])
            self._mirror[seq_id] = []
        if self.swap:
            filename = swap_filename(owner)
            try:
                body = self._post(
                    f"/slots/{seq_id}?action=save", {"filename": filename}, f"saving slot {seq_id}"
                )
            except ChatctxError as exc:  # the next owner's turn goes on; this one prefills
                logger.warning("%s: slot %d of %r not saved: %s", self.name, seq_id, owner, exc)
            else:
                if int(body.get("n_saved") or 0) > 0:
                    with self._lock:
                        self._saved[owner] = (filename, tokens)
                        self._lost.pop(owner, None)
                        self._files[owner] = int(body.get("n_written") or 0)
                        self._files.move_to_end(owner)
                    # The slot's new owner (set before the swap) is restored next: its file stays.
                    self._bound_swap_files(owner, keep=self.pool.owner_of(seq_id))
                    return
        with self._lock:
            self._saved.pop(owner, None)
            self._lost[owner] = NOT_SAVED if self.swap else LOST
            if tokens:
                self._left[owner] = array.array("i", tokens)
                self._left.move_to_end(owner)
                while len(self._left) > LEFT_MAX:
                    self._left.popitem(last=False)

    def _bring_back(self, seq_id: int, prompt: Sequence[int]) -> tuple[list[int], int] | None:
        """Before ``prompt`` is sent to slot ``seq_id``, which holds nothing of its
        conversation: where that conversation's last prompt is remembered and ``prompt`` is
        an edit of it (turns evicted from its middle), ask the server for that last prompt
        first (no token generated), so its host-RAM prompt cache gives it back and the
        cache-reuse walk keeps the runs after the edit. The server's cache only looks up a
        prompt by its beginning: without this an edited prompt is evaluated whole. An
        extension of the last prompt needs nothing (the server finds it itself).

        Returns what the slot now holds and the tokens the server evaluated for it (1 when its
        cache had the prompt); None when nothing was asked. A server without that cache
        (``--cache-ram 0``) evaluates the whole prompt once, and is not asked again.
        """
        owner = self.pool.owner_of(seq_id)
        with self._lock:
            left = self._left.pop(owner, None) if owner is not None else None
            if left is None or not self._ram_cache:
                return None
        last = left.tolist()
        plan = plan_in_order(last, prompt, min_chunk=self.cache_reuse)
        if plan.prefix + plan.chunk_len - common_prefix(last, prompt) <= self.cache_reuse:
            return None  # an extension, or an edit that keeps little more than its beginning
        body = {
            "prompt": last,
            "id_slot": seq_id,
            "cache_prompt": True,
            "n_predict": 0,
            "n_cache_reuse": self.cache_reuse,
        }
        try:
            reply = self._post("/completion", body, f"bringing slot {seq_id}'s prompt back")
        except ChatctxError as exc:  # the turn goes on and evaluates what it must
            logger.warning("%s: %r's last prompt not brought back: %s", self.name, owner, exc)
            return None
        timings = reply.get("timings") or {}
        if int(timings.get("cache_n") or 0) < len(last) - 1:
            self._ram_cache = False
            logger.info(
                "%s: its prompt cache did not give a prompt back (--cache-ram 0?): an edited "
                "prompt of a conversation that lost its slot is evaluated whole from now on",
                self.name,
            )
        with self._lock:
            self._mirror[seq_id] = last
        return last, int(timings.get("prompt_n") or 0)

    def _bound_swap_files(self, just_saved: str, keep: str | None) -> None:
        """Delete the swap files saved longest ago while they take over ``swap_disk_mb``
        (never ``just_saved``'s, nor ``keep``'s: about to be restored); their conversations
        prefill when they come back. Only where the server's folder is seen from here: the
        file it has just written is there."""
        assert self.slot_save_path is not None
        if not (self.slot_save_path / swap_filename(just_saved)).is_file():
            with self._lock:
                over = sum(self._files.values()) > self.swap_disk_bytes
                warn, self._warned_disk = over and not self._warned_disk, self._warned_disk or over
            if warn:
                logger.warning(
                    "%s: swap files take over swap_disk_mb in %s, a folder not seen from this "
                    "machine: delete old chatctx-swap-*.bin files there",
                    self.name,
                    self.slot_save_path,
                )
            return
        while True:
            with self._lock:
                spare = [c for c in self._files if c not in (just_saved, keep)]
                if sum(self._files.values()) <= self.swap_disk_bytes or not spare:
                    return
                oldest = spare[0]
                del self._files[oldest]
                if oldest in self._saved:
                    del self._saved[oldest]
                    self._lost[oldest] = DROPPED
            with contextlib.suppress(OSError):
                (self.slot_save_path / swap_filename(oldest)).unlink(missing_ok=True)

    def _swap_in(self, seq_id: int, owner: str) -> tuple[SwapHit, float]:
        with self._lock:
            saved = self._saved.pop(owner, None)
            lost = self._lost.pop(owner, None)
        if saved is None:
            return (SwapHit(None, None, lost), 0.0) if lost else (_NO_SWAP, 0.0)
        filename, tokens = saved
        started = time.perf_counter()
        try:
            body = self._post(
                f"/slots/{seq_id}?action=restore",
                {"filename": filename},
                f"restoring slot {seq_id}",
            )
        except ChatctxError as exc:  # the file went, no longer fits, or the server failed:
            # a swap never fails a turn; its request finds out whether the server is down
            return SwapHit(None, None, f"slot file not restored: {exc}"), 0.0
        restored = int(body.get("n_restored") or 0)
        if restored <= 0:
            return SwapHit(None, None, "slot file not restored: the server read no tokens"), 0.0
        with self._lock:
            self._mirror[seq_id] = list(tokens)
        timings = body.get("timings") or {}
        ms = float(timings.get("restore_ms") or (time.perf_counter() - started) * 1000)
        entry = SwapEntry(owner, tokens, b"", {})
        return SwapHit(entry, "disk", None, size=int(body.get("n_read") or 0)), ms

    def forget(self, conversation: str) -> None:
        """Drop ``conversation``'s slot (erased on the server where it allows it) and its swap
        file (deleted where the server's directory is seen from here)."""
        self._check_open()
        seq = self.slot_of(conversation)
        with self._lock:
            self._lost.pop(conversation, None)
            self._left.pop(conversation, None)
            self._saved.pop(conversation, None)
            self._files.pop(conversation, None)
        if self.swap and self.slot_save_path is not None:
            # The server has no call to delete a file: where its directory is seen here too
            # (a server on this machine), the swap file goes; elsewhere it stays.
            with contextlib.suppress(OSError):
                (self.slot_save_path / swap_filename(conversation)).unlink(missing_ok=True)
        if seq is None:
            return
        lease = self.pool.lease(conversation, timeout=CLOSE_WAIT_S)  # not while a turn runs
        # The slot may have gone to another conversation before the lease: the lease's slot
        # is the one that is ``conversation``'s now (``seq`` may hold someone else's cache).
        try:
            self._erase(lease.seq_id)
            with self._lock:
                self._mirror[lease.seq_id] = []
        finally:
            self.pool.release(lease)
            self.pool.forget(lease.seq_id)

    def export_state(self, conversation: str) -> str | None:
        """Save ``conversation``'s slot on the server (``--slot-save-path``) and return the
        file name there; None without a save path or when the conversation holds no slot."""
        self._check_open()
        if self.slot_save_path is None:
            return None
        if self.slot_of(conversation) is None:
            with self._lock:  # swapped out: its file is its state
                saved = self._saved.get(conversation)
            return None if saved is None else saved[0]
        lease = self.pool.lease(conversation, timeout=CLOSE_WAIT_S)
        try:
            if lease.reprefill_reason is not None:  # lost meanwhile: nothing to save
                return None
            filename = state_filename(conversation)
            body = self._post(
                f"/slots/{lease.seq_id}?action=save",
                {"filename": filename},
                f"saving slot {lease.seq_id}",
            )
            return filename if int(body.get("n_saved") or 0) > 0 else None
        finally:
            self.pool.release(lease)

    def import_state(self, conversation: str, filename: str) -> bool:
        """Lease a slot for ``conversation`` and restore a saved state into it (a file in the
        server's ``--slot-save-path``); True when tokens were restored, False when the
        server has no such file (or it does not fit)."""
        self._check_open()
        if self.slot_save_path is None:
            return False
        lease = self.lease(conversation, timeout=CLOSE_WAIT_S)
        try:
            try:
                body = self._post(
                    f"/slots/{lease.seq_id}?action=restore",
                    {"filename": filename},
                    f"restoring slot {lease.seq_id}",
                )
            except BackendUnavailable:
                raise
            except GenerationError as exc:  # no such file, or one that does not fit
                logger.info("%s: %s", self.name, exc)
                return False
            restored = int(body.get("n_restored") or 0)
            with self._lock:
                self._mirror[lease.seq_id] = []  # tokens unknown here: the server knows them
            return restored > 0
        finally:
            self.release(lease)


def state_filename(conversation: str, kind: str = "") -> str:
    """The file a conversation's slot is saved to (a plain name, as the server requires)."""
    return f"chatctx-{kind}{hashlib.sha256(conversation.encode()).hexdigest()[:24]}.bin"


def swap_filename(conversation: str) -> str:
    """The file a conversation's slot is swapped out to (``swap``)."""
    return state_filename(conversation, "swap-")
