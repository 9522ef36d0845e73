"""Replay a log file and read the report: where does the context, or the cache, break?

    python examples/replay_logs.py [LOGS.jsonl] [--budget 512] [--dry-run] [--model GGUF]

Teacher-forced by default (the logged replies are the history; each turn only prefills).
The same report comes from the CLI: ``chatctx replay LOGS.jsonl --json | jq .summary``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from chatctx.replay import ReplayConfig, Replayer, read_logs, replay_all, summarize

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="?", default=str(HERE / "data" / "support_logs.jsonl"))
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    config = ReplayConfig(mode="dry" if args.dry_run else "teacher", budget=args.budget)
    with Replayer(config, model=args.model) as replayer:
        reports = replay_all(replayer, read_logs([args.logs]))
    for report in reports:
        s = report.summary()
        print(
            f"{report.conversation}: {s['turns']} turns, amplification "
            f"{s['prefill_amplification']:.2f}, cache hits {s['cache_hit_ratio']:.0%}, "
            f"facts kept {s['fact_retention']}"
        )
        worst = max(report.turns, key=lambda t: t.evaluated_tokens)
        print(
            f"  costliest turn {worst.turn}: evaluated {worst.evaluated_tokens} of "
            f"{worst.prompt_tokens} prompt tokens ({'an' if worst.evicted else 'no'} "
            f"eviction, {worst.shifted_tokens} tokens shifted instead of re-evaluated)"
        )
    overall = summarize([t for r in reports for t in r.turns], reports)
    print(
        f"overall: amplification {overall['prefill_amplification']:.2f}, "
        f"fact retention {overall['fact_retention']}"
    )


if __name__ == "__main__":
    main()
