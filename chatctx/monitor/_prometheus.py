"""Prometheus text exposition of chatctx's KV-cache and token figures."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from chatctx.backends.device import MemorySnapshot
from chatctx.monitor._slots import SWAP_PLACES, SlotTable
from chatctx.monitor._stats import BackendTotals, swap_totals, totals
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


# Engine counters of the slot table: (metric, counter, scale, help). "_ms" counters are
# exposed in seconds.
_POOL_COUNTERS = (
    ("chatctx_swap_out_total", "swap_out", 1, "KV states swapped out of the cache."),
    ("chatctx_swap_out_bytes_total", "swap_out_bytes", 1, "Bytes of KV state swapped out."),
    ("chatctx_swap_out_seconds_total", "swap_out_ms", 1e-3, "Time spent swapping out."),
    ("chatctx_swap_in_bytes_total", "swap_in_bytes", 1, "Bytes of KV state swapped in."),
    ("chatctx_swap_in_seconds_total", "swap_in_ms", 1e-3, "Time spent swapping in."),
    (
        "chatctx_reprefill_total",
        "reprefill",
        1,
        "Swapped KV states refused (prompt prefilled again instead).",
    ),
    ("chatctx_swap_spill_to_disk_total", "spill_to_disk", 1, "Swapped states moved to disk."),
    ("chatctx_swap_disk_dropped_total", "disk_dropped", 1, "Swapped states dropped from disk."),
    ("chatctx_batch_steps_total", "batch_steps", 1, "llama_decode steps of the pool."),
    ("chatctx_batch_tokens_total", "batch_tokens", 1, "Tokens decoded in those steps."),
    (
        "chatctx_batch_sequences_total",
        "batch_sequences",
        1,
        "Sequences decoded, summed over steps (divide by steps for the mean batch width).",
    ),
)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _slot_lines(table: SlotTable) -> list[str]:
    """Gauges and counters of the engine's slot pool, from its slot table file."""
    counters = table.counters
    lines = [
        "# HELP chatctx_pool_slots Slots in the pool.",
        "# TYPE chatctx_pool_slots gauge",
        f"chatctx_pool_slots {len(table.slots)}",
        "# HELP chatctx_pool_slots_leased Slots leased to a conversation.",
        "# TYPE chatctx_pool_slots_leased gauge",
        f"chatctx_pool_slots_leased {table.leased}",
        "# HELP chatctx_pool_slot_cells KV cells a slot's sequence holds.",
        "# TYPE chatctx_pool_slot_cells gauge",
    ]
    lines += [
        f"chatctx_pool_slot_cells{_labels(slot=str(r.slot), seq=str(r.seq_id))} {r.cells}"
        for r in table.slots
    ]
    lines += [
        "# HELP chatctx_pool_slot_leased 1 while the slot is leased.",
        "# TYPE chatctx_pool_slot_leased gauge",
    ]
    lines += [
        f"chatctx_pool_slot_leased{_labels(slot=str(r.slot), seq=str(r.seq_id))} {int(r.leased)}"
        for r in table.slots
    ]
    if table.reserved:
        lines += [
            "# HELP chatctx_pool_reserved_cells KV cells of a sequence kept out of the pool.",
            "# TYPE chatctx_pool_reserved_cells gauge",
        ]
        lines += [
            f"chatctx_pool_reserved_cells{_labels(seq=str(r.seq_id), role=r.role)} {r.cells}"
            for r in table.reserved
        ]
    lines += [
        "# HELP chatctx_swap_stored_bytes Bytes of swapped KV state held now.",
        "# TYPE chatctx_swap_stored_bytes gauge",
    ]
    lines += [
        f"chatctx_swap_stored_bytes{_labels(where=w)} {counters[f'{w}_bytes']}" for w in SWAP_PLACES
    ]
    lines += [
        "# HELP chatctx_swap_stored_conversations Conversations whose KV state is swapped out.",
        "# TYPE chatctx_swap_stored_conversations gauge",
    ]
    lines += [
        f"chatctx_swap_stored_conversations{_labels(where=w)} "
        f"{sum(r.where == w for r in table.swapped)}"
        for w in SWAP_PLACES
    ]
    lines += [
        "# HELP chatctx_swap_in_total KV states restored from a swap.",
        "# TYPE chatctx_swap_in_total counter",
    ]
    lines += [
        f"chatctx_swap_in_total{_labels(where=w)} {counters[f'swap_in_{w}']}" for w in SWAP_PLACES
    ]
    for metric, name, scale, help_text in _POOL_COUNTERS:
        value = counters[name] * scale  # an int counter times 1 stays an int
        lines += [
            f"# HELP {metric} {help_text}",
            f"# TYPE {metric} counter",
            f"{metric} {_number(value)}",
        ]
    lines += [
        "# HELP chatctx_batch_max_sequences Most sequences decoded together in one step.",
        "# TYPE chatctx_batch_max_sequences gauge",
        f"chatctx_batch_max_sequences {counters['batch_max']}",
        "# HELP chatctx_slot_table_updated_seconds When the engine last wrote its slot table.",
        "# TYPE chatctx_slot_table_updated_seconds gauge",
        f"chatctx_slot_table_updated_seconds {table.updated_at.timestamp():.3f}",
    ]
    return lines


