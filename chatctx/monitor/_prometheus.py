"""Prometheus text exposition of chatctx's KV-cache and token figures."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from chatctx.monitor._device import MemorySnapshot
from chatctx.monitor._stats import totals
from chatctx.store import Turn


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


_COUNTERS = (
    ("turns", "Turns answered."),
    ("prompt_tokens", "Prompt tokens sent to llama.cpp."),
    ("new_tokens", "Prompt tokens no earlier prompt contained."),
    ("reused_tokens", "Prompt tokens reused from the KV cache."),
    ("evaluated_tokens", "Prompt tokens evaluated (prefilled)."),
    ("generated_tokens", "Tokens generated."),
    ("evicted_tokens", "Tokens removed from the KV cache."),
    ("shifted_tokens", "Cached tokens moved to new positions instead of being re-evaluated."),
    ("shift_count", "KV position shifts."),
    ("evictions", "Turns on which the context builder evicted history."),
)


_MEMORY_GAUGES = (
    ("chatctx_rss_bytes", "rss_bytes", "Process resident set after the conversation's last turn."),
    (
        "chatctx_gpu_used_bytes",
        "gpu_used_bytes",
        "GPU memory used after the conversation's last turn.",
    ),
    (
        "chatctx_gpu_free_bytes",
        "gpu_free_bytes",
        "GPU memory free after the conversation's last turn.",
    ),
)


def prometheus_text(
    conversations: Mapping[str, Sequence[Turn]],
    *,
    live_cells: Mapping[int, int] | None = None,
    n_ctx: int | None = None,
    live_memory: MemorySnapshot | None = None,
) -> str:
    """Exposition text for each conversation's turns, plus live KV usage when given.

    ``live_cells`` maps sequence ids to the cells they use now (``Engine.kv_usage()``), the
    gauges llama.cpp's own server no longer exports. Memory gauges (RSS, GPU used/free) come
    from each conversation's last turn, and from ``live_memory`` (``memory_snapshot()``) when
    given; GPU gauges are left out where they were not measured.
    """
    lines: list[str] = []
    stats = {cid: totals(turns) for cid, turns in conversations.items()}
    for name, help_text in _COUNTERS:
        metric = f"chatctx_{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        for cid, t in stats.items():
            lines.append(f"{metric}{_labels(conversation=cid)} {getattr(t, name)}")
    gauges: Iterable[tuple[str, str, str]] = (
        (
            "chatctx_prefill_amplification",
            "prefill_amplification",
            "Evaluated / new prompt tokens (1.0 = every token evaluated once).",
        ),
        ("chatctx_cache_hit_ratio", "cache_hit_ratio", "Reused / prompt tokens."),
    )
    for metric, field, help_text in gauges:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        for cid, t in stats.items():
            value = getattr(t, field)
            if value is not None:
                lines.append(f"{metric}{_labels(conversation=cid)} {value:.6g}")
    lines += [
        "# HELP chatctx_ttft_seconds Time to first token.",
        "# TYPE chatctx_ttft_seconds summary",
    ]
    for cid, t in stats.items():
        for quantile, value in (("0.5", t.ttft_p50_ms), ("0.95", t.ttft_p95_ms)):
            if value is not None:
                lines.append(
                    f"chatctx_ttft_seconds{_labels(conversation=cid, quantile=quantile)}"
                    f" {value / 1000:.6g}"
                )
    lines += [
        "# HELP chatctx_kv_cells_used KV cells a sequence used after the conversation's last turn.",
        "# TYPE chatctx_kv_cells_used gauge",
    ]
    for cid, turns in conversations.items():
        if turns and turns[-1].cells_used:
            for seq, cells in sorted(turns[-1].cells_used.items()):
                lines.append(
                    f"chatctx_kv_cells_used{_labels(conversation=cid, seq=str(seq))} {cells}"
                )
    for metric, attr, help_text in _MEMORY_GAUGES:
        rows = [
            (cid, getattr(turns[-1], attr))
            for cid, turns in conversations.items()
            if turns and getattr(turns[-1], attr) is not None
        ]
        if rows:
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
            lines += [f"{metric}{_labels(conversation=cid)} {value}" for cid, value in rows]
    if live_memory is not None:
        for metric, attr, help_text in _MEMORY_GAUGES:
            value = getattr(live_memory, attr)
            if value is not None:
                live_metric = metric.replace("chatctx_", "chatctx_live_", 1)
                what = help_text.split(" after ")[0]
                lines += [
                    f"# HELP {live_metric} {what}, now.",
                    f"# TYPE {live_metric} gauge",
                    f"{live_metric} {value}",
                ]
    if live_cells is not None:
        lines += [
            "# HELP chatctx_kv_live_cells_used KV cells in use now, per sequence.",
            "# TYPE chatctx_kv_live_cells_used gauge",
        ]
        for live_seq, live in sorted(live_cells.items()):
            lines.append(f"chatctx_kv_live_cells_used{_labels(seq=str(live_seq))} {live}")
    if n_ctx is not None:
        lines += [
            "# HELP chatctx_kv_cells_total KV cells in the context (n_ctx).",
            "# TYPE chatctx_kv_cells_total gauge",
            f"chatctx_kv_cells_total {n_ctx}",
        ]
        if live_cells is not None:
            used = sum(live_cells.values())
            lines += [
                "# HELP chatctx_kv_usage_ratio Share of KV cells in use.",
                "# TYPE chatctx_kv_usage_ratio gauge",
                f"chatctx_kv_usage_ratio {used / n_ctx:.6g}",
            ]
    return "\n".join(lines) + "\n"
