"""The slot table file: what the engine's slot pool holds, for other processes to read.

The engine writes a JSON snapshot (schema version 1) with ``write_slot_table`` whenever its
pool changes; ``chatctx stats --slots`` and the Prometheus exposition read it back with
``read_slot_table``. Writes go to a temporary file in the same directory and are renamed
over the old one (``os.replace``), so a reader sees the previous table or the new one,
never half of one. Both sides run the same validation: a table the engine could write is
one the reader accepts, and a malformed one fails where it is made.

Every failure (no file, unreadable, not JSON, wrong shape, unknown version) is a
``StoreError`` naming the file: the table is state kept on disk, like the store.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chatctx._files import write_atomic
from chatctx._process import running
from chatctx.errors import StoreError
from chatctx.settings import default_home

SLOT_TABLE_VERSION = 1
# Counters the engine keeps (since it started). A table without one reads it as 0, so a
# counter added later does not make older tables unreadable; unknown ones are kept.
COUNTERS: tuple[str, ...] = (
    "swap_out",
    "swap_out_bytes",
    "swap_out_ms",
    "swap_in_ram",
    "swap_in_disk",
    "swap_in_bytes",
    "swap_in_ms",
    "reprefill",
    "spill_to_disk",
    "disk_dropped",
    "ram_bytes",
    "disk_bytes",
    "batch_steps",
    "batch_tokens",
    "batch_max",
    "batch_sequences",
)
_FLOAT_COUNTERS = frozenset({"swap_out_ms", "swap_in_ms"})
SWAP_PLACES = ("ram", "disk")
# A pool of thousands of conversations is a few MiB; anything far larger is not a table.
MAX_TABLE_BYTES = 64 * 1024 * 1024


def default_slots_path() -> Path:
    """The slot table of the older, one-engine layout: ``<CHATCTX_HOME>/slots.json``.

    Each engine now writes its own (``<CHATCTX_HOME>/engines/<engine>/slots.json``):
    ``live_slot_tables`` finds the running ones.
    """
    return default_home() / "slots.json"


def engines_dir() -> Path:
    """Where each engine keeps its directory: ``<CHATCTX_HOME>/engines``."""
    return default_home() / "engines"


def live_slot_tables(root: Path | None = None) -> list[tuple[Path, SlotTable]]:
    """The slot tables of every engine still running under ``root`` (default
    ``engines_dir()``), oldest directory name first; an engine that has not written one yet
    is left out. A live engine's unreadable table is a ``StoreError``."""
    from chatctx.backends.engine import live_directories  # no llama.cpp: files and locks

    out = []
    for directory in live_directories(root or engines_dir()):
        path = directory / "slots.json"
        if path.is_file():
            out.append((path, read_slot_table(path)))
    return out


@dataclass(frozen=True, slots=True)
class SlotRow:
    """One pool slot: the KV sequence it owns and the conversation it holds, if any."""

    slot: int
    seq_id: int
    conversation: str | None
    cells: int
    leased: bool
    last_use: datetime | None


@dataclass(frozen=True, slots=True)
class ReservedRow:
    """A sequence kept out of the pool for another use (e.g. ``role="summary"``)."""

    seq_id: int
    role: str
    cells: int


@dataclass(frozen=True, slots=True)
class SwappedRow:
    """A conversation whose KV state was saved out of the cache, to RAM or to disk."""

    conversation: str
    where: str  # "ram" | "disk"
    bytes: int
    tokens: int
    saved_at: datetime


