"""Sweeping budgets × policies × eviction over logged conversations, and picking a setting."""

from __future__ import annotations

import csv
import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chatctx.backends.base import Codec
from chatctx.errors import ConfigError
from chatctx.replay._input import LoggedConversation
from chatctx.replay._run import Replayer, replay_all, summarize
from chatctx.settings import ContextSettings, ReplayConfig

COLUMNS = (
    "budget",
    "policy",
    "eviction",
    "summarizer",
    "prefill_amplification",
    "cache_hit_ratio",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "fact_retention",
    "evictions",
    "turns",
    "conversations",
)


def sweep(
    conversations: Sequence[LoggedConversation],
    *,
    budgets: Sequence[int],
    policies: Sequence[str],
    evictions: Sequence[str],
    summarizer: str = "extractive",
    with_model: bool = False,
    model: str | Path | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row of totals per combination; dry runs (tokenizer only) unless ``with_model``."""
    rows: list[dict[str, Any]] = []
    codec: Codec | None = None
    for budget in budgets:
        for policy in policies:
            for eviction in evictions:
                config = ReplayConfig(
                    mode="teacher" if with_model else "dry",
                    context=ContextSettings(
                        budget=budget, policy=policy, eviction=eviction, summarizer=summarizer
                    ),
                )
                with Replayer(config, model=model, codec=codec) as replayer:
                    codec = codec or replayer.codec
                    reports = replay_all(replayer, conversations)
                totals = summarize([t for r in reports for t in r.turns], reports)
                row = {
                    "budget": budget,
                    "policy": policy,
                    "eviction": eviction,
                    "summarizer": summarizer,
                } | {k: totals.get(k) for k in COLUMNS[4:]}
                rows.append(row)
                if on_step is not None:
                    on_step(row)
    return rows


UBATCH_COLUMNS = (
    "budget",
    "n_ubatch",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "prefill_tokens_per_s",
    "evaluated_tokens",
    "compute_bytes_planned",
    "turns",
)


def sweep_ubatch(
    conversations: Sequence[LoggedConversation],
    *,
    budgets: Sequence[int],
    ubatches: Sequence[int],
    policy: str = "watermarks",
    eviction: str = "shift",
    summarizer: str = "extractive",
    model: str | Path | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """TTFT and prefill speed by micro-batch size (teacher-forced), with the planner's
    compute-buffer estimate for each: a bigger micro-batch prefills faster and costs memory.

    Prefill tok/s is evaluated prompt tokens over the summed TTFTs (prefill plus the first
    sampled token), per budget and ``n_ubatch``.
    """
    from chatctx.model.memory import ModelShape, plan_memory
    from chatctx.model.paths import resolve_model_path

    path = resolve_model_path(model)
    shape = ModelShape.from_gguf(path)
    rows: list[dict[str, Any]] = []
    for budget in budgets:
        for n_ubatch in ubatches:
            config = ReplayConfig(
                mode="teacher",
                context=ContextSettings(
                    budget=budget, policy=policy, eviction=eviction, summarizer=summarizer
                ),
            )
            n_ctx = budget + config.reserve_tokens
            n_batch = max(512, n_ubatch)
            planned = plan_memory(shape, n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch)
            from chatctx.backends.engine import Engine  # the ubatch sweep runs the model here

            with (
                Engine.load(
                    path, n_ctx=n_ctx, n_seq_max=2, n_ubatch=n_ubatch, n_batch=n_batch
                ) as engine,
                Replayer(config, engine=engine) as replayer,
            ):
                reports = replay_all(replayer, conversations)
            turns = [t for r in reports for t in r.turns]
            timed = [t for t in turns if t.ttft_ms is not None]
            ttft_total = sum(t.ttft_ms or 0.0 for t in timed)
            evaluated = sum(t.evaluated_tokens for t in timed)
            totals = summarize(turns, reports)
            row = {
                "budget": budget,
                "n_ubatch": n_ubatch,
                "ttft_p50_ms": totals.get("ttft_p50_ms"),
                "ttft_p95_ms": totals.get("ttft_p95_ms"),
                "prefill_tokens_per_s": evaluated / ttft_total * 1000 if ttft_total else None,
                "evaluated_tokens": evaluated,
                "compute_bytes_planned": planned.compute_bytes,
                "turns": len(turns),
            }
            rows.append(row)
            if on_step is not None:
                on_step(row)
    return rows


def write_ubatch_table(rows: Sequence[dict[str, Any]], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tune_ubatch.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(UBATCH_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return path


def recommend(
    rows: Sequence[dict[str, Any]], *, min_retention: float = 0.9, max_ttft_ms: float | None = None
) -> tuple[dict[str, Any] | None, str]:
    """The smallest budget meeting the objective, then the lowest prefill amplification."""
    objective = f"fact retention >= {min_retention:.2f}"
    if max_ttft_ms is not None:
        objective += f" and p95 TTFT <= {max_ttft_ms:.0f} ms"

    def ok(row: dict[str, Any]) -> bool:
        retention = row.get("fact_retention")
        if retention is not None and retention < min_retention:
            return False
        ttft = row.get("ttft_p95_ms")
        return max_ttft_ms is None or ttft is None or ttft <= max_ttft_ms

    candidates = [r for r in rows if ok(r)]
    if not candidates:
        return None, f"no setting meets the objective ({objective})"
    best = min(candidates, key=lambda r: (r["budget"], r["prefill_amplification"] or 0.0))
    return best, objective


def write_table(rows: Sequence[dict[str, Any]], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "tune.csv", out / "tune.json"
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps(list(rows), indent=2), encoding="utf-8")
    return csv_path, json_path


PLOT_INSTALL = "pip install 'chatctx[plot]'"


def plot_available() -> bool:
    """Whether matplotlib, the optional ``plot`` extra, is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def plot(rows: Sequence[dict[str, Any]], path: Path, *, title: str = "chatctx tune") -> Path:
    """Budget on x; prefill amplification, p95 TTFT and fact retention on y; a line per policy.

    Needs matplotlib (``pip install 'chatctx[plot]'``); ``plot_available()`` says whether it is.
    """
    if not plot_available():
        raise ConfigError(f"plotting needs matplotlib: {PLOT_INSTALL}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("prefill_amplification", "prefill amplification (evaluated / new)"),
        ("ttft_p95_ms", "p95 TTFT (ms)"),
        ("fact_retention", "fact retention"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        lines.setdefault(f"{row['policy']} + {row['eviction']}", []).append(row)
    for ax, (key, label) in zip(axes, panels, strict=True):
        drawn = False
        for name, points in lines.items():
            points = sorted(
                (p for p in points if p.get(key) is not None), key=lambda p: p["budget"]
            )
            if points:
                ax.plot(
                    [p["budget"] for p in points], [p[key] for p in points], marker="o", label=name
                )
                drawn = True
        ax.set_xlabel("budget (prompt tokens)")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        if key == "fact_retention":
            ax.set_ylim(-0.05, 1.05)
        if not drawn:
            ax.text(
                0.5,
                0.5,
                "not measured\n(dry run: use --with-model)"
                if key == "ttft_p95_ms"
                else "no probes in the input",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
        elif key != "fact_retention" or drawn:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "COLUMNS",
    "UBATCH_COLUMNS",
    "plot",
    "recommend",
    "sweep",
    "sweep_ubatch",
    "write_table",
    "write_ubatch_table",
]
