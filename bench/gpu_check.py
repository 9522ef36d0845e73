"""GPU check (issue 11 point 6): one script, every figure, results as JSON. Run by hand.

    python bench/gpu_check.py --shape tiny --out DIR          # on the CPU, to prepare it
    python bench/gpu_check.py --shape 8b --out "$OUT"         # on a lent GPU (all layers)

Generates a random-weight Llama-3-shaped GGUF like the tiny test model
(``chatctx.testing.write_tiny_llama3``; the 8B shape uses f16 matrices shared by every layer,
which changes nothing about speed), then measures in one run:

A. ``plan --measure``: planned vs llama.cpp-allocated weights, KV (f16 and q8_0) and compute
   buffers, and the offload llama.cpp reports;
B. prefill and decode tok/s through chatctx (``Engine``), f16 and q8_0 KV;
C. the same prompt through a raw llama.cpp loop (the ``llama_cpp.llama_cpp`` ctypes API, no
   chatctx) with the same settings: chatctx's overhead = chatctx time / raw time - 1;
D. swap-in (restore a saved sequence state) vs re-prefill of the same tokens, raw API;
E. a teacher-forced replay of a synthetic support chat, ``shift`` vs ``recompute`` eviction:
   prefill amplification and TTFT of the last turns over the first.

Writes ``DIR/gpu_check.json`` and prints a markdown summary. The Llama 3 vocabulary must be in
the assets cache (``CHATCTX_ASSETS``, e.g. ``.cache/assets`` carried to the device).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as ll

from chatctx.backends.engine import Engine
from chatctx.backends.engine._native import supports_gpu_offload
from chatctx.backends.engine._native_info import measure_allocations, system_info
from chatctx.backends.engine._scheduler import PREFILL_CHUNK
from chatctx.model.cpus import default_threads
from chatctx.model.memory import KV_TYPE_IDS, ModelShape, parse_allocations, plan_memory
from chatctx.replay import ReplayConfig, Replayer, parse_logged, replay_all, summarize
from chatctx.settings import GenerationSettings
from chatctx.synthetic import support_conversation
from chatctx.testing import write_tiny_llama3

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_head_kv": 2, "n_ff": 256},
    "1b": {"n_embd": 2048, "n_layer": 16, "n_head": 32, "n_head_kv": 8, "n_ff": 8192},
    "8b": {"n_embd": 4096, "n_layer": 32, "n_head": 32, "n_head_kv": 8, "n_ff": 14336},
}
# Prompt, generation and replay sizes per shape: the tiny one must finish in minutes on 2 cores.
SIZES = {
    "tiny": {"prompt": 512, "decode": 32, "turns": 24, "budget": 512, "n_ctx": 2048},
    "1b": {"prompt": 2048, "decode": 128, "turns": 80, "budget": 2048, "n_ctx": 8192},
    "8b": {"prompt": 2048, "decode": 128, "turns": 80, "budget": 2048, "n_ctx": 8192},
}


REPEATS = 3  # timed prefills per path; the median is reported


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_model(shape: str, folder: Path) -> tuple[Path, float]:
    start = time.perf_counter()
    big = shape != "tiny"
    path = write_tiny_llama3(
        folder / f"llama3-{shape}-random.gguf",
        **SHAPES[shape],
        weight_type="f16" if big else "f32",
        share_layers=big,
    )
    return path, time.perf_counter() - start


def prompt_tokens(engine: Engine, n: int) -> list[int]:
    chat = support_conversation(200, seed=3)
    tokens = engine.prompt_tokens(chat["messages"], add_generation_prompt=False)
    while len(tokens) < n:
        tokens += tokens
    return tokens[:n]


def plan_check(model: Path, n_ctx: int, threads: int | None) -> list[dict[str, Any]]:
    shape = ModelShape.from_gguf(model)
    rows = []
    for kv in ("f16", "q8_0"):
        plan = plan_memory(
            shape, n_ctx=n_ctx, slots=1, type_k=kv, type_v=kv, gpu=supports_gpu_offload()
        )
        alloc = parse_allocations(
            measure_allocations(
                model,
                n_ctx=plan.n_ctx_param,
                n_seq_max=plan.n_seq_max,
                kv_unified=True,
                type_k=kv,
                type_v=kv,
                flash_attn=plan.flash_attn,
                n_threads=threads,
            )
        )
        rows.append(
            {
                "kv_type": kv,
                "kv_bytes": plan.kv_bytes,
                "measured_kv_bytes": alloc["kv_bytes"],
                "weights_bytes": plan.weights_bytes,
                "measured_weights_bytes": alloc["model_bytes"],
                "compute_bytes": plan.compute_bytes,
                "measured_compute_bytes": alloc["compute_bytes"],
                "offloaded": alloc["offloaded"],
                "offloadable": alloc["offloadable"],
                "buffers": alloc["buffers"],
            }
        )
    return rows


def chatctx_speed(
    model: Path, kv: str, n_ctx: int, prompt: int, decode: int, threads: int | None
) -> dict[str, Any]:
    with Engine.load(
        model, n_ctx=n_ctx, n_seq_max=2, type_k=kv, type_v=kv, n_threads=threads
    ) as engine:
        tokens = prompt_tokens(engine, prompt)
        # Warm-up with the whole prompt: a GPU loads the kernels of each batch shape on their
        # first use, which an 8-token warm-up leaves to the first timed prefill.
        engine.prefill(tokens)
        times = []
        for _ in range(REPEATS):
            engine.clear()
            start = time.perf_counter()
            engine.prefill(tokens)
            times.append(time.perf_counter() - start)
        prefill_s = statistics.median(times)
        settings = GenerationSettings(max_tokens=decode, temperature=0.0, repeat_penalty=1.0)
        start = time.perf_counter()
        result = engine.generate(tokens, settings=settings).wait()
        decode_s = time.perf_counter() - start
    generated = result.usage.generated_tokens
    return {
        "kv_type": kv,
        "prompt_tokens": len(tokens),
        "prefill_s": prefill_s,
        "prefill_tok_s": len(tokens) / prefill_s,
        "generated": generated,
        "decode_s": decode_s,
        "decode_tok_s": generated / decode_s if decode_s else None,
        "engine_decode_tok_s": result.timings.decode_tokens_per_s,
    }


def raw_loop(
    model: Path, n_ctx: int, tokens: list[int], decode: int, threads: int | None
) -> dict[str, Any]:
    """The same work through llama.cpp's C API only: prefill, greedy decode, state swap."""
    mparams = ll.llama_model_default_params()
    mparams.n_gpu_layers = 0x7FFFFFFF
    mptr = ll.llama_model_load_from_file(str(model).encode(), mparams)
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = 512
    cparams.n_ubatch = 512
    cparams.n_seq_max = 2
    cparams.kv_unified = True
    cparams.flash_attn_type = -1
    cparams.type_k = cparams.type_v = KV_TYPE_IDS["f16"]
    # The engine's own default when not given (physical cores within the CPU quota): the two
    # sides must run the same threads (os.cpu_count() counts hyperthreads too).
    n_threads = threads or default_threads()
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.no_perf = True
    ctx = ll.llama_init_from_model(mptr, cparams)
    vocab = ll.llama_model_get_vocab(mptr)
    batch = ll.llama_batch_init(512, 0, 1)
    sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_greedy())
    mem = ll.llama_get_memory(ctx)
    piece = ctypes.create_string_buffer(64)

    def prefill(seq: int, toks: list[int], step: int = 512) -> int:
        last = 0
        for offset in range(0, len(toks), step):
            chunk = toks[offset : offset + step]
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = offset + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 0
            batch.logits[len(chunk) - 1] = 1
            batch.n_tokens = len(chunk)
            if ll.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            last = len(chunk) - 1
        return last

    try:
        prefill(0, tokens)  # warm-up, as chatctx's
        by_step = {}
        for step in (512, PREFILL_CHUNK):  # llama.cpp's default batch; chatctx's prompt chunk
            times = []
            for _ in range(REPEATS):
                ll.llama_memory_clear(mem, True)
                start = time.perf_counter()
                index = prefill(0, tokens, step)
                ll.llama_synchronize(ctx)  # a GPU may still be computing the last chunk
                times.append(time.perf_counter() - start)
            by_step[step] = statistics.median(times)
        prefill_s = by_step[512]
        start = time.perf_counter()
        pos = len(tokens)
        for _ in range(decode):
            tok = ll.llama_sampler_sample(sampler, ctx, index)
            ll.llama_token_to_piece(vocab, tok, piece, len(piece), 0, False)
            batch.token[0] = tok
            batch.pos[0] = pos
            batch.n_seq_id[0] = 1
            batch.seq_id[0][0] = 0
            batch.logits[0] = 1
            batch.n_tokens = 1
            if ll.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            index = 0
            pos += 1
        decode_s = time.perf_counter() - start
        # D. swap-in vs re-prefill: save seq 0's cells, drop them, restore them
        ll.llama_memory_seq_rm(mem, 0, len(tokens), -1)
        size = ll.llama_state_seq_get_size(ctx, 0)
        state = (ctypes.c_uint8 * size)()
        start = time.perf_counter()
        ll.llama_state_seq_get_data(ctx, state, size, 0)
        save_s = time.perf_counter() - start
        ll.llama_memory_seq_rm(mem, 0, -1, -1)
        start = time.perf_counter()
        restored = ll.llama_state_seq_set_data(ctx, state, size, 0)
        restore_s = time.perf_counter() - start
        if not restored:
            raise RuntimeError("llama_state_seq_set_data restored nothing")
    finally:
        ll.llama_sampler_free(sampler)
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        ll.llama_model_free(mptr)
    return {
        "prompt_tokens": len(tokens),
        "prefill_s": prefill_s,
        "prefill_tok_s": len(tokens) / prefill_s,
        "prefill_chunked_tok_s": len(tokens) / by_step[PREFILL_CHUNK],
        "decode_s": decode_s,
        "decode_tok_s": decode / decode_s,
        "state_bytes": size,
        "save_ms": save_s * 1000,
        "restore_ms": restore_s * 1000,
        "reprefill_over_restore": prefill_s / restore_s if restore_s else None,
    }


