"""The server's own Prometheus series: HTTP requests, latency, turns and TTFT.

Kept in memory (this process since it started); ``text()`` writes them in the exposition
format, appended by ``/metrics`` to the monitor's KV-cache gauges.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


class _Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, metric: str, labels: Sequence[tuple[str, str]]) -> list[str]:
        out = []
        for bound, n in zip(self.buckets, self.counts, strict=True):
            out.append(f"{metric}_bucket{_labels([*labels, ('le', f'{bound:g}')])} {n}")
        out.append(f"{metric}_bucket{_labels([*labels, ('le', '+Inf')])} {self.count}")
        out.append(f"{metric}_sum{_labels(labels)} {self.sum:.6g}")
        out.append(f"{metric}_count{_labels(labels)} {self.count}")
        return out


_TOKEN_COUNTERS = (
    ("prompt", "Prompt tokens of the turns served."),
    ("cached", "Prompt tokens taken from the KV cache (cached_tokens)."),
    ("evaluated", "Prompt tokens evaluated (prefilled)."),
    ("completion", "Tokens generated."),
)


class ServeMetrics:
    """Counters and histograms of one server process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self.latency: dict[tuple[str, str], _Histogram] = {}
        self.turns: dict[tuple[str, str], int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.in_flight = 0

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(method, route, str(status))] += 1
            histogram = self.latency.get((method, route))
            if histogram is None:
                histogram = self.latency[(method, route)] = _Histogram(LATENCY_BUCKETS)
            histogram.observe(seconds)

    def observe_turn(
        self,
        *,
        mode: str,
        finish: str,
        prompt: int,
        cached: int,
        evaluated: int,
        completion: int,
        ttft_s: float | None,
    ) -> None:
        with self._lock:
            self.turns[(mode, finish)] += 1
            self.tokens["prompt"] += prompt
            self.tokens["cached"] += cached
            self.tokens["evaluated"] += evaluated
            self.tokens["completion"] += completion
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def text(self, *, turns_in_flight: int, draining: bool) -> str:
        with self._lock:
            lines = [
                "# HELP chatctx_http_requests_total HTTP requests answered.",
                "# TYPE chatctx_http_requests_total counter",
            ]
            for (method, route, status), n in sorted(self.requests.items()):
                labels = [("method", method), ("route", route), ("status", status)]
                lines.append(f"chatctx_http_requests_total{_labels(labels)} {n}")
            lines += [
                "# HELP chatctx_http_request_duration_seconds Time to answer a request "
                "(a stream: until its last byte).",
                "# TYPE chatctx_http_request_duration_seconds histogram",
            ]
            for (method, route), histogram in sorted(self.latency.items()):
                lines += histogram.lines(
                    "chatctx_http_request_duration_seconds", [("method", method), ("route", route)]
                )
            lines += [
                "# HELP chatctx_serve_turns_total Chat turns served, by mode and finish reason.",
                "# TYPE chatctx_serve_turns_total counter",
            ]
            for (mode, finish), n in sorted(self.turns.items()):
                labels = [("mode", mode), ("finish_reason", finish)]
                lines.append(f"chatctx_serve_turns_total{_labels(labels)} {n}")
            for name, help_text in _TOKEN_COUNTERS:
                metric = f"chatctx_serve_{name}_tokens_total"
                lines += [
                    f"# HELP {metric} {help_text}",
                    f"# TYPE {metric} counter",
                    f"{metric} {self.tokens[name]}",
                ]
            lines += [
                "# HELP chatctx_serve_ttft_seconds Time to first token of the turns served "
                "(from the request, as the turn record counts it).",
                "# TYPE chatctx_serve_ttft_seconds histogram",
                *self.ttft.lines("chatctx_serve_ttft_seconds", []),
                "# HELP chatctx_serve_turns_in_flight Turns being answered now.",
                "# TYPE chatctx_serve_turns_in_flight gauge",
                f"chatctx_serve_turns_in_flight {turns_in_flight}",
                "# HELP chatctx_serve_draining 1 while the server drains after SIGTERM.",
                "# TYPE chatctx_serve_draining gauge",
                f"chatctx_serve_draining {int(draining)}",
            ]
        return "\n".join(lines) + "\n"
