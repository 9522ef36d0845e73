"""The engine's side of the slot pool: swapping sequence states out and in, the slot table.

``SlotPool`` (``_slots``) decides who gets which slot; ``SwapCache`` (``_swap``) keeps the
states; this moves states between llama.cpp and the cache and keeps the counters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from chatctx._files import write_atomic
from chatctx.backends.engine._instance import EngineDirectory
from chatctx.backends.engine._scheduler import BatchCounters
from chatctx.backends.pool import SlotPool
from chatctx.backends.swap import SwapCache, SwapEntry, SwapHit
from chatctx.errors import ChatctxError
from chatctx.settings import default_home

if TYPE_CHECKING:
    from chatctx.backends.engine._engine import Engine

logger = logging.getLogger("chatctx.backends.engine")

TABLE_INTERVAL_S = 0.2  # the slot table is written at most this often


@dataclass
class SwapCounters:
    """Swaps so far, for the monitor."""

    swap_out: int = 0
    swap_out_bytes: int = 0
    swap_out_ms: float = 0.0
    swap_in_ram: int = 0
    swap_in_disk: int = 0
    swap_in_bytes: int = 0
    swap_in_ms: float = 0.0
    reprefill: int = 0


class KVSlots:
    """Slots, swapped states and their counters for one engine."""

    def __init__(self, engine: Engine) -> None:
        config = engine.config
        self._engine = engine
        # A directory of this engine's own (swap files, slot table), apart from any other
        # engine under the same home.
        self.directory = EngineDirectory(
            config.swap_dir or default_home() / "engines",
            legacy=None if config.swap_dir else default_home() / "kv",
        )
        self.path = config.slot_table or self.directory.slot_table
        self.counters = SwapCounters()
        self.swap = SwapCache(
            fingerprint=engine.fingerprint(),
            ram_bytes=int(config.swap_ram_mb * 2**20),
            disk_bytes=int(config.swap_disk_mb * 2**20),
            directory=self.directory.kv,
            adopt=self.directory.adopt,
        )
        self._table_lock = threading.Lock()
        self._table_timer: threading.Timer | None = None
        self._table_written = 0.0
        self.pool = SlotPool(
            engine.slots,
            swap_out=self._swap_out,
            swap_in=self._swap_in,
            on_change=self.table_changed,
        )

    def table_changed(self) -> None:
        """Write the slot table soon: at once when the last write is older than
        TABLE_INTERVAL_S, else once at the end of that interval (one write for a burst of
        leases and releases, never one per lease)."""
        with self._table_lock:
            if self._table_timer is not None:
                return
            wait = self._table_written + TABLE_INTERVAL_S - time.monotonic()
            if wait > 0:
                self._table_timer = threading.Timer(wait, self._write_due)
                self._table_timer.daemon = True
                self._table_timer.start()
                return
            self._table_written = time.monotonic()
        self._engine.write_slot_table()

    def _write_due(self) -> None:
        with self._table_lock:
            self._table_timer = None
            self._table_written = time.monotonic()
        if not self._engine.closed:
            self._engine.write_slot_table()

    def close(self) -> None:
        """After ``persist``: the last table, then this engine's directory is let go."""
        with self._table_lock:
            if self._table_timer is not None:
                self._table_timer.cancel()
                self._table_timer = None
        self.directory.close()

    def _swap_out(self, seq_id: int, owner: str) -> None:
        t0 = time.perf_counter()
        tokens, data, error = self._engine.export_sequence(seq_id, clear=True)
        if error is not None:
            logger.warning("state of %s not saved: %s", owner, error)
        if data is None:
            self.swap.discard(owner)
            return
        where = self.swap.put(SwapEntry(owner, tokens, data, self.swap.fingerprint))
        c = self.counters
        c.swap_out += 1
        c.swap_out_bytes += len(data)
        c.swap_out_ms += (time.perf_counter() - t0) * 1000
        logger.debug(
            "swapped out %s (%d tokens, %d bytes) to %s", owner, len(tokens), len(data), where
        )

    def _swap_in(self, seq_id: int, owner: str) -> tuple[SwapHit, float]:
        t0 = time.perf_counter()
        hit = self.swap.take(owner)
        if hit.entry is None:
            if hit.reason:
                self.counters.reprefill += 1
                logger.info("conversation %s re-prefills: %s", owner, hit.reason)
            return hit, 0.0
        entry = hit.entry
        reason = self._engine.import_sequence(seq_id, entry.tokens, entry.data)
        if reason is not None:
            self.counters.reprefill += 1
            return SwapHit(None, None, reason), 0.0
        ms = (time.perf_counter() - t0) * 1000
        c = self.counters
        if hit.where == "disk":
            c.swap_in_disk += 1
        else:
            c.swap_in_ram += 1
        c.swap_in_bytes += entry.size
        c.swap_in_ms += ms
        return hit, ms

    def persist(self) -> None:
        # At shutdown the slots' states go to disk: a customer who returns after a restart
        # gets a restore, not a re-prefill.
        engine = self._engine
        if self.swap.directory is None or engine.context.closed:
            return
        for slot in self.pool.slots:
            if slot.owner is None:
                continue
            tokens, data, error = engine.export_sequence(slot.seq_id)
            if error is not None:
                logger.warning("state of %s not kept: %s", slot.owner, error)
            if data is not None:
                self.swap.persist(SwapEntry(slot.owner, tokens, data, self.swap.fingerprint))
        self.swap.persist_ram()

    def table(self, batch: BatchCounters) -> dict[str, Any]:
        """The pool as the monitor shows it (``chatctx stats --slots``)."""
        engine = self._engine
        cells: dict[int, int] = {}
        if not engine.closed:
            with contextlib.suppress(ChatctxError):
                cells = engine.mirrored_cells()
        c = self.counters
        return {
            "version": 1,
            "pid": os.getpid(),
            "updated_at": datetime.now(UTC).isoformat(),
            "model": engine.config.model_path.name,
            "n_ctx": engine.n_ctx,
            "kv_unified": engine.config.kv_unified,
            "slots": [
                {
                    "slot": slot.seq_id,
                    "seq_id": slot.seq_id,
                    "conversation": slot.owner,
                    "cells": cells.get(slot.seq_id, 0),
                    "leased": slot.leased,
                    "last_use": slot.last_use_wall,
                }
                for slot in self.pool.slots
            ],
            "reserved": [
                {"seq_id": seq, "role": "summary", "cells": cells.get(seq, 0)}
                for seq in range(engine.slots, engine.config.n_seq_max)
            ],
            "swapped": self.swap.listing(),
            "counters": {
                **asdict(c),
                "spill_to_disk": self.swap.counters["spill_to_disk"],
                "disk_dropped": self.swap.counters["disk_dropped"],
                "ram_bytes": self.swap.ram_used,
                "disk_bytes": self.swap.disk_used,
                "batch_steps": batch.steps,
                "batch_tokens": batch.tokens,
                "batch_max": batch.max_sequences,
                "batch_sequences": batch.sequences,
            },
        }

    def write_table(self, batch: BatchCounters) -> None:
        """Write ``table()`` to the slot table file (atomically); failures are logged."""
        try:
            write_atomic(self.path, json.dumps(self.table(batch)).encode())
        except OSError as exc:
            logger.debug("slot table not written to %s: %s", self.path, exc)
