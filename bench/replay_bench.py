"""Replay/tune benchmark (issue 5). Run by hand; prints figures measured in one run.

    .venv/bin/python bench/replay_bench.py [--count 1000] [--turns 40] [--probe-count 50]

A. Dry-run replay throughput (conversations/s) and peak memory on a synthetic file of
   ``--count`` conversations (``chatctx synth``), through the same API ``chatctx replay`` uses.
B. Fact retention and prefill amplification on long synthetic chats with planted facts
   (150 turns each), at budgets 512 / 1,024 / 2,048: trim-every-turn vs watermarks, with and
   without the extractive running summary (dry runs: tokenizer only, SmolLM2's vocabulary).
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import tempfile
import time
from pathlib import Path

from chatctx.model.paths import default_model_path
from chatctx.replay import ReplayConfig, Replayer, read_logs, replay_all, summarize
from chatctx.replay.tune import sweep
from chatctx.synthetic import support_conversation


def throughput(count: int, turns: int, model: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synth.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            for i in range(count):
                f.write(json.dumps(support_conversation(turns, seed=i)) + "\n")
        size = path.stat().st_size
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        with Replayer(ReplayConfig(mode="dry", budget=1024), model=model) as replayer:
            load = time.perf_counter() - t0
            reports = replay_all(replayer, read_logs([str(path)]))
        wall = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s = summarize([t for r in reports for t in r.turns], reports)
    print(
        f"\n## A. dry-run replay of {count:,} conversations x {turns} turns "
        f"({size / 1e6:.1f} MB gzipped), budget 1024, watermarks + shift, SmolLM2 tokenizer"
    )
    print(
        f"{s['turns']:,} turns in {wall:.1f} s (tokenizer load {load:.1f} s): "
        f"{count / wall:.1f} conversations/s, {s['turns'] / wall:,.0f} turns/s; "
        f"peak RSS {peak / 1024:.0f} MiB (before replay {rss_before / 1024:.0f} MiB); "
        f"amplification {s['prefill_amplification']:.2f}, fact retention "
        f"{s['fact_retention']:.2f}"
    )


def retention(n: int, model: Path) -> None:
    conversations = [read_one(support_conversation(150, seed=1000 + i)) for i in range(n)]
    print(
        f"\n## B. fact retention, {n} synthetic chats x 150 turns, "
        f"{sum(len(c.probes) for c in conversations)} probes (dry run)"
    )
    print(
        "| budget | policy | summary | eviction | fact retention | prefill amplification | "
        "cache hit ratio | evictions |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for summarizer in ("none", "extractive"):
        rows = sweep(
            conversations,
            budgets=[512, 1024, 2048],
            policies=["trim-every-turn", "watermarks"],
            evictions=["recompute", "shift"],
            summarizer=summarizer,
            model=model,
        )
        for r in rows:
            print(
                f"| {r['budget']} | {r['policy']} | {summarizer} | {r['eviction']} | "
                f"{r['fact_retention']:.2f} "
                f"| {r['prefill_amplification']:.2f} | {r['cache_hit_ratio']:.2f} | "
                f"{r['evictions']} |",
                flush=True,
            )


def read_one(conv: dict) -> object:
    from chatctx.replay import parse_logged

    return parse_logged(json.dumps(conv), line=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--probe-count", type=int, default=20)
    args = parser.parse_args()
    model = default_model_path()
    throughput(args.count, args.turns, model)
    retention(args.probe_count, model)


if __name__ == "__main__":
    main()
