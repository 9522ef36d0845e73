"""Pick a prompt budget with the Python API: sweep budgets and policies over logged chats.

    python examples/tune_budget.py [LOGS.jsonl] [--out tune] [--model GGUF]

Dry runs (tokenizer only, no weights): prefill amplification, cache hit ratio and fact
retention for each budget x policy, a table on stdout and a PNG plot.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from chatctx.replay import read_logs
from chatctx.replay.tune import plot, recommend, sweep, write_table

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="?", default=str(HERE / "data" / "support_logs.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("tune"))
    parser.add_argument("--model", default=None, help="GGUF whose tokenizer and template count")
    parser.add_argument("--budgets", default="512,1024,2048")
    args = parser.parse_args()

    conversations = list(read_logs([args.logs]))
    rows = sweep(
        conversations,
        budgets=[int(b) for b in args.budgets.split(",")],
        policies=["trim-every-turn", "watermarks"],
        evictions=["recompute", "shift"],
        model=args.model,
    )
    print(f"{'budget':>6}  {'policy':<16} {'eviction':<9} {'ampl.':>6} {'hit':>5} {'facts':>5}")
    for r in rows:
        print(
            f"{r['budget']:>6}  {r['policy']:<16} {r['eviction']:<9} "
            f"{r['prefill_amplification']:>6.2f} {r['cache_hit_ratio']:>5.2f} "
            f"{r['fact_retention'] if r['fact_retention'] is not None else '-':>5}"
        )
    best, objective = recommend(rows, min_retention=0.9)
    print(f"\nobjective: {objective}")
    print(f"recommended: {best}" if best else "no setting meets it")
    csv_path, _ = write_table(rows, args.out)
    print(f"wrote {csv_path} and {plot(rows, args.out / 'tune.png')}")


if __name__ == "__main__":
    main()
