"""KV cache types (issue 11): f16 vs q8_0 vs q4_0 on a long support chat. Run by hand.

    .venv/bin/python bench/kv_types_bench.py [--model GGUF] [--turns 60] [--budget 1024]
                                             [--decode 64] [--json]

For each KV type, in one run, on SmolLM2 (or ``--model``):

- KV memory: what llama.cpp allocated (its "KV buffer size" log line) next to the planner's
  figure for the same context;
- prefill tok/s: a teacher-forced replay of a synthetic support chat (``chatctx.synthetic``,
  ``--turns`` user turns) through ``chatctx.replay`` at ``--budget``: evaluated prompt tokens
  over the summed time to first token;
- decode tok/s: ``--decode`` greedy tokens after a 1,000-token prompt;
- next-token KL divergence vs f16: the same prompts (prefixes of the chat of 128 to ~1,000
  tokens) evaluated from an empty cache, full logits compared: mean and max
  KL(p_f16 || p_type) in nats, and how often the top token agrees.

Prints a markdown table (``--json`` for the figures).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from chatctx.backends.engine import Engine
from chatctx.backends.engine._native import NativeContext, NativeModel
from chatctx.backends.engine._native_info import capture_llama_log
from chatctx.model.memory import ModelShape, parse_allocations, plan_memory
from chatctx.model.paths import default_model_path
from chatctx.replay import ReplayConfig, Replayer, parse_logged, replay_all
from chatctx.synthetic import support_conversation

TYPES = ("f16", "q8_0", "q4_0")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - math.log(float(np.exp(shifted).sum()))


def replay_prefill(
    model: Path, kv: str, conversation: Any, budget: int, threads: int | None
) -> dict[str, Any]:
    config = ReplayConfig(mode="teacher", budget=budget)
    with capture_llama_log() as lines:
        engine = Engine.load(
            model,
            n_ctx=budget + config.reserve_tokens,
            n_seq_max=2,
            type_k=kv,
            type_v=kv,
            n_threads=threads,
        )
    with engine, Replayer(config, engine=engine) as replayer:
        reports = replay_all(replayer, [conversation])
    turns = [t for r in reports for t in r.turns if t.ttft_ms is not None]
    evaluated = sum(t.evaluated_tokens for t in turns)
    seconds = sum(t.ttft_ms or 0.0 for t in turns) / 1000
    planned = plan_memory(
        ModelShape.from_gguf(model), n_ctx=budget + config.reserve_tokens, type_k=kv, type_v=kv
    )
    return {
        "kv_bytes_measured": parse_allocations(lines)["kv_bytes"],
        "kv_bytes_planned": planned.kv_bytes,
        "replay_turns": len(turns),
        "prefill_tokens": evaluated,
        "prefill_tok_s": evaluated / seconds if seconds else None,
    }


def logits_and_decode(
    model: NativeModel, kv: str, prompts: list[list[int]], decode: int, threads: int | None
) -> dict[str, Any]:
    n_ctx = max(len(p) for p in prompts) + decode + 8
    ctx = NativeContext(
        model,
        n_ctx=n_ctx,
        n_batch=512,
        n_ubatch=512,
        n_seq_max=1,
        kv_unified=True,
        flash_attn=None,
        type_k=kv,
        type_v=kv,
        n_threads=threads,
    )
    try:
        rows = []
        for prompt in prompts:
            ctx.clear()
            index = ctx.decode(0, prompt, 0, want_last_logits=True)
            rows.append(np.asarray(ctx.logits(index), dtype=np.float64))
        # decode: greedy continuation of the longest prompt
        ctx.clear()
        prompt = prompts[-1]
        index = ctx.decode(0, prompt, 0, want_last_logits=True)
        token = int(np.argmax(ctx.logits(index)))
        start = time.perf_counter()
        for i in range(decode):
            index = ctx.decode(0, [token], len(prompt) + i, want_last_logits=True)
            token = int(np.argmax(ctx.logits(index)))
        decode_s = time.perf_counter() - start
    finally:
        ctx.close()
    return {"logits": rows, "decode_tok_s": decode / decode_s if decode_s else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_path = args.model or default_model_path()
    chat = support_conversation(args.turns, seed=7)
    conversation = parse_logged(json.dumps(chat), line=1)

    with Engine.load(model_path, n_ctx=256) as engine:
        tokens = engine.prompt_tokens(chat["messages"], add_generation_prompt=False)
    lengths = [n for n in (128, 256, 512, 768, 1000) if n < len(tokens)]
    prompts = [tokens[:n] for n in lengths]

    results: dict[str, dict[str, Any]] = {}
    model = NativeModel(model_path)
    try:
        for kv in TYPES:
            print(f"{kv}: logits and decode ...", file=sys.stderr, flush=True)
            results[kv] = logits_and_decode(model, kv, prompts, args.decode, args.threads)
    finally:
        model.close()
    for kv in TYPES:
        print(f"{kv}: replay ...", file=sys.stderr, flush=True)
        results[kv] |= replay_prefill(model_path, kv, conversation, args.budget, args.threads)

    base = [log_softmax(row) for row in results["f16"]["logits"]]
    for kv in TYPES:
        rows = [log_softmax(row) for row in results[kv].pop("logits")]
        kls = [float(np.sum(np.exp(p) * (p - q))) for p, q in zip(base, rows, strict=True)]
        agree = [int(np.argmax(p) == np.argmax(q)) for p, q in zip(base, rows, strict=True)]
        results[kv] |= {
            "kl_mean": sum(kls) / len(kls),
            "kl_max": max(kls),
            "top1_agreement": sum(agree) / len(agree),
        }

    if args.json:
        print(json.dumps({"prompt_lengths": lengths, "results": results}, indent=2))
        return
    f16 = results["f16"]
    print(
        f"\nKV cache types, {model_path.name}: teacher-forced replay of a {args.turns}-turn "
        f"synthetic support chat at budget {args.budget}; decode {args.decode} greedy tokens "
        f"after {lengths[-1]} prompt tokens; KL over {len(lengths)} prompts of "
        f"{lengths[0]}-{lengths[-1]} tokens\n"
    )
    print(
        "| KV type | KV MiB (llama.cpp) | KV MiB (planned) | vs f16 | prefill tok/s | "
        "decode tok/s | KL mean (nats) | KL max | top-1 agreement |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kv in TYPES:
        r = results[kv]
        print(
            f"| {kv} | {r['kv_bytes_measured'] / 2**20:.2f} | {r['kv_bytes_planned'] / 2**20:.2f} "
            f"| {r['kv_bytes_measured'] / f16['kv_bytes_measured']:.2f} "
            f"| {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {r['kl_mean']:.5f} "
            f"| {r['kl_max']:.5f} | {r['top1_agreement']:.2f} |"
        )


if __name__ == "__main__":
    main()
