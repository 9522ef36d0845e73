"""The cache monitor: per-turn KV records, aggregates and a Prometheus exposition."""

from chatctx.monitor._device import MemorySnapshot, gpu_memory, memory_snapshot, rss_bytes
from chatctx.monitor._prometheus import prometheus_text
from chatctx.monitor._stats import Totals, percentile, totals

__all__ = [
    "MemorySnapshot",
    "Totals",
    "gpu_memory",
    "memory_snapshot",
    "percentile",
    "prometheus_text",
    "rss_bytes",
    "totals",
]