def replay_check(model: Path, turns: int, budget: int, threads: int | None) -> list[dict[str, Any]]:
    conversation = parse_logged(json.dumps(support_conversation(turns, seed=11)), line=1)
    rows = []
    for eviction in ("shift", "recompute"):
        config = ReplayConfig(mode="teacher", budget=budget, eviction=eviction)
        with (
            Engine.load(
                model, n_ctx=budget + config.reserve_tokens, n_seq_max=2, n_threads=threads
            ) as engine,
            Replayer(config, engine=engine) as replayer,
        ):
            reports = replay_all(replayer, [conversation])
        turns_ = [t for r in reports for t in r.turns]
        totals = summarize(turns_, reports)
        ttfts = [t.ttft_ms for t in turns_ if t.ttft_ms is not None]
        k = max(1, len(ttfts) // 10)
        rows.append(
            {
                "eviction": eviction,
                "turns": len(turns_),
                "evictions": totals["evictions"],
                "prefill_amplification": totals["prefill_amplification"],
                "ttft_first_ms": statistics.mean(ttfts[:k]),
                "ttft_last_ms": statistics.mean(ttfts[-k:]),
                "ttft_last_over_first": statistics.mean(ttfts[-k:]) / statistics.mean(ttfts[:k]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny")
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-replay", action="store_true")
    args = parser.parse_args()
    sizes = SIZES[args.shape]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "shape": args.shape,
        "dims": SHAPES[args.shape],
        "sizes": sizes,
        "gpu_offload": supports_gpu_offload(),
        "system_info": system_info(),
        "machine": platform.platform(),
    }

    def save() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))

    log(f"generating the {args.shape} model ...")
    model, gen_s = make_model(args.shape, args.out)
    results["model"] = {"path": model.name, "bytes": model.stat().st_size, "gen_s": gen_s}
    save()
    log("A. plan --measure ...")
    results["plan"] = plan_check(model, sizes["n_ctx"], args.threads)
    save()
    log("B. chatctx prefill/decode ...")
    results["chatctx"] = [
        chatctx_speed(model, kv, sizes["n_ctx"], sizes["prompt"], sizes["decode"], args.threads)
        for kv in ("f16", "q8_0")
    ]
    save()
    log("C/D. raw llama.cpp loop, swap-in ...")
    with Engine.load(model, n_ctx=256) as engine:
        tokens = prompt_tokens(engine, sizes["prompt"])
    raw = raw_loop(model, sizes["n_ctx"], tokens, sizes["decode"], args.threads)
    ours = results["chatctx"][0]
    raw["chatctx_prefill_overhead"] = ours["prefill_s"] / raw["prefill_s"] - 1
    raw["chatctx_decode_overhead"] = (
        (ours["decode_s"] / ours["generated"]) / (raw["decode_s"] / sizes["decode"]) - 1
        if ours["generated"]
        else None
    )
    results["raw"] = raw
    save()
    if not args.skip_replay:
        log("E. replay shift vs recompute ...")
        results["replay"] = replay_check(model, sizes["turns"], sizes["budget"], args.threads)
        save()
    print_summary(results)


def print_summary(r: dict[str, Any]) -> None:
    mib = 2**20
    print(
        f"\n## GPU check, {r['shape']} shape ({r['model']['bytes'] / mib:,.0f} MiB GGUF), "
        f"GPU offload {'yes' if r['gpu_offload'] else 'no'}\n"
    )
    print(
        "| KV | planned KV MiB | llama.cpp KV MiB | weights MiB (plan / llama.cpp) | "
        "compute MiB (plan / llama.cpp) | offloaded |"
    )
    print("|---|---|---|---|---|---|")
    for p in r["plan"]:
        print(
            f"| {p['kv_type']} | {p['kv_bytes'] / mib:.1f} | {p['measured_kv_bytes'] / mib:.1f} | "
            f"{p['weights_bytes'] / mib:.1f} / {p['measured_weights_bytes'] / mib:.1f} | "
            f"{p['compute_bytes'] / mib:.1f} / {p['measured_compute_bytes'] / mib:.1f} | "
            f"{p['offloaded'] if p['offloaded'] is not None else '-'}"
            f"/{p['offloadable'] if p['offloadable'] is not None else '-'} |"
        )
    print("\n| path | KV | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|")
    for c in r["chatctx"]:
        print(
            f"| chatctx | {c['kv_type']} | {c['prefill_tok_s']:.0f} | "
            f"{c['decode_tok_s'] or 0:.1f} |"
        )
    raw = r["raw"]
    print(f"| raw llama.cpp | f16 | {raw['prefill_tok_s']:.0f} | {raw['decode_tok_s']:.1f} |")
    print(
        f"| raw llama.cpp, {PREFILL_CHUNK}-token chunks | f16 | "
        f"{raw['prefill_chunked_tok_s']:.0f} | - |"
    )
    print(
        f"\nchatctx overhead vs raw: prefill {raw['chatctx_prefill_overhead']:+.1%}, decode "
        f"{(raw['chatctx_decode_overhead'] or 0):+.1%} (target <= 5%). Swap-in of "
        f"{raw['prompt_tokens']} tokens ({raw['state_bytes'] / mib:.1f} MiB): restore "
        f"{raw['restore_ms']:.1f} ms vs re-prefill {raw['prefill_s'] * 1000:.0f} ms "
        f"({raw['reprefill_over_restore']:.0f}x)."
    )
    if "replay" in r:
        print(
            "\n| eviction | turns | evictions | prefill amplification | TTFT first ms | "
            "TTFT last ms | last/first |"
        )
        print("|---|---|---|---|---|---|---|")
        for e in r["replay"]:
            print(
                f"| {e['eviction']} | {e['turns']} | {e['evictions']} | "
                f"{e['prefill_amplification']:.2f} | {e['ttft_first_ms']:.0f} | "
                f"{e['ttft_last_ms']:.0f} | {e['ttft_last_over_first']:.2f} |"
            )


if __name__ == "__main__":
    main()
