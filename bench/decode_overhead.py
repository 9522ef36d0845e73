"""The in-process decode hot path: time per generated token outside ``llama_decode``.

chatctx's engine (scheduler thread, sampler, detokenizer, the reader's queue) against a raw
llama.cpp loop through the same ctypes API (greedy sampling, one piece per token), on the
same random-weight Llama 3 model, interleaved round by round. ``llama_decode`` is timed on
both sides and taken out, so what is left is the per-token work around it: on a fast GPU
model that is what separates chatctx's decode speed from llama.cpp's.

    .venv/bin/python bench/decode_overhead.py [--shape tiny|1b] [--tokens 512] [--rounds 5]

The ``tiny`` shape runs on the CPU in about a minute; on a lent GPU run ``bench/gpu_check.py``
for the speeds themselves.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as ll

from chatctx.backends.engine import Engine
from chatctx.settings import GenerationSettings
from chatctx.synthetic import support_conversation
from chatctx.testing import write_tiny_llama3

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "1b": {"n_embd": 2048, "n_layer": 16, "n_head": 32, "n_head_kv": 8, "n_ff": 8192},
}
_spent = [0.0]
_decode = ll.llama_decode


def _timed_decode(ctx: Any, batch: Any) -> int:
    start = time.perf_counter()
    try:
        return int(_decode(ctx, batch))
    finally:
        _spent[0] += time.perf_counter() - start


def raw(model: Path, prompt: list[int], tokens: int, threads: int) -> float:
    """Microseconds per token outside llama_decode in a plain ctypes loop."""
    mparams = ll.llama_model_default_params()
    mparams.n_gpu_layers = 0x7FFFFFFF
    mptr = ll.llama_model_load_from_file(str(model).encode(), mparams)
    cparams = ll.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 4096, 512, 512, 2
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = ll.llama_init_from_model(mptr, cparams)
    vocab = ll.llama_model_get_vocab(mptr)
    batch = ll.llama_batch_init(512, 0, 1)
    sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_greedy())
    piece = ctypes.create_string_buffer(64)
    try:
        for i, token in enumerate(prompt):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 0
        batch.logits[len(prompt) - 1] = 1
        batch.n_tokens = len(prompt)
        _decode(ctx, batch)
        index, pos = len(prompt) - 1, len(prompt)
        _spent[0] = 0.0
        start = time.perf_counter()
        for _ in range(tokens):
            token = ll.llama_sampler_sample(sampler, ctx, index)
            ll.llama_vocab_is_eog(vocab, token)
            ll.llama_token_to_piece(vocab, token, piece, len(piece), 0, False)
            batch.token[0], batch.pos[0], batch.n_seq_id[0] = token, pos, 1
            batch.seq_id[0][0], batch.logits[0], batch.n_tokens = 0, 1, 1
            ll.llama_decode(ctx, batch)
            index, pos = 0, pos + 1
        wall = time.perf_counter() - start
    finally:
        ll.llama_sampler_free(sampler)
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        ll.llama_model_free(mptr)
    return (wall - _spent[0]) / tokens * 1e6


def ours(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """Microseconds per token outside llama_decode through ``Engine.generate``, and the
    decode's own microseconds per token."""
    engine.clear()
    engine.prefill(prompt)
    _spent[0] = 0.0
    settings = GenerationSettings(max_tokens=tokens, temperature=0.0, repeat_penalty=1.0)
    start = time.perf_counter()
    result = engine.generate(prompt, settings=settings).wait()
    wall = time.perf_counter() - start
    n = max(1, result.usage.generated_tokens)
    return (wall - _spent[0]) / n * 1e6, _spent[0] / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ll.llama_decode = _timed_decode  # both sides call it through the module
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / f"{args.shape}.gguf"
        big = args.shape != "tiny"  # as gpu_check.py: f16 matrices shared by every layer
        write_tiny_llama3(model, **SHAPES[args.shape], weight_type="f16" if big else "f32",
                          share_layers=big)  # fmt: skip
        ours_us, raw_us, decode_us = [], [], []
        with Engine.load(model, n_ctx=4096, n_seq_max=2, n_threads=args.threads) as engine:
            chat = support_conversation(40, seed=3)
            prompt = engine.prompt_tokens(chat["messages"])[:64]
            for _ in range(args.rounds):
                outside, inside = ours(engine, prompt, args.tokens)
                ours_us.append(outside)
                decode_us.append(inside)
                raw_us.append(raw(model, prompt, args.tokens, args.threads))
    a, b, d = (statistics.median(x) for x in (ours_us, raw_us, decode_us))
    print(
        f"shape {args.shape}, {args.tokens} tokens, {args.rounds} rounds, {args.threads} thread(s)"
    )
    print(f"llama_decode per token: {d:.0f} us")
    print(f"outside llama_decode per token: chatctx {a:.0f} us, raw {b:.0f} us "
          f"(rounds: {[round(x) for x in ours_us]} / {[round(x) for x in raw_us]})")  # fmt: skip
    share = (a - b) / (d + b) * 100
    print(f"chatctx's excess: {a - b:.0f} us per token = {share:.1f}% of a raw token (medians)")
    # The least of each side is the steadier figure on a shared machine: noise only adds.
    best = min(ours_us) - min(raw_us)
    least = f"chatctx {min(ours_us):.0f} us, raw {min(raw_us):.0f} us"
    print(f"best rounds: {least}, excess {best:.0f} us")


if __name__ == "__main__":
    main()
