"""Does a summary delay the customer's turn? TTFT (from the request) of evicting vs plain turns.

    .venv/bin/python bench/evicting_ttft.py [--turns 60] [--budget 512] [--think-ms 300]
        [--recall]

A synthetic support chat through SmolLM2 with generated replies (``send``), once with the
extractive summarizer and once with the LLM one. An evicting turn is one whose plan evicted
turns; a plain turn evicted nothing and sent no new summary. The LLM summary runs in the
background on the spare sequence and takes effect at the first turn after it is done
("collect" turns: the new summary is evaluated in front of the kept turns). ``--think-ms``
is the pause between a reply and the next message (a person typing), when a background
summary can work. With ``--recall``, recall is on as by default (by meaning when the embedder is
installed): a turn that recalls also evaluates its recall section (up to ``recall_budget``
tokens), evicting or not, and a question is owed its recall room, so it may evict early.
Turns are then split by both: an evicting turn is compared with a plain one, an evicting turn
that recalled with one that recalled and evicted nothing. Ratios come from one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from chatctx import ChatSession, Engine
from chatctx.synthetic import support_conversation


def run(
    summarizer: str, turns: int, budget: int, think_ms: int, max_tokens: int, recall: bool
) -> list[str]:
    messages = support_conversation(turns, seed=11)["messages"]
    groups: dict[str, list[float]] = {
        k: [] for k in ("plain", "evicting", "collect", "recalling", "evicting, recalling")
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        Engine.load(None, n_ctx=budget + max_tokens + 1024 + 128, n_seq_max=2) as engine,
        ChatSession.open(
            f"sqlite:///{tmp}/s.db",
            model=engine,
            system_prompt=messages[0]["content"],
            settings={"max_tokens": max_tokens, "temperature": 0.0},
            context={
                "budget": budget,
                "summarizer": summarizer,
                "summary_max_tokens": 96,
                "recall": recall,
            },
        ) as chat,
    ):
        for user in messages[1::2]:
            reply = chat.send(user["content"])
            plan = reply.plan
            assert plan is not None and reply.timings.ttft_ms is not None
            kind = "evicting" if plan.evicted else "collect" if plan.summary_changed else "plain"
            if plan.recalled_ids and kind != "collect":
                kind = "recalling" if kind == "plain" else "evicting, recalling"
            groups[kind].append(reply.timings.ttft_ms)
            time.sleep(think_ms / 1000)
    rows = []
    for kind, values in groups.items():
        if not values:
            continue
        base = groups["recalling" if "recalling" in kind else "plain"] or groups["plain"]
        med = statistics.median(values)
        rows.append(
            f"| {summarizer} | {kind} | {len(values)} | {med:.0f} | {max(values):.0f} | "
            f"{med / statistics.median(base):.2f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--think-ms", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--recall", action="store_true", help="recall on, as by default")
    args = parser.parse_args()
    print(
        f"SmolLM2, budget {args.budget}, {args.turns} turns, think time {args.think_ms} ms, "
        f"replies of at most {args.max_tokens} tokens, recall {'on' if args.recall else 'off'}; "
        "TTFT from the request\n"
    )
    print("| summarizer | turn | n | TTFT median ms | TTFT max ms | median / like turns' |")
    print("|---|---|---|---|---|---|")
    for summarizer in ("extractive", "llm"):
        for row in run(
            summarizer, args.turns, args.budget, args.think_ms, args.max_tokens, args.recall
        ):
            print(row, flush=True)


if __name__ == "__main__":
    main()