@dataclass(frozen=True, slots=True)
class SlotTable:
    """One snapshot of the engine's slot pool, as written to the slot table file."""

    pid: int
    updated_at: datetime
    model: str | None
    n_ctx: int
    kv_unified: bool
    slots: tuple[SlotRow, ...]
    reserved: tuple[ReservedRow, ...] = ()
    swapped: tuple[SwappedRow, ...] = ()
    counters: dict[str, int | float] = field(default_factory=dict)
    version: int = SLOT_TABLE_VERSION

    @property
    def leased(self) -> int:
        """Slots leased to a conversation now."""
        return sum(row.leased for row in self.slots)

    @property
    def swap_ins(self) -> int:
        """KV states restored from a swap, from RAM and from disk."""
        return int(self.counters["swap_in_ram"] + self.counters["swap_in_disk"])

    @property
    def mean_swap_in_ms(self) -> float | None:
        return _ratio(self.counters["swap_in_ms"], self.swap_ins)

    @property
    def mean_swap_out_ms(self) -> float | None:
        return _ratio(self.counters["swap_out_ms"], self.counters["swap_out"])

    @property
    def mean_batch_sequences(self) -> float | None:
        """Sequences decoded together per llama_decode step, on average."""
        return _ratio(self.counters["batch_sequences"], self.counters["batch_steps"])

    @property
    def mean_batch_tokens(self) -> float | None:
        """Tokens per llama_decode step, on average."""
        return _ratio(self.counters["batch_tokens"], self.counters["batch_steps"])

    def writer_running(self) -> bool | None:
        """Whether the writing process still runs on this machine (None: cannot tell).

        A table whose writer is gone is stale: it shows the pool as the engine left it.
        """
        return running(self.pid)

    def as_dict(self) -> dict[str, Any]:
        """The table in the file's JSON schema (what ``write_slot_table`` takes)."""
        return {
            "version": self.version,
            "pid": self.pid,
            "updated_at": self.updated_at.isoformat(),
            "model": self.model,
            "n_ctx": self.n_ctx,
            "kv_unified": self.kv_unified,
            "slots": [
                {
                    "slot": r.slot,
                    "seq_id": r.seq_id,
                    "conversation": r.conversation,
                    "cells": r.cells,
                    "leased": r.leased,
                    "last_use": None if r.last_use is None else r.last_use.isoformat(),
                }
                for r in self.slots
            ],
            "reserved": [
                {"seq_id": r.seq_id, "role": r.role, "cells": r.cells} for r in self.reserved
            ],
            "swapped": [
                {
                    "conversation": r.conversation,
                    "where": r.where,
                    "bytes": r.bytes,
                    "tokens": r.tokens,
                    "saved_at": r.saved_at.isoformat(),
                }
                for r in self.swapped
            ],
            "counters": dict(self.counters),
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "slot table") -> SlotTable:
        """Validate a decoded table; ``StoreError`` (naming ``source``) when it is malformed."""
        return _Parser(source).table(data)


def _ratio(total: float, count: float) -> float | None:
    return total / count if count else None


