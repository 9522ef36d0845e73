"""KV-cache benchmark (issue 4). Run by hand; prints ratios measured in one run.

    .venv/bin/python bench/kv_bench.py [--turns 160] [--budgets 512,1024] [--models smollm2,llama3]

Replays a long synthetic support conversation teacher-forced (the logged assistant replies are
the history; each turn only prefills, so this measures context and cache, not generation):

(a) naive: trim to fit every turn (LangChain ``trim_messages`` style: system + the most recent
    messages that fit, starting on a user message) through llama-cpp-python's
    ``Llama.create_chat_completion(max_tokens=1)`` and its own prefix cache;
(b) chatctx, watermarks + recompute;  (c) chatctx, watermarks + shift (in-place eviction).

Per policy: prefill amplification (evaluated / new tokens, where new tokens are what the full
conversation adds each turn, counted once for all policies), cache hit ratio (reused / prompt),
p50 TTFT of turns 1-10 vs the last 10, and wall time. Then the accuracy of a shift: next-token
logits after in-place eviction vs a full recompute of the same prompt.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from chatctx import ChatSession, Engine
from chatctx.model.codec import PromptCodec
from chatctx.model.kv import common_prefix
from chatctx.model.paths import default_model_path
from chatctx.synthetic import support_conversation
from chatctx.testing import write_tiny_llama3

RESERVE = 16


def new_tokens_per_turn(codec: PromptCodec, messages: list[dict[str, Any]]) -> list[int]:
    """Tokens each turn adds to the full, untrimmed conversation (same for every policy)."""
    counts, previous = [], 0
    for i in range(1, len(messages), 2):
        n = len(codec.prompt_tokens(messages[: i + 1]))
        counts.append(n - previous)
        previous = n
    return counts


def trim_last(codec: PromptCodec, messages: list[dict[str, Any]], budget: int) -> list[dict]:
    """System (if any) + the most recent messages whose rendered prompt fits, starting on a
    user message."""
    has_system = bool(messages) and messages[0]["role"] == "system"
    system, rest = messages[: int(has_system)], messages[int(has_system) :]
    lo, hi = 0, len(rest) - 1  # binary search on the first kept message
    while lo < hi:
        mid = (lo + hi) // 2
        if len(codec.prompt_tokens(system + rest[mid:])) <= budget:
            hi = mid
        else:
            lo = mid + 1
    start = lo
    while start < len(rest) - 1 and rest[start]["role"] != "user":
        start += 1
    return system + rest[start:]


def naive(
    path: Path, messages: list[dict[str, Any]], budget: int, codec: PromptCodec, new: list[int]
) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=budget + RESERVE, n_batch=512, verbose=False)
    prompt_total = reused_total = evaluated_total = 0
    ttfts = []
    t0 = time.perf_counter()
    for i in range(1, len(messages), 2):
        sent = trim_last(codec, messages[: i + 1], budget)
        before = llm._input_ids[: llm.n_tokens].tolist()
        t = time.perf_counter()
        out = llm.create_chat_completion(messages=sent, max_tokens=1, temperature=0.0)
        ttfts.append((time.perf_counter() - t) * 1000)
        n_prompt = out["usage"]["prompt_tokens"]
        prompt = llm._input_ids[:n_prompt].tolist()
        reused = min(common_prefix(before, prompt), n_prompt - 1)
        prompt_total += n_prompt
        reused_total += reused
        evaluated_total += n_prompt - reused
    llm.close()
    return summary(
        "(a) naive trim + llama-cpp-python",
        prompt_total,
        reused_total,
        evaluated_total,
        sum(new),
        ttfts,
        time.perf_counter() - t0,
    )


def chatctx_run(
    engine: Engine,
    messages: list[dict[str, Any]],
    budget: int,
    eviction: str,
    new: list[int],
    db: str,
) -> dict[str, Any]:
    engine.clear()
    prompt_total = reused_total = evaluated_total = 0
    ttfts: list[float] = []
    t0 = time.perf_counter()
    with ChatSession.open(
        db,
        conversation_id=f"bench-{eviction}",
        model=engine,
        system_prompt=messages[0]["content"],
        context={"budget": budget, "reserve": RESERVE, "eviction": eviction},
    ) as chat:
        for user, reply in zip(messages[1::2], messages[2::2], strict=True):
            r = chat.record_turn(user["content"], reply["content"])
            prompt_total += r.usage.prompt_tokens
            reused_total += r.usage.reused_tokens
            evaluated_total += r.usage.evaluated_tokens
            ttfts.append(r.timings.ttft_ms or 0.0)
    return summary(
        f"({'b' if eviction == 'recompute' else 'c'}) chatctx watermarks + {eviction}",
        prompt_total,
        reused_total,
        evaluated_total,
        sum(new),
        ttfts,
        time.perf_counter() - t0,
    )


def summary(
    name: str, prompt: int, reused: int, evaluated: int, new: int, ttfts: list[float], wall: float
) -> dict[str, Any]:
    first, last = statistics.median(ttfts[:10]), statistics.median(ttfts[-10:])
    return {
        "policy": name,
        "amplification": evaluated / new,
        "hit": reused / prompt,
        "ttft_first": first,
        "ttft_last": last,
        "ttft_ratio": last / first,
        "wall": wall,
        "evaluated": evaluated,
        "new": new,
    }


def accuracy(engine: Engine, messages: list[dict[str, Any]]) -> dict[str, float]:
    """Shift vs recompute on a realistic chat: evict the oldest 60% of 20 turns."""
    system, turns = messages[:1], messages[1:41]
    old = system + turns
    new = system + turns[24:] + [{"role": "user", "content": "Can you summarize my case?"}]
    history_start = len(engine.prompt_tokens(system, add_generation_prompt=False))
    prompt = engine.prompt_tokens(new)
    engine.clear()
    engine.prefill(engine.prompt_tokens(old, add_generation_prompt=False))
    report = engine.prefill(prompt, eviction="shift", history_start=history_start).kv
    shifted = engine.context.logits(-1)
    engine.clear()
    engine.prefill(prompt, eviction="recompute")
    full = engine.context.logits(-1)
    engine.prefill(prompt)  # the same prompt again: only the last token is re-evaluated
    again = engine.context.logits(-1)

    def softmax(xs: list[float]) -> list[float]:
        m = max(xs)
        e = [math.exp(x - m) for x in xs]
        s = sum(e)
        return [v / s for v in e]

    p, q = softmax(full), softmax(shifted)
    kl = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0 and b > 0)
    top = sorted(range(len(full)), key=full.__getitem__, reverse=True)[:5]
    return {
        "shifted_tokens": float(report.shifted_tokens if report else 0),
        "max_abs_diff": max(abs(a - b) for a, b in zip(shifted, full, strict=True)),
        "max_abs_logit": max(abs(v) for v in full),
        "noise_floor": max(abs(a - b) for a, b in zip(again, full, strict=True)),
        "argmax_same": float(max(range(len(shifted)), key=shifted.__getitem__) == top[0]),
        "argmax_in_top5": float(max(range(len(shifted)), key=shifted.__getitem__) in top),
        "kl": kl,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=160)
    parser.add_argument("--budgets", default="512,1024")
    parser.add_argument("--models", default="smollm2,llama3")
    args = parser.parse_args()
    conv = support_conversation(args.turns, seed=21)
    messages = conv["messages"]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            "smollm2": default_model_path(),
            "llama3": write_tiny_llama3(Path(tmp) / "tiny-llama3.gguf"),
        }
        for name in args.models.split(","):
            path = paths[name]
            for budget in (int(b) for b in args.budgets.split(",")):
                with Engine.load(path, n_ctx=budget + RESERVE, n_seq_max=2) as engine:
                    codec = engine.codec()
                    new = new_tokens_per_turn(codec, messages)
                    print(
                        f"\n### {name}, prompt budget {budget} (n_ctx {engine.n_ctx}), "
                        f"{args.turns} turns, {sum(new):,} conversation tokens "
                        f"({sum(new) / budget:.1f}x the budget)",
                        flush=True,
                    )
                    rows = [naive(path, messages, budget, codec, new)]
                    for eviction in ("recompute", "shift"):
                        rows.append(
                            chatctx_run(
                                engine,
                                messages,
                                budget,
                                eviction,
                                new,
                                f"sqlite:///{tmp}/{name}-{budget}.db",
                            )
                        )
                print(
                    "| policy | prefill amplification | cache hit ratio | TTFT p50 turns "
                    "1-10 ms | TTFT p50 last 10 ms | last/first | wall s |"
                )
                print("|---|---|---|---|---|---|---|")
                for r in rows:
                    print(
                        f"| {r['policy']} | {r['amplification']:.2f} | {r['hit']:.2f} | "
                        f"{r['ttft_first']:.1f} | {r['ttft_last']:.1f} | "
                        f"{r['ttft_ratio']:.2f} | {r['wall']:.1f} |",
                        flush=True,
                    )
            with Engine.load(path, n_ctx=2048, n_seq_max=2) as engine:
                acc = accuracy(engine, messages)
            print(
                f"\nshift accuracy, {name}: {acc['shifted_tokens']:.0f} tokens shifted; "
                f"max |logit diff| {acc['max_abs_diff']:.3f} (logits up to "
                f"{acc['max_abs_logit']:.1f}; re-evaluating the same prompt differs by "
                f"{acc['noise_floor']:.3f}); argmax same: {bool(acc['argmax_same'])}, "
                f"in recompute's top 5: {bool(acc['argmax_in_top5'])}; "
                f"KL(recompute || shift) {acc['kl']:.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
