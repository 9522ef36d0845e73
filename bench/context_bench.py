"""Context-builder benchmark (issue 3). Run by hand; prints ratios measured in one run.

    .venv/bin/python bench/context_bench.py [--turns 300] [--budget 1024] [--skip-chat]

A. Token counting: tiktoken mirror vs llama.cpp's tokenizer on ~100 KB, both offline models.
B. Builder time per turn with a 10,000-message history in SQLite (state load + plan), p50/p95,
   and the first (cold) build that counts the whole history once.
C. A synthetic support conversation chatted through SmolLM2 at a prompt budget, under the
   watermark policy and under trim-every-turn: context errors, prefix-stable turns (the prompt
   extends the previous prompt, so llama.cpp reuses it), evictions, prefill amplification.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from chatctx import ChatctxError, ChatSession, Engine, Store
from chatctx.context import ContextBuilder, ContextState, ExtractiveSummarizer
from chatctx.model.codec import open_codec
from chatctx.model.paths import default_model_path
from chatctx.settings import ContextSettings
from chatctx.synthetic import support_conversation
from chatctx.testing import write_tiny_llama3

ROOT = Path(__file__).resolve().parent.parent


def timed(fn, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def counting(models: dict[str, Path]) -> None:
    print("\n## A. token counting, ~100 KB of mixed text (best of 5)")
    text = (
        (ROOT / "README.md").read_text()
        + (ROOT / "chatctx" / "session" / "_session.py").read_text()
        + "한국어 텍스트 🎉 12345 " * 50
    )
    text = (text * (100_000 // len(text) + 1))[:100_000]
    print("| model | tokens | tiktoken ms | llama.cpp ms | speed-up |")
    print("|---|---|---|---|---|")
    for name, path in models.items():
        with Engine.load(path, n_ctx=256) as engine:
            codec = engine.codec()
            assert codec.encode(text) == engine.tokenize(text)
            t_tt = timed(lambda: codec.encode(text))  # noqa: B023
            t_ll = timed(lambda: engine.tokenize(text))
            print(
                f"| {name} | {len(engine.tokenize(text))} | {t_tt:.1f} | {t_ll:.1f} | "
                f"{t_ll / t_tt:.1f}x |"
            )


def builder_latency(llama3: Path, n_messages: int = 10_000, turns: int = 200) -> None:
    print(f"\n## B. builder time per turn, {n_messages:,}-message history in SQLite")
    codec = open_codec(llama3)
    conv = support_conversation(n_messages // 2, seed=3)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/b.db")
        store.create_conversation("big", system_prompt=conv["messages"][0]["content"])
        store.add_messages("big", conv["messages"][1:])
        settings = ContextSettings()
        builder = ContextBuilder(
            codec,
            settings,
            summarizer=ExtractiveSummarizer(codec.count, max_tokens=256),
            cache=store,
            lookup=store.messages_by_ids,
        )
        budget = 1024

        def one_turn(text: str) -> float:
            t0 = time.perf_counter()
            stored = store.context_state("big")
            state = ContextState(
                window_start=stored.window_start,
                summary=stored.summary.content if stored.summary else None,
                summary_tokens=stored.summary.token_count or 0 if stored.summary else 0,
            )
            history = store.messages("big", from_position=state.window_start)
            result = builder.build(
                system_prompt=conv["messages"][0]["content"],
                history=history,
                new_message=text,
                budget=budget,
                state=state,
            )
            elapsed = (time.perf_counter() - t0) * 1000
            new_summary = None
            if result.plan.summary_changed and result.state.summary:
                new_summary = (
                    result.state.summary,
                    result.plan.summarized_ids,
                    result.state.summary_tokens,
                    codec.fingerprint,
                )
            store.save_context_state(
                "big", window_start=result.state.window_start, new_summary=new_summary
            )
            store.add_messages(
                "big",
                [
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": "Noted, thank you."},
                ],
            )
            return elapsed

        cold = one_turn("First question after importing a long history.")
        times = [
            one_turn(f"Follow-up question number {i} about order NH-{10000 + i}.")
            for i in range(turns)
        ]
        store.close()
    times.sort()
    print(
        f"cold first build (counts and summarizes the {n_messages:,} messages once): {cold:.0f} ms"
    )
    print(
        f"per turn over {turns} turns: p50 {statistics.median(times):.2f} ms, "
        f"p95 {times[int(len(times) * 0.95)]:.2f} ms, max {times[-1]:.1f} ms"
    )


def chat(smol: Path, turns: int, budget: int, max_tokens: int, eviction: str) -> None:
    print(f"\n## C. {turns}-turn synthetic support chat through SmolLM2, prompt budget {budget}")
    conv = support_conversation(turns, seed=7)
    users = [m["content"] for m in conv["messages"] if m["role"] == "user"]
    total_chars = sum(len(m["content"]) for m in conv["messages"])
    print(
        f"(logged conversation: {total_chars:,} characters; replies generated, "
        f"max_tokens {max_tokens}, temperature 0.7, seed 1, eviction {eviction}; a turn is "
        "prefix-stable when its prompt extends the previous prompt)"
    )
    print(
        "| policy | context errors | prefix-stable turns | evictions | prompt tokens | "
        "evaluated | amplification | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with (
        Engine.load(smol, n_ctx=budget + max_tokens) as engine,
        tempfile.TemporaryDirectory() as tmp,
    ):
        for policy in ("watermarks", "trim-every-turn"):
            engine.clear()
            errors = stable = evictions = 0
            prompt = evaluated = new = 0
            previous = None
            t0 = time.perf_counter()
            with ChatSession.open(
                f"sqlite:///{tmp}/{policy}.db",
                conversation_id="c",
                model=engine,
                system_prompt=conv["messages"][0]["content"],
                settings={"max_tokens": max_tokens, "seed": 1},
                context={"policy": policy, "budget": budget, "eviction": eviction},
            ) as session:
                for text in users:
                    try:
                        reply = session.send(text)
                    except ChatctxError as exc:
                        errors += 1
                        print(f"  error: {exc}")
                        continue
                    u = reply.usage
                    tokens = session.last_build.tokens if session.last_build else []
                    if previous is not None and tokens[: len(previous)] == previous:
                        stable += 1
                    previous = list(tokens)
                    evictions += reply.plan.evicted if reply.plan else 0
                    prompt += u.prompt_tokens
                    evaluated += u.evaluated_tokens
                    new += reply.plan.new_tokens if reply.plan else 0
            wall = time.perf_counter() - t0
            print(
                f"| {policy} | {errors} | {stable}/{len(users) - 1} "
                f"({stable / (len(users) - 1):.0%}) | {evictions} | {prompt:,} | "
                f"{evaluated:,} | {evaluated / max(new, 1):.2f} | {wall:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--skip-chat", action="store_true")
    parser.add_argument("--eviction", choices=["shift", "recompute"], default="recompute")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llama3 = write_tiny_llama3(Path(tmp) / "tiny-llama3.gguf")
        smol = default_model_path()
        counting({"tiny Llama 3 (128k vocab)": llama3, "SmolLM2 (49k vocab)": smol})
        builder_latency(llama3)
        if not args.skip_chat:
            chat(smol, args.turns, args.budget, args.max_tokens, args.eviction)


if __name__ == "__main__":
    main()
