"""The cache monitor: per-turn KV records, aggregates and a Prometheus exposition."""

from chatctx.monitor._prometheus import prometheus_text
from chatctx.monitor._stats import Totals, percentile, totals

__all__ = ["Totals", "percentile", "prometheus_text", "totals"]
