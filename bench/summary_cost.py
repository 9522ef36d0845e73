"""What an LLM summary costs the chat's KV cache: own sequence vs a side sequence.

    .venv/bin/python bench/summary_cost.py [--turns 40] [--budget 400]

Teacher-forced replay through SmolLM2 with ``summarizer="llm"``. With one sequence, the
summary request overwrites the chat's cached prompt, so the eviction turn re-evaluates it; on
a side sequence the chat's cache is untouched and only what changed is evaluated.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from chatctx import ChatSession, Engine
from chatctx.synthetic import support_conversation


def run(n_seq_max: int, turns: int, budget: int, eviction: str) -> None:
    messages = support_conversation(turns, seed=5)["messages"]
    evicting: list[tuple[int, int, float, float]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        Engine.load(None, n_ctx=budget + 16 + 1024 + 64, n_seq_max=n_seq_max) as engine,
        ChatSession.open(
            f"sqlite:///{tmp}/s.db",
            conversation_id="s",
            model=engine,
            system_prompt=messages[0]["content"],
            context={
                "budget": budget,
                "reserve": 16,
                "summarizer": "llm",
                "summary_max_tokens": 64,
                "eviction": eviction,
            },
        ) as chat,
    ):
        for user, reply in zip(messages[1::2], messages[2::2], strict=True):
            r = chat.record_turn(user["content"], reply["content"])
            if r.plan and r.plan.evicted:
                evicting.append(
                    (
                        r.usage.prompt_tokens,
                        r.usage.evaluated_tokens,
                        r.timings.ttft_ms or 0.0,
                        r.plan.summary_ms,
                    )
                )
    where = "a side sequence" if n_seq_max > 1 else "the chat's own sequence"
    print(
        f"| {where} | {eviction} | {len(evicting)} | "
        f"{statistics.mean(e[0] for e in evicting):.0f} | "
        f"{statistics.mean(e[1] for e in evicting):.0f} | "
        f"{statistics.mean(e[2] for e in evicting):.0f} | "
        f"{statistics.mean(e[3] for e in evicting):.0f} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--budget", type=int, default=400)
    args = parser.parse_args()
    print(
        "| summary runs on | eviction | eviction turns | prompt tokens | evaluated tokens | "
        "TTFT ms | summary ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for n_seq_max, eviction in ((1, "recompute"), (2, "recompute"), (2, "shift")):
        run(n_seq_max, args.turns, args.budget, eviction)


if __name__ == "__main__":
    main()