def prometheus_text(
    conversations: Mapping[str, Sequence[Turn]],
    *,
    live_cells: Mapping[int, int] | None = None,
    n_ctx: int | None = None,
    live_memory: MemorySnapshot | None = None,
    slot_table: SlotTable | None = None,
    slot_tables: Sequence[SlotTable] = (),
    backends: Sequence[BackendTotals] = (),
) -> str:
    """Exposition text for each conversation's turns, plus live KV usage when given.

    ``live_cells`` maps sequence ids to the cells they use now (``Engine.kv_usage()``), the
    gauges llama.cpp's own server no longer exports. Memory gauges (RSS, GPU used/free) come
    from each conversation's last turn, and from ``live_memory`` (``memory_snapshot()``) when
    given; GPU gauges are left out where they were not measured. ``slot_table``
    (``read_slot_table()``) adds the slot pool: slots leased, cells per slot, swapped bytes,
    swap-in/out counts and times, and batch steps and tokens. ``slot_tables`` (several
    engines under one home, ``live_slot_tables()``) adds each one's, labelled
    ``engine="<pid>"``. ``backends`` (``backend_totals()``, behind a router) adds per-backend
    gauges labelled ``backend="<name>"``: conversations placed, slots busy, hit ratio,
    failovers, swap-ins and re-prefills by reason.
    """
    lines: list[str] = []
    stats = {cid: totals(turns) for cid, turns in conversations.items()}
    for name, help_text in _COUNTERS:
        metric = f"chatctx_{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        for cid, t in stats.items():
            lines.append(f"{metric}{_labels(conversation=cid)} {getattr(t, name)}")
    swaps = {cid: swap_totals(turns) for cid, turns in conversations.items()}
    lines += [
        "# HELP chatctx_swap_in_turns_total Turns whose KV state was restored from a swap.",
        "# TYPE chatctx_swap_in_turns_total counter",
    ]
    for cid, swap in swaps.items():
        for where in SWAP_PLACES:
            count = swap.swap_in_ram if where == "ram" else swap.swap_in_disk
            lines.append(
                f"chatctx_swap_in_turns_total{_labels(conversation=cid, where=where)} {count}"
            )
    lines += [
        "# HELP chatctx_reprefill_turns_total Turns that refused a swapped state and prefilled.",
        "# TYPE chatctx_reprefill_turns_total counter",
    ]
    lines += [
        f"chatctx_reprefill_turns_total{_labels(conversation=cid)} {swap.reprefills}"
        for cid, swap in swaps.items()
    ]
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
    if slot_table is not None:
        lines += _slot_lines(slot_table)
    if slot_tables:
        lines += _engine_lines(slot_tables)
    if backends:
        lines += _backend_lines(backends)
    return "\n".join(lines) + "\n"


_BACKEND_GAUGES = (
    ("chatctx_backend_conversations", "conversations", "gauge", "Conversations placed on it."),
    ("chatctx_backend_slots_busy", "slots_busy", "gauge", "Its slots leased now."),
    ("chatctx_backend_cache_hit_ratio", "cache_hit_ratio", "gauge", "Reused / prompt tokens."),
    ("chatctx_backend_turns_total", "turns", "counter", "Turns it ran."),
    ("chatctx_backend_failovers_total", "failovers", "counter", "Turns moved to it by failover."),
    ("chatctx_backend_swap_ins_total", "swap_ins", "counter", "Turns whose slot was swapped in."),
)


def _backend_lines(backends: Sequence[BackendTotals]) -> list[str]:
    lines: list[str] = []
    for metric, attr, kind, help_text in _BACKEND_GAUGES:
        rows = [(b.backend, getattr(b, attr)) for b in backends if getattr(b, attr) is not None]
        if not rows:
            continue
        lines += [
            f"# HELP {metric} Per backend behind a router: {help_text}",
            f"# TYPE {metric} {kind}",
        ]
        lines += [f"{metric}{_labels(backend=name)} {_number(value)}" for name, value in rows]
    states = [(b.backend, b.state) for b in backends if b.state is not None]
    if states:
        lines += [
            "# HELP chatctx_backend_up 1 when the backend takes turns, 0 when down or draining.",
            "# TYPE chatctx_backend_up gauge",
        ]
        lines += [f"chatctx_backend_up{_labels(backend=n)} {int(st == 'up')}" for n, st in states]
    lines += [
        "# HELP chatctx_backend_reprefills_total Turns that prefilled again there, by reason.",
        "# TYPE chatctx_backend_reprefills_total counter",
    ]
    for b in backends:
        for reason, count in b.reprefill_reasons.items():
            lines.append(
                f"chatctx_backend_reprefills_total{_labels(backend=b.backend, reason=reason)} "
                f"{count}"
            )
    return lines


def _engine_lines(tables: Sequence[SlotTable]) -> list[str]:
    """Every engine's pool metrics, one HELP/TYPE per metric, samples labelled by engine."""
    metrics: dict[str, list[str]] = {}  # metric -> its HELP and TYPE lines, then samples
    for table in tables:
        engine = f'engine="{table.pid}"'
        for line in _slot_lines(table):
            if line.startswith("#"):
                head = metrics.setdefault(line.split()[2], [])
                if len(head) < 2:  # HELP and TYPE, from the first engine
                    head.append(line)
                continue
            sample, value = line.rsplit(" ", 1)
            sample = f"{sample[:-1]},{engine}}}" if "{" in sample else f"{sample}{{{engine}}}"
            metrics[sample.split("{", 1)[0]].append(f"{sample} {value}")
    return [line for lines in metrics.values() for line in lines]
