"""The cache monitor: per-turn KV records, aggregates, the slot table and a Prometheus text."""

from chatctx.backends.device import MemorySnapshot, gpu_memory, memory_snapshot, rss_bytes
from chatctx.monitor._prometheus import prometheus_text
from chatctx.monitor._slots import (
    SLOT_TABLE_VERSION,
    ReservedRow,
    SlotRow,
    SlotTable,
    SwappedRow,
    default_slots_path,
    engines_dir,
    live_slot_tables,
    read_slot_table,
    write_slot_table,
)
from chatctx.monitor._stats import (
    BackendTotals,
    SwapTotals,
    Totals,
    backend_totals,
    percentile,
    swap_totals,
    totals,
)

__all__ = [
    "SLOT_TABLE_VERSION",
    "BackendTotals",
    "MemorySnapshot",
    "ReservedRow",
    "SlotRow",
    "SlotTable",
    "SwapTotals",
    "SwappedRow",
    "Totals",
    "backend_totals",
    "default_slots_path",
    "engines_dir",
    "gpu_memory",
    "live_slot_tables",
    "memory_snapshot",
    "percentile",
    "prometheus_text",
    "read_slot_table",
    "rss_bytes",
    "swap_totals",
    "totals",
    "write_slot_table",
]
