"""Agent benchmark (issue 42): tool results in the context policy.

    .venv/bin/python bench/agent_bench.py [--conversations 40] [--seed 1]
        [--budgets 4096,8192] [--simulate engine|llama-server] [--model GGUF]

Dry replays (tokenizer and template only, no weights; SmolLM2 by default) of synthetic
support-agent conversations with tool calls (``bench/agent_traces.py``: orders, shipment
histories, KB articles of 500-2,000 tokens; facts only a tool result holds, asked back 5-25
turns later), for

(a) whole turns only: watermarks, tool results never cleared (``tool_results_keep`` None);
(b) clearing first: watermarks, old tool results cleared to stubs before whole turns go
    (the defaults: the newest 2 stay whole);
(c) naive: trim-every-turn (the oldest turns dropped as soon as the prompt is over budget).

Recall is on in all three (the defaults). Figures: prefill amplification (tokens evaluated /
new tokens, over all turns), tool-result facts retrievable when asked (the fact string is in
the context sent with the question: kept, or recalled), user turns evicted, results cleared,
and conversations stopped by an error. Ratios come from one run; nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_traces import traces

from chatctx.model.codec import PromptCodec, open_codec
from chatctx.model.paths import default_model_path
from chatctx.replay import (
    LoggedConversation,
    ReplayConfig,
    Replayer,
    parse_logged,
    replay_all,
    summarize,
)
from chatctx.store import Store

SETUPS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("(a) whole turns only", {"policy": "watermarks", "tool_results_keep": None}),
    ("(b) clear old results first", {"policy": "watermarks"}),
    ("(c) trim every turn", {"policy": "trim-every-turn", "tool_results_keep": None}),
)


def _ids(ranges: Any) -> set[int]:
    return {i for first, last in ranges or () for i in range(first, last + 1)}


def run(
    conversations: list[LoggedConversation],
    budget: int,
    fields: dict[str, Any],
    codec: PromptCodec,
    simulate: str,
    folder: Path,
) -> dict[str, Any]:
    url = f"sqlite:///{folder / 'replay.db'}"
    Store(url).close()
    stores: list[str] = []

    def open_store(conversation_id: str) -> Store:
        stores.append(conversation_id)
        return Store(url)

    cfg = ReplayConfig(mode="dry", budget=budget, simulate=simulate, **fields)
    errors: list[str] = []
    started = time.perf_counter()
    with Replayer(cfg, codec=codec, store=open_store) as replayer:
        reports = replay_all(replayer, conversations, errors=errors, on_error="skip")
    seconds = time.perf_counter() - started
    totals = summarize([t for r in reports for t in r.turns], reports)
    evicted_users = cleared = cleared_tokens = 0
    with Store(url) as store:
        for conversation_id in stores:
            users = {m.id for m in store.messages(conversation_id) if m.role == "user"}
            for turn in store.turns(conversation_id):
                plan = turn.plan or {}
                evicted_users += len(_ids(plan.get("evicted_ids")) & users)
                cleared += len(plan.get("cleared_ids") or ())
            last = store.turns(conversation_id)[-1:]
            cleared_tokens += sum(t.tool_cleared_tokens or 0 for t in last)
    probes = sum(r.probes for r in reports)
    retained = sum(r.retained_in_context for r in reports)
    return {
        "amplification": totals["prefill_amplification"],
        "retained": retained,
        "probes": probes,
        "evicted_user_turns": evicted_users,
        "cleared": cleared,
        "cleared_tokens_at_end": cleared_tokens,
        "stopped": len(errors),
        "errors": errors[:3],
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budgets", default="4096,8192")
    parser.add_argument("--simulate", choices=("engine", "llama-server"), default="engine")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    model = args.model or default_model_path()
    codec = open_codec(model)
    lines = [json.dumps(t) for t in traces(args.conversations, args.seed)]
    conversations = [
        parse_logged(line, line=n, source="agent_traces") for n, line in enumerate(lines, 1)
    ]
    tool_turns = sum(1 for c in conversations for m in c.messages if m.get("role") == "tool")
    print(
        f"{len(conversations)} conversations, {sum(len(c.turns()) for c in conversations)} "
        f"user turns, {tool_turns} tool results, "
        f"{sum(len(c.probes) for c in conversations)} probes; model {model.name}; "
        f"simulated cache: {args.simulate}",
        file=sys.stderr,
    )
    results: dict[str, Any] = {}
    progress: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    for budget in (int(b) for b in args.budgets.split(",")):
        for label, fields in SETUPS:
            progress(f"budget {budget}: {label} ...")
            with tempfile.TemporaryDirectory() as folder:
                results[f"{budget} {label}"] = run(
                    conversations, budget, fields, codec, args.simulate, Path(folder)
                )
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        "| budget | setup | amplification | facts retrievable | user turns evicted | "
        "results cleared | stopped |"
    )
    print("|---|---|---|---|---|---|---|")
    for key, r in results.items():
        budget, label = key.split(" ", 1)
        share = r["retained"] / r["probes"] if r["probes"] else 0.0
        print(
            f"| {budget} | {label} | {r['amplification']:.3f} | {r['retained']}/{r['probes']} "
            f"({share:.2f}) | {r['evicted_user_turns']} | {r['cleared']} | {r['stopped']} |"
        )


if __name__ == "__main__":
    main()
