"""Swapped-out KV states: a RAM cache with a byte budget that spills to files (LRU at both).

A conversation that loses its slot keeps its sequence state (``llama_state_seq_get_data``)
here with the tokens it holds; when it comes back the state is loaded into a free slot
instead of evaluating its prompt again. Every state carries the fingerprint of the engine
that saved it (model, KV layout and types, n_ctx); a state from another engine is dropped
and the reason returned, so the turn re-prefills and the monitor says why.

Files live in the engine's own directory (``_instance``) and survive a restart: a later
engine adopts a state of a gone one when its conversation comes back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chatctx._files import write_atomic

logger = logging.getLogger("chatctx.backends.engine")

MAGIC = b"CHATCTX-KV-1\n"


@dataclass(frozen=True, slots=True)
class SwapEntry:
    """A saved sequence state: what the cells hold and the bytes that rebuild them."""

    owner: str
    tokens: tuple[int, ...]
    data: bytes
    fingerprint: dict[str, Any]
    saved_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class SwapHit:
    """The result of looking a conversation up: the entry and where it was, or why not."""

    entry: SwapEntry | None
    where: str | None  # "ram" | "disk"
    reason: str | None  # why a saved state could not be used
    size: int | None = None  # bytes read, where no entry holds them (a server's slot file)


def fingerprint_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """A readable reason when two engine fingerprints differ, else None."""
    diffs = [
        f"{key} {saved.get(key)!r} != {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    return "fingerprint mismatch: " + ", ".join(diffs) if diffs else None


class SwapCache:
    """States by conversation: RAM first (``ram_bytes``), then files (``disk_bytes``)."""

    def __init__(
        self,
        *,
        fingerprint: dict[str, Any],
        ram_bytes: int,
        disk_bytes: int,
        directory: Path | None,
        adopt: Callable[[str], Path | None] | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        # adopt(filename): a state file of an engine that is gone, moved into ``directory``
        self._adopt = adopt
        self.ram_bytes = ram_bytes
        self.disk_bytes = disk_bytes
        self.directory = directory if disk_bytes > 0 else None
        self._ram: OrderedDict[str, SwapEntry] = OrderedDict()
        self._ram_used = 0  # bytes of the states in _ram
        # What the files hold (owner -> row for the slot table), read once, then kept up to
        # date: the table is written at every lease and must not rescan the directory.
        self._disk: dict[str, dict[str, Any]] = self._scan()
        self._lock = threading.Lock()
        self.counters = {"spill_to_disk": 0, "disk_dropped": 0, "ram_dropped": 0}

    # sizes ---------------------------------------------------------------------------------

    @property
    def ram_used(self) -> int:
        return self._ram_used

    def _files(self) -> list[Path]:
        if self.directory is None or not self.directory.is_dir():
            return []
        return [p for p in self.directory.glob("*.kv") if p.is_file()]

    def _scan(self) -> dict[str, dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}
        for path in self._files():
            try:
                with path.open("rb") as f:
                    head = f.read(len(MAGIC) + 8)
                    if not head.startswith(MAGIC):
                        continue
                    (length,) = struct.unpack_from("<Q", head, len(MAGIC))
                    header = json.loads(f.read(length))
                rows[str(header["owner"])] = _row(header, path.stat().st_size, path.stat().st_mtime)
            except (OSError, ValueError, KeyError, struct.error):
                continue
        return rows

    @property
    def disk_used(self) -> int:
        return sum(row["file_bytes"] for row in self._disk.values())

    def _path(self, owner: str) -> Path:
        assert self.directory is not None
        return self.directory / (hashlib.sha256(owner.encode()).hexdigest()[:40] + ".kv")

    # saving --------------------------------------------------------------------------------

    def put(self, entry: SwapEntry) -> str:
        """Keep ``entry`` (replacing the owner's previous one); returns where it went."""
        with self._lock:
            self._drop(entry.owner)
            if entry.size <= self.ram_bytes:
                self._ram[entry.owner] = entry
                self._ram_used += entry.size
                while self._ram_used > self.ram_bytes:
                    self._spill(self._ram_pop(next(iter(self._ram))))
                if entry.owner in self._ram:
                    return "ram"
                return "disk" if self._on_disk(entry.owner) else "dropped"
            return "disk" if self._spill(entry) else "dropped"

    def persist(self, entry: SwapEntry) -> bool:
        """Write ``entry`` straight to disk (at shutdown, so it survives a restart)."""
        with self._lock:
            self._drop(entry.owner)
            return self._spill(entry, count=False)

    def persist_ram(self) -> None:
        """Move every state held in RAM to disk (at shutdown)."""
        with self._lock:
            while self._ram:
                self._spill(self._ram_pop(next(iter(self._ram))), count=False)

    def _on_disk(self, owner: str) -> bool:
        return self.directory is not None and self._path(owner).exists()

    def _spill(self, entry: SwapEntry, *, count: bool = True) -> bool:
        if self.directory is None or entry.size > self.disk_bytes:
            self.counters["ram_dropped"] += 1
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        header = json.dumps(
            {
                "owner": entry.owner,
                "fingerprint": entry.fingerprint,
                "tokens": list(entry.tokens),
                "saved_at": entry.saved_at,
                "size": entry.size,
            }
        ).encode()
        path = self._path(entry.owner)
        try:
            write_atomic(path, MAGIC + struct.pack("<Q", len(header)) + header + entry.data)
            stat = path.stat()
        except OSError as exc:
            logger.warning("could not write swapped KV state of %s: %s", entry.owner, exc)
            return False
        self._disk[entry.owner] = _row(
            {
                "owner": entry.owner,
                "size": entry.size,
                "tokens": entry.tokens,
                "saved_at": entry.saved_at,
            },
            stat.st_size,
            stat.st_mtime,
        )
        if count:
            self.counters["spill_to_disk"] += 1
        self._trim_disk(keep=entry.owner)
        return entry.owner in self._disk

    def _trim_disk(self, *, keep: str) -> None:
        total = self.disk_used
        for owner, row in sorted(self._disk.items(), key=lambda item: item[1]["mtime"]):
            if total <= self.disk_bytes:
                break
            if owner == keep:
                continue
            with contextlib.suppress(OSError):
                self._path(owner).unlink()
            del self._disk[owner]
            total -= row["file_bytes"]
            self.counters["disk_dropped"] += 1

    # loading -------------------------------------------------------------------------------

    def take(self, owner: str) -> SwapHit:
        """Remove and return ``owner``'s state (RAM, then disk); a stale one is dropped."""
        with self._lock:
            if owner in self._ram:
                return SwapHit(self._ram_pop(owner), "ram", None)
            if self.directory is None:
                return SwapHit(None, None, None)
            path = self._path(owner)
            self._disk.pop(owner, None)
            if not path.exists() and (self._adopt is None or self._adopt(path.name) is None):
                return SwapHit(None, None, None)
            reason: str | None = None
            try:
                entry = self._read(path)
            except (OSError, ValueError) as exc:
                reason = f"unreadable swap file {path.name}: {exc}"
                entry = None
            with contextlib.suppress(OSError):
                path.unlink()
            if entry is None:
                return SwapHit(None, None, reason)
            if entry.owner != owner:
                return SwapHit(None, None, "swap file belongs to another conversation")
            mismatch = fingerprint_mismatch(entry.fingerprint, self.fingerprint)
            if mismatch:
                return SwapHit(None, None, mismatch)
            return SwapHit(entry, "disk", None)

    def _ram_pop(self, owner: str) -> SwapEntry:
        entry = self._ram.pop(owner)
        self._ram_used -= entry.size
        return entry

    def _drop(self, owner: str) -> None:
        if owner in self._ram:
            self._ram_pop(owner)
        self._disk.pop(owner, None)
        if self.directory is not None:
            with contextlib.suppress(OSError):
                self._path(owner).unlink()

    def discard(self, owner: str) -> None:
        """Forget ``owner``'s saved state (its conversation changed under it)."""
        with self._lock:
            self._drop(owner)

    @staticmethod
    def _read(path: Path) -> SwapEntry:
        raw = path.read_bytes()
        if not raw.startswith(MAGIC):
            raise ValueError("not a chatctx KV state")
        at = len(MAGIC)
        (length,) = struct.unpack_from("<Q", raw, at)
        at += 8
        header = json.loads(raw[at : at + length])
        data = raw[at + length :]
        if len(data) != header["size"]:
            raise ValueError(f"{len(data)} state bytes, header says {header['size']}")
        return SwapEntry(
            owner=str(header["owner"]),
            tokens=tuple(int(t) for t in header["tokens"]),
            data=data,
            fingerprint=dict(header["fingerprint"]),
            saved_at=str(header["saved_at"]),
        )

    def listing(self) -> list[dict[str, Any]]:
        """Swapped conversations for the slot table (RAM first, most recent last)."""
        with self._lock:
            rows = [
                {
                    "conversation": e.owner,
                    "where": "ram",
                    "bytes": e.size,
                    "tokens": len(e.tokens),
                    "saved_at": e.saved_at,
                }
                for e in self._ram.values()
            ]
            rows.extend(
                {key: row[key] for key in ("conversation", "where", "bytes", "tokens", "saved_at")}
                for row in self._disk.values()
            )
            return rows


def _row(header: dict[str, Any], file_bytes: int, mtime: float) -> dict[str, Any]:
    return {
        "conversation": str(header["owner"]),
        "where": "disk",
        "bytes": int(header.get("size", 0)),
        "tokens": len(header.get("tokens", ())),
        "saved_at": header.get("saved_at"),
        "file_bytes": file_bytes,
        "mtime": mtime,
    }