class _Parser:
    """Checks each field of a decoded table; errors say where: ``slots[1].cells``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> StoreError:
        return StoreError(f"{self.source}: {where}: {message}")

    def obj(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected an object, got {_kind(value)}")
        return value

    def key(self, obj: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(where, f"missing {key!r}")
        return obj[key]

    def count(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(where, f"expected a non-negative integer, got {value!r}")
        return value

    def number(self, value: Any, where: str) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0:
            raise self.fail(where, f"expected a non-negative number, got {value!r}")
        return float(value)

    def text(self, value: Any, where: str, *, optional: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            wanted = "a string or null" if optional else "a non-empty string"
            raise self.fail(where, f"expected {wanted}, got {value!r}")
        return value

    def flag(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {value!r}")
        return value

    def time(self, value: Any, where: str, *, optional: bool = False) -> datetime | None:
        if value is None and optional:
            return None
        try:
            parsed = datetime.fromisoformat(value) if isinstance(value, str) else None
        except ValueError:
            parsed = None
        if parsed is None or parsed.tzinfo is None:
            raise self.fail(where, f"expected an ISO-8601 time with a UTC offset, got {value!r}")
        return parsed.astimezone(UTC)

    def rows(self, data: Mapping[str, Any], key: str) -> list[tuple[str, Mapping[str, Any]]]:
        value = data.get(key, [])
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {_kind(value)}")
        return [(f"{key}[{i}]", self.obj(item, f"{key}[{i}]")) for i, item in enumerate(value)]

    def table(self, data: Any) -> SlotTable:
        data = self.obj(data, "top level")
        version = data.get("version")
        if version != SLOT_TABLE_VERSION:
            raise self.fail(
                "version",
                f"slot table version {version!r} is not one this chatctx reads "
                f"({SLOT_TABLE_VERSION})",
            )
        slots = tuple(self.slot(row, where) for where, row in self.rows(data, "slots"))
        reserved = tuple(self.reserved(row, where) for where, row in self.rows(data, "reserved"))
        swapped = tuple(self.swapped(row, where) for where, row in self.rows(data, "swapped"))
        self.unique([r.slot for r in slots], "slots", "slot")
        seq_ids = [r.seq_id for r in slots] + [r.seq_id for r in reserved]
        self.unique(seq_ids, "slots and reserved", "seq_id")
        self.unique([r.conversation for r in swapped], "swapped", "conversation")
        pid = self.count(self.key(data, "pid", "top level"), "pid")
        time = self.time(self.key(data, "updated_at", "top level"), "updated_at")
        assert time is not None  # not optional
        return SlotTable(
            version=version,
            pid=pid,
            updated_at=time,
            model=self.text(data.get("model"), "model", optional=True),
            n_ctx=self.count(self.key(data, "n_ctx", "top level"), "n_ctx"),
            kv_unified=self.flag(data.get("kv_unified", False), "kv_unified"),
            slots=slots,
            reserved=reserved,
            swapped=swapped,
            counters=self.counters(data.get("counters", {})),
        )

    def unique(self, values: list[Any], where: str, what: str) -> None:
        seen: set[Any] = set()
        for value in values:
            if value in seen:
                raise self.fail(where, f"{what} {value!r} appears twice")
            seen.add(value)

    def slot(self, row: Mapping[str, Any], where: str) -> SlotRow:
        return SlotRow(
            slot=self.count(self.key(row, "slot", where), f"{where}.slot"),
            seq_id=self.count(self.key(row, "seq_id", where), f"{where}.seq_id"),
            conversation=self.text(row.get("conversation"), f"{where}.conversation", optional=True),
            cells=self.count(self.key(row, "cells", where), f"{where}.cells"),
            leased=self.flag(self.key(row, "leased", where), f"{where}.leased"),
            last_use=self.time(row.get("last_use"), f"{where}.last_use", optional=True),
        )

    def reserved(self, row: Mapping[str, Any], where: str) -> ReservedRow:
        role = self.text(self.key(row, "role", where), f"{where}.role")
        assert role is not None
        return ReservedRow(
            seq_id=self.count(self.key(row, "seq_id", where), f"{where}.seq_id"),
            role=role,
            cells=self.count(self.key(row, "cells", where), f"{where}.cells"),
        )

    def swapped(self, row: Mapping[str, Any], where: str) -> SwappedRow:
        conversation = self.text(self.key(row, "conversation", where), f"{where}.conversation")
        place = self.key(row, "where", where)
        if place not in SWAP_PLACES:
            raise self.fail(f"{where}.where", f"expected 'ram' or 'disk', got {place!r}")
        saved_at = self.time(self.key(row, "saved_at", where), f"{where}.saved_at")
        assert conversation is not None and saved_at is not None
        return SwappedRow(
            conversation=conversation,
            where=place,
            bytes=self.count(self.key(row, "bytes", where), f"{where}.bytes"),
            tokens=self.count(self.key(row, "tokens", where), f"{where}.tokens"),
            saved_at=saved_at,
        )

    def counters(self, value: Any) -> dict[str, int | float]:
        given = self.obj(value, "counters")
        out: dict[str, int | float] = dict.fromkeys(COUNTERS, 0)
        for name, item in given.items():
            where = f"counters.{name}"
            if name in _FLOAT_COUNTERS:
                out[name] = self.number(item, where)
            elif name in COUNTERS:
                out[name] = self.count(item, where)
            else:  # a counter this version does not know: kept as written
                self.number(item, where)
                out[name] = item
        for name in _FLOAT_COUNTERS:
            out[name] = float(out[name])
        return out


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def read_slot_table(path: str | os.PathLike[str] | None = None) -> SlotTable:
    """Read and validate the slot table at ``path`` (default: ``default_slots_path()``).

    Raises ``StoreError`` when no engine has written one there, or when the file cannot be
    read, is not JSON, does not match the schema, or has a version this chatctx cannot read.
    """
    path = Path(path) if path is not None else default_slots_path()
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_TABLE_BYTES + 1)
    except FileNotFoundError:
        raise StoreError(f"no engine has written a slot table at {path}") from None
    except OSError as exc:
        raise StoreError(f"cannot read slot table {path}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_TABLE_BYTES:
        raise StoreError(f"{path}: larger than {MAX_TABLE_BYTES} bytes, not a slot table")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StoreError(f"{path}: not a JSON slot table ({exc})") from exc
    return SlotTable.from_dict(data, source=str(path))


def write_slot_table(
    path: str | os.PathLike[str] | None, table: Mapping[str, Any] | SlotTable
) -> SlotTable:
    """Validate ``table`` and replace the file at ``path`` with it, atomically.

    ``table`` is a dict in the version-1 schema (datetimes may be given as aware
    ``datetime`` objects) or a ``SlotTable``; ``path`` None means ``default_slots_path()``.
    Returns the table as a reader will see it. Raises ``StoreError`` for a malformed table
    (nothing is written) or a failed write (the old file stays as it was).
    """
    path = Path(path) if path is not None else default_slots_path()
    data = table.as_dict() if isinstance(table, SlotTable) else table
    try:
        text = json.dumps(data, default=_json_default, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{path}: cannot encode the slot table: {exc}") from exc
    checked = SlotTable.from_dict(json.loads(text), source=str(path))
    try:
        write_atomic(path, text.encode("utf-8"))
    except OSError as exc:
        raise StoreError(f"cannot write slot table {path}: {exc.strerror or exc}") from exc
    return checked
