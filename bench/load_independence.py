"""Does a reply depend on who else is being served? Chunk shapes, batch company, cache layout.

Part 1 asks llama.cpp directly (SmolLM2, this CPU build): the largest difference in the
next-token logits of one 300-token prompt evaluated in different ways, against one batch,
and of a streaming token decoded alone or beside other sequences' tokens, for the split and
the unified KV cache.

Part 2 serves 12 customers x 6 turns on 4 slots (greedy), each customer alone on a fresh
engine and all at once from 12 threads, and counts the replies that differ, per budget and
KV layout.

    .venv/bin/python bench/load_independence.py [--part 1|2] [--budgets 160,256,512]
        [--layouts split,unified]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from chatctx.backends.engine import Engine
from chatctx.backends.engine._native import NativeContext, NativeModel
from chatctx.model.paths import default_model_path
from chatctx.testing import serve_customers, support_customers

ROOT = Path(__file__).resolve().parent.parent
Part = tuple[int, list[int], int, bool]  # sequence, tokens, first position, wants logits


def part1() -> None:
    model = NativeModel(default_model_path(), n_gpu_layers=0)
    tokens = model.tokenize(
        (ROOT / "README.md").read_text(), add_special=False, parse_special=False
    )
    prompt, other = tokens[:300], tokens[1000:1400]
    for unified in (False, True):

        def run(
            steps: list[list[tuple[int, list[int], int, bool]]], unified: bool = unified
        ) -> Any:
            ctx = NativeContext(
                model, n_ctx=5 * 1024, n_ctx_seq=1024, n_batch=512, n_ubatch=512, n_seq_max=5,
                kv_unified=unified, flash_attn=None, type_k="f16", type_v="f16", n_threads=2,
            )  # fmt: skip
            out = None
            try:
                for step in steps:
                    for (seq, _, _, want), i in zip(step, ctx.decode_many(step), strict=True):
                        if seq == 0 and want:
                            out = np.array(ctx.logits(i))
            finally:
                ctx.close()
            return out

        def cut(sizes: list[int]) -> list[list[Part]]:
            steps, at = [], 0
            for n in sizes:
                steps.append([(0, prompt[at : at + n], at, at + n == len(prompt))])
                at += n
            return steps

        one = run(cut([300]))
        rows = {
            "256+44": cut([256, 44]),
            "299+1": cut([299, 1]),
            "9x32+12": cut([32] * 9 + [12]),
            "200+100": cut([200, 100]),
            "128+128+44": cut([128, 128, 44]),
        }
        base = run(cut([256, 44]))
        company = run(
            [
                [(0, prompt[:256], 0, False), (1, other[:200], 0, False)],
                [(0, prompt[256:], 256, True)],
            ]
        )
        cached = run([[(1, other, 0, False)], *cut([256, 44])])
        layout = "unified" if unified else "split"
        print(f"\n{layout} KV cache: max |logit difference| against one batch of 300")
        for name, steps in rows.items():
            print(f"  {name:>10}: {np.max(np.abs(run(steps) - one)):.3f}")
        print(f"  256+44, the first chunk beside another sequence's 200 tokens: "
              f"{np.max(np.abs(company - base)):.3f}")  # fmt: skip
        print(f"  256+44 alone, after another sequence's 400 cells: "
              f"{np.max(np.abs(cached - base)):.3f}")  # fmt: skip
        stream_alone = run([*cut([256, 44]), [(0, [prompt[5]], 300, True)]])
        stream_beside = run(
            [*cut([256, 44]), [(1, [other[3]], 0, True), (0, [prompt[5]], 300, True)]]
        )
        print(f"  a streaming token beside another sequence's token: "
              f"{np.max(np.abs(stream_beside - stream_alone)):.3f}")  # fmt: skip
        others = [(seq, other[100 * seq : 100 * seq + 50], 0, False) for seq in (1, 2, 3)]
        beside_three = run(
            [
                *cut([256, 44]),
                others,
                [(seq, [other[seq]], 50, True) for seq in (1, 2, 3)]
                + [(0, [prompt[5]], 300, True)],
            ]
        )
        print(f"  a streaming token beside three other sequences' tokens: "
              f"{np.max(np.abs(beside_three - stream_alone)):.3f}")  # fmt: skip


def part2(budgets: list[int], layouts: list[str]) -> None:
    customers = support_customers(12, 6)
    settings = {"max_tokens": 24, "temperature": 0.0}
    print(
        "\nreplies that differ, 12 customers x 6 turns on 4 slots: each customer alone on a "
        "fresh engine vs all at once from 12 threads"
    )

    def engine(unified: bool) -> Engine:
        return Engine.load(default_model_path(), n_ctx=1024, slots=4, kv_unified=unified)

    for layout in layouts:
        unified = layout == "unified"
        for budget in budgets:
            context = {"budget": budget}
            alone: dict[tuple[str, int], str] = {}
            for cid, messages in customers.items():
                with engine(unified) as e:
                    alone |= serve_customers(
                        e, {cid: messages}, together=False, settings=settings, context=context
                    )
            with engine(unified) as e:
                together = serve_customers(
                    e, customers, together=True, settings=settings, context=context
                )
            differ = sum(alone[k] != together[k] for k in alone)
            print(f"  {layout:>7} KV, budget {budget}: {differ} of {len(alone)}", flush=True)


def cpu() -> str:
    """This CPU's model name and the vector extensions llama.cpp's CPU kernels choose by."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown CPU")  # fmt: skip
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8")
    return f"{name} ({' '.join(f for f in wanted if f in flags) or 'no AVX2'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["1", "2", "both"], default="both")
    parser.add_argument("--budgets", default="160,256,512")
    parser.add_argument("--layouts", default="split,unified", help="KV layouts for part 2")
    args = parser.parse_args()
    print(f"CPU: {cpu()}")
    if args.part in ("1", "both"):
        part1()
    if args.part in ("2", "both"):
        part2([int(b) for b in args.budgets.split(",")], args.layouts.split(","))


if __name__ == "__main__":
    main()
