"""Where the prefill goes beyond the new tokens: recall, summary extensions, compactions.

    python bench/memory_cost.py [--budget 1024] [--chats 40] [--simulate llama-server|engine]
        [--no-recall] [--recall-trigger question|any-question|always]
        [--layout auto|summary-first|append|abridge]
        [--probes bench/facts/final_probes.jsonl.gz]

Dry replays (no model) of the probe set's chats through the simulated cache of the engine or
of llama-server (``DryBackend``; the live rows of ``llama_server_bench.py peers`` reproduce
their evaluated tokens). Each turn's evaluated tokens are set against what is new in it (the
full conversation's new tokens and the recalled messages), and the excess is split by what
the turn did: evicted, changed the summary (an extension or a rewrite), recalled.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import recall_bench as rb
from llama_server_bench import RESERVE, full_messages, new_tokens

from chatctx.context import BuildResult, ContextBuilder
from chatctx.model.codec import open_codec
from chatctx.model.memory import pad256
from chatctx.model.paths import default_model_path
from chatctx.replay import DryBackend, ReplayConfig, Replayer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--chats", type=int, default=40)
    parser.add_argument("--simulate", choices=["engine", "llama-server"], default="llama-server")
    parser.add_argument("--no-recall", action="store_true")
    parser.add_argument(
        "--layout", choices=["auto", "summary-first", "append", "abridge"], default="auto"
    )
    parser.add_argument(
        "--recall-trigger", choices=["question", "any-question", "always"], default="question"
    )
    parser.add_argument("--probes", type=Path, default=rb.HERE / "facts" / "final_probes.jsonl.gz")
    args = parser.parse_args()
    model = default_model_path()
    codec = open_codec(model)
    conversations, _ = rb.load(args.probes)
    totals: collections.Counter[str] = collections.Counter()
    builds: list[tuple[BuildResult, str | None]] = []
    original = ContextBuilder.build

    def recording(self: ContextBuilder, **kwargs: Any) -> BuildResult:
        state = kwargs.get("state")
        built = original(self, **kwargs)
        builds.append((built, state.summary if state is not None else None))
        return built

    ContextBuilder.build = recording  # type: ignore[method-assign]
    edits = "in-place" if args.simulate == "engine" else "deletions"
    config = ReplayConfig(
        mode="teacher",
        budget=args.budget,
        reserve=RESERVE,
        recall=not args.no_recall,
        recall_trigger=args.recall_trigger,
        layout=args.layout,
    )
    for c in conversations[: args.chats]:
        turns: list[Any] = []
        builds.clear()
        with (
            DryBackend(
                codec, n_ctx=pad256(args.budget + RESERVE), model_path=model, cache_edits=edits
            ) as dry,
            Replayer(config, engine=dry) as replayer,
        ):
            report = replayer.replay(c, on_turn=turns.append)
        totals["new"] += sum(new_tokens(codec, full_messages(c)))
        totals["retained"] += report.retained_in_context
        totals["probes"] += report.probes
        asked = {p.asked_turn for p in c.probes}
        for index, (turn, (built, before)) in enumerate(
            zip(turns, builds[-len(turns) :], strict=True)
        ):
            plan = built.plan
            if plan.recalled_ids:  # recall's tokens on the turns that ask for a planted fact
                probe = "probe" if index in asked else "other"
                totals[f"recall turns: {probe}"] += 1
                totals[f"recall tokens: {probe}"] += plan.sections["recall"]
            kind = []
            if plan.evicted:
                kind.append("evicting")
            if plan.summary_changed:
                summary = built.state.summary or ""
                extended = bool(before) and summary.startswith(before or "")
                kind.append("summary extended" if extended else "summary rewritten")
            if plan.recalled_ids:
                kind.append("recalling")
            label = ", ".join(kind) or "plain"
            totals["evaluated"] += turn.evaluated_tokens
            totals["recalled"] += plan.sections["recall"]
            totals[f"turns: {label}"] += 1
            totals[f"excess: {label}"] += turn.evaluated_tokens - turn.new_tokens
    new, evaluated, recalled = totals["new"], totals["evaluated"], totals["recalled"]
    print(
        f"{args.chats} chats, budget {args.budget}, {args.simulate} cache, layout "
        f"{args.layout}, recall "
        f"{'off' if args.no_recall else 'on'}: evaluated {evaluated:,}, new {new:,}, recalled "
        f"{recalled:,}; amplification {evaluated / new:.2f}, recalled as new "
        f"{evaluated / (new + recalled):.2f}; fact retention {totals['retained']}/"
        f"{totals['probes']}"
    )
    print(
        f"recall on the {totals['recall turns: probe']:,} turns that ask for a planted fact: "
        f"{totals['recall tokens: probe']:,} tokens; on {totals['recall turns: other']:,} "
        f"others: {totals['recall tokens: other']:,}"
    )
    print("| turns | count | evaluated beyond their new and recalled tokens |\n|---|---|---|")
    labels = sorted({k.split(": ", 1)[1] for k in totals if k.startswith("turns: ")})
    for label in labels:
        print(f"| {label} | {totals['turns: ' + label]:,} | {totals['excess: ' + label]:,} |")


if __name__ == "__main__":
    main()
