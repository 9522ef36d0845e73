"""Many customers on one model: slot pool, KV swap and continuous batching, in one run.

    .venv/bin/python bench/slots_bench.py [--quick] [--json] [--model GGUF] [--n-threads 1]

1. **Swap-in vs re-prefill.** ``--conversations`` (32) synthetic support chats of ``--turns``
   (10) teacher-forced turns (``record_turn``), served round-robin on 4 slots: from its second
   turn on, every conversation finds its slot taken and is restored from its swapped state.
   Each message is cut to its first sentence (``--full-messages`` keeps them whole, about
   twice the tokens and the time). Once with the default RAM budget, once with
   ``swap_ram_mb=0`` (every state goes to files under ``swap_dir``). Oracle for the
   re-prefill a swap saves: right after the turn, the very tokens that were swapped in are
   prefilled from scratch on the engine's reserved (empty) sequence, same engine, same KV
   layout (``Engine.prefill``, its ``prefill_ms``), for one conversation in
   ``--oracle-every`` (the RAM and disk runs sample different ones). Ratios come from those
   matched pairs. The swap-out of the slot's previous owner also runs inside the lease, so
   it is reported too.
2. **Aggregate throughput.** 8 streams (threads, each its own conversation, greedy, a fixed
   prompt set, ``--max-tokens`` 64) on an engine with ``slots=8``: generated tokens / wall
   time, against the same 8 requests one after another on the same engine.
3. **TTFT under load.** TTFT from the request (``reply.timings.ttft_ms``: lease, context build
   and prefill included) of a new conversation's first message while 7 other conversations
   stream replies without pause (length limits ``--max-tokens`` + 0, 8, ... 48, so that their
   turns do not end in lock-step), against the same message with the engine otherwise idle;
   with the median of each part of the TTFT (slot, build, store, engine).

Ratios are measured within one run; the 1-minute load average is printed next to each part.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from chatctx import ChatSession, Engine
from chatctx.store import Store
from chatctx.synthetic import support_conversation

SYSTEM = "You are a helpful assistant. Answer in full sentences."
PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle gear system works.",
    "Describe a busy market in a coastal town in the morning.",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain step by step how to bake a loaf of bread at home.",
    "Tell the history of a small village that grew into a city.",
    "Describe how a thunderstorm forms, from the first clouds to the rain.",
    "Write a story about a robot who learns to paint.",
]
PROBE = "Hello! I just bought a router and the lights are blinking orange. What should I do?"
FOLLOW_UPS = ["Go on, tell me more.", "Can you explain that part again?", "What happens next?"]


def first_sentence(text: str) -> str:
    match = re.match(r".+?[.!?](\s|$)", text)
    return match.group(0).strip() if match else text


def scripts_for(args: argparse.Namespace, where: str) -> dict[str, list[dict[str, str]]]:
    """The same synthetic support chats for both runs (keyed by run, so files never clash)."""
    scripts = {}
    for n in range(args.conversations):
        messages = support_conversation(args.turns, seed=100 + n)["messages"]
        if not args.full_messages:
            messages = messages[:1] + [
                {"role": m["role"], "content": first_sentence(m["content"])} for m in messages[1:]
            ]
        scripts[f"{where}-{n}"] = messages
    return scripts


def load() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def p95(values: list[float]) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


@contextmanager
def loaded(model: str | None, tmp: Path, tag: str, **options: Any) -> Iterator[Engine]:
    """An engine whose swap files and slot table live under ``tmp`` (never $CHATCTX_HOME)."""
    with Engine.load(
        model, swap_dir=tmp / f"kv-{tag}", slot_table=tmp / f"slots-{tag}.json", **options
    ) as engine:
        yield engine


# 1. swap-in vs re-prefill ---------------------------------------------------------------------


def swap_part(args: argparse.Namespace, tmp: Path, where: str) -> dict[str, Any]:
    options: dict[str, Any] = {"n_ctx": 1024, "slots": 4, "n_threads": args.n_threads}
    if where == "disk":
        options["swap_ram_mb"] = 0
    elif args.ram_mb is not None:
        options["swap_ram_mb"] = args.ram_mb
    scripts = scripts_for(args, where)
    sample = 0 if where == "ram" else args.oracle_every // 2
    load_start = load()
    pairs: list[dict[str, Any]] = []  # swap-ins with their re-prefill oracle
    swaps: list[dict[str, Any]] = []  # every swap-in
    swap_outs: list[float] = []
    short_reuse = 0  # swap-ins after which the turn did not reuse all restored tokens
    with (
        loaded(args.model, tmp, where, **options) as engine,
        Store(f"sqlite:///{tmp / f'swap-{where}.db'}") as store,
        ExitStack() as stack,
    ):
        spare = engine.spare_seq
        assert spare is not None
        sessions = {
            cid: stack.enter_context(
                ChatSession.open(
                    store,
                    conversation_id=cid,
                    model=engine,
                    system_prompt=messages[0]["content"],
                    settings={"max_tokens": 64, "temperature": 0.0},
                    context={"summarizer": "extractive", "recall": False},
                )
            )
            for cid, messages in scripts.items()
        }
        held: dict[str, tuple[int, ...]] = {}  # what each conversation left in its slot
        t0 = time.perf_counter()
        for turn in range(args.turns):
            for n, (cid, messages) in enumerate(scripts.items()):
                user, answer = messages[1 + 2 * turn], messages[2 + 2 * turn]
                before = engine.slot_table()["counters"]
                stored = sessions[cid].record_turn(user["content"], answer["content"]).turn
                assert stored is not None and stored.slot is not None
                after = engine.slot_table()["counters"]
                swap_out_ms = 0.0
                if after["swap_out"] > before["swap_out"]:  # inside this turn's lease
                    swap_out_ms = after["swap_out_ms"] - before["swap_out_ms"]
                    swap_outs.append(swap_out_ms)
                if stored.swap_in is not None:
                    assert stored.swap_in_ms is not None
                    restored = held[cid]
                    if stored.reused_tokens < len(restored):
                        short_reuse += 1
                    row = {
                        "where": stored.swap_in,
                        "tokens": len(restored),
                        "bytes": stored.swap_in_bytes,
                        "swap_in_ms": stored.swap_in_ms,
                        "lease_ms": stored.swap_in_ms + swap_out_ms,
                    }
                    swaps.append(row)
                    if n % args.oracle_every == sample:
                        result = engine.prefill(restored, seq_id=spare)
                        engine.clear(spare)
                        assert result.usage.evaluated_tokens == len(restored)
                        pairs.append(row | {"reprefill_ms": result.timings.prefill_ms})
                held[cid] = engine.cached_tokens(stored.slot)
        wall = time.perf_counter() - t0
        counters = engine.slot_table()["counters"]
        ram_budget_mb = engine.config.swap_ram_mb
    hits = [p for p in pairs if p["where"] == where]  # the RAM run may also hit the disk
    figures: dict[str, Any] = {
        "where": where,
        "ram_budget_mb": ram_budget_mb,
        "swap_ins": len(swaps),
        "swap_ins_by_where": {w: sum(1 for s in swaps if s["where"] == w) for w in ("ram", "disk")},
        "pairs": len(hits),
        "all_swap_in_ms_median": statistics.median(s["swap_in_ms"] for s in swaps),
        "all_swap_in_ms_p95": p95([s["swap_in_ms"] for s in swaps]),
        "swap_out_ms_median": statistics.median(swap_outs),
        "swap_out_ms_p95": p95(swap_outs),
        "short_reuse": short_reuse,
        "reprefill_counter": counters["reprefill"],
        "spill_to_disk": counters["spill_to_disk"],
        "wall_s": wall,
        "load": [load_start, load()],
    }
    if hits:
        swap_in = [p["swap_in_ms"] for p in hits]
        reprefill = [p["reprefill_ms"] for p in hits]
        lease = [p["lease_ms"] for p in hits]
        figures |= {
            "tokens_median": statistics.median(p["tokens"] for p in hits),
            "bytes_median": statistics.median(p["bytes"] for p in hits),
            "swap_in_ms_median": statistics.median(swap_in),
            "swap_in_ms_p95": p95(swap_in),
            "reprefill_ms_median": statistics.median(reprefill),
            "reprefill_ms_p95": p95(reprefill),
            "ratio_median": statistics.median(reprefill) / statistics.median(swap_in),
            "ratio_p95": p95(reprefill) / p95(swap_in),
            "ratio_pairs_min": min(r / s for r, s in zip(reprefill, swap_in, strict=True)),
            "lease_ms_median": statistics.median(lease),
            "ratio_lease_median": statistics.median(reprefill) / statistics.median(lease),
        }
    return figures


# 2. aggregate throughput -------------------------------------------------------------------


def open_chats(
    engine: Engine, store: Store, stack: ExitStack, tag: str, max_tokens: list[int]
) -> list[ChatSession]:
    """One conversation per entry of ``max_tokens`` (its replies' length limit)."""
    return [
        stack.enter_context(
            ChatSession.open(
                store,
                conversation_id=f"{tag}-{i}",
                model=engine,
                system_prompt=SYSTEM,
                settings={"max_tokens": limit, "temperature": 0.0, "seed": 1},
                context={"summarizer": "extractive", "recall": False},
            )
        )
        for i, limit in enumerate(max_tokens)
    ]


def serve_sequential(engine: Engine, store: Store, tag: str, max_tokens: int) -> tuple[int, float]:
    engine.clear()  # every slot free: no swap-out in the measured time
    with ExitStack() as stack:
        chats = open_chats(engine, store, stack, tag, [max_tokens] * len(PROMPTS))
        t0 = time.perf_counter()
        tokens = 0
        for chat, prompt in zip(chats, PROMPTS, strict=True):
            tokens += chat.send(prompt).usage.generated_tokens
        return tokens, time.perf_counter() - t0


def serve_concurrent(engine: Engine, store: Store, tag: str, max_tokens: int) -> tuple[int, float]:
    engine.clear()
    with ExitStack() as stack:
        chats = open_chats(engine, store, stack, tag, [max_tokens] * len(PROMPTS))
        go = threading.Event()
        tokens = [0] * len(chats)
        errors: list[BaseException] = []

        def customer(i: int) -> None:
            go.wait()
            try:
                tokens[i] = chats[i].send(PROMPTS[i]).usage.generated_tokens
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=customer, args=(i,)) for i in range(len(chats))]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        go.set()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return sum(tokens), wall


def throughput_part(args: argparse.Namespace, engine: Engine, store: Store) -> dict[str, Any]:
    load_start = load()
    runs: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    tokens = dict.fromkeys(runs, 0)
    walls = dict.fromkeys(runs, 0.0)
    steps = dict.fromkeys(runs, 0)
    sequences = dict.fromkeys(runs, 0)
    serve = {"sequential": serve_sequential, "concurrent": serve_concurrent}
    for r in range(args.repeats):  # alternate, so that drift in the machine's load hits both
        for kind in runs:
            counters = engine.batch_counters  # live: read the numbers before and after
            steps_before, sequences_before = counters.steps, counters.sequences
            n, wall = serve[kind](engine, store, f"{kind}{r}", args.max_tokens)
            runs[kind].append(n / wall)
            tokens[kind] += n
            walls[kind] += wall
            steps[kind] += counters.steps - steps_before
            sequences[kind] += counters.sequences - sequences_before
    seq, conc = statistics.median(runs["sequential"]), statistics.median(runs["concurrent"])
    # Wall time per llama_decode step (sampling and Python included): what a step of 8
    # sequences costs against a step of one bounds what batching can gain.
    ms_step = {kind: walls[kind] * 1000 / max(1, steps[kind]) for kind in runs}
    return {
        "streams": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "generated_tokens": tokens,
        "sequential_tok_s": seq,
        "concurrent_tok_s": conc,
        "sequential_tok_s_runs": runs["sequential"],
        "concurrent_tok_s_runs": runs["concurrent"],
        "ratio": conc / seq,
        "sequences_per_step": {kind: sequences[kind] / max(1, steps[kind]) for kind in runs},
        "ms_per_step": ms_step,
        "step_cost_ratio": ms_step["concurrent"] / ms_step["sequential"],
        "batch_max": engine.batch_counters.max_sequences,
        "load": [load_start, load()],
    }


# 3. TTFT under load ------------------------------------------------------------------------


PARTS = ("slot_ms", "build_ms", "store_ms", "engine_ttft_ms")  # what a TTFT is made of


def probe(engine: Engine, store: Store, cid: str) -> dict[str, float]:
    """TTFT of a new conversation's first message and its parts; the slot is freed after."""
    with ChatSession.open(
        store,
        conversation_id=cid,
        model=engine,
        system_prompt=SYSTEM,
        settings={"max_tokens": 4, "temperature": 0.0},
        context={"summarizer": "extractive", "recall": False},
    ) as chat:
        reply = chat.send(PROBE)
    timings, turn = reply.timings, reply.turn
    assert timings.ttft_ms is not None and turn is not None
    engine.clear(turn.seq_id)  # the next probe starts on an empty slot too
    figures = {"ttft_ms": timings.ttft_ms, "batch_max": float(turn.batch_max or 1)}
    return figures | {part: getattr(timings, part) or 0.0 for part in PARTS}


def ttft_part(args: argparse.Namespace, engine: Engine, store: Store) -> dict[str, Any]:
    engine.clear()
    load_start = load()
    alone: list[dict[str, float]] = []
    busy: list[dict[str, float]] = []
    half = args.trials // 2
    for k in range(half):  # half of the idle trials before the load, half after
        alone.append(probe(engine, store, f"alone-a{k}"))
        time.sleep(0.2)
    stop = threading.Event()
    errors: list[BaseException] = []
    with ExitStack() as stack:
        # Replies of different lengths: streams that all ended together would all send their
        # next message at once, a burst of prefills that real, independent customers rarely
        # make (the probe would queue behind all of them).
        limits = [args.max_tokens + 8 * i for i in range(len(PROMPTS) - 1)]
        chats = open_chats(engine, store, stack, "load", limits)
        streaming = threading.Barrier(len(chats) + 1)

        def customer(i: int) -> None:
            try:
                first = True
                turn = 0
                while not stop.is_set():
                    text = PROMPTS[i] if turn == 0 else FOLLOW_UPS[turn % len(FOLLOW_UPS)]
                    for _ in chats[i].stream(text):
                        if first:
                            first = False
                            streaming.wait()
                        if stop.is_set():
                            break
                    turn += 1
            except BaseException as exc:  # reported below
                errors.append(exc)
                streaming.abort()

        threads = [threading.Thread(target=customer, args=(i,)) for i in range(len(chats))]
        for t in threads:
            t.start()
        streaming.wait()  # every background stream has its first token
        for k in range(args.trials):
            busy.append(probe(engine, store, f"busy-{k}"))
            time.sleep(0.2 + 0.1 * (k % 3))  # land at different points of the others' turns
        stop.set()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    load_busy = load()
    for k in range(args.trials - half):
        alone.append(probe(engine, store, f"alone-b{k}"))
        time.sleep(0.2)
    ttft_alone = [t["ttft_ms"] for t in alone]
    ttft_busy = [t["ttft_ms"] for t in busy]
    slowest = max(busy, key=lambda t: t["ttft_ms"])
    return {
        "trials": args.trials,
        "background_streams": len(PROMPTS) - 1,
        "alone_ms_median": statistics.median(ttft_alone),
        "alone_ms_p95": p95(ttft_alone),
        "busy_ms_median": statistics.median(ttft_busy),
        "busy_ms_p95": p95(ttft_busy),
        "ratio_p95": p95(ttft_busy) / p95(ttft_alone),
        "ratio_median": statistics.median(ttft_busy) / statistics.median(ttft_alone),
        "probe_batch_max_median": statistics.median(t["batch_max"] for t in busy),
        "alone_parts_median": {part: statistics.median(t[part] for t in alone) for part in PARTS},
        "busy_parts_median": {part: statistics.median(t[part] for t in busy) for part in PARTS},
        "busy_slowest": slowest,
        "busy_ttft_ms": ttft_busy,
        "alone_ttft_ms": ttft_alone,
        "load": [load_start, load_busy, load()],
    }


# output --------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    rows = [
        "| measure | chatctx | baseline | ratio | target | load 1-min |",
        "|---|---|---|---|---|---|",
    ]
    for where in ("ram", "disk"):
        if f"swap_{where}" not in results:  # --skip-swap
            continue
        s = results[f"swap_{where}"]
        label = "RAM" if where == "ram" else "disk (swap_ram_mb=0)"
        if not s["pairs"]:
            rows.append(f"| swap-in from {label} vs re-prefill | no {where} swap-in measured | |")
            continue
        for stat in ("median", "p95"):
            rows.append(
                f"| swap-in from {label} vs re-prefill of the same tokens ({s['tokens_median']:.0f}"
                f" median), {stat} ms, n={s['pairs']} | {s[f'swap_in_ms_{stat}']:.1f} | "
                f"{s[f'reprefill_ms_{stat}']:.0f} | {s[f'ratio_{stat}']:.0f}x faster | "
                f"{'>= 50x' if where == 'ram' else ''} | {s['load'][1]:.2f} |"
            )
        rows.append(
            f"| swap-out of the slot's owner + swap-in from {label} (both in the lease) vs "
            f"re-prefill, median ms | {s['lease_ms_median']:.1f} | "
            f"{s['reprefill_ms_median']:.0f} | {s['ratio_lease_median']:.0f}x faster | | "
            f"{s['load'][1]:.2f} |"
        )
    t = results["throughput"]
    rows.append(
        f"| {t['streams']} concurrent streams vs one after another, tokens/s "
        f"(median of {t['repeats']}) | {t['concurrent_tok_s']:.1f} | "
        f"{t['sequential_tok_s']:.1f} | {t['ratio']:.2f}x | >= 3x | {t['load'][1]:.2f} |"
    )
    q = results["ttft"]
    for stat in ("p95", "median"):
        rows.append(
            f"| TTFT of a new message with {q['background_streams']} streams generating vs "
            f"alone, {stat} ms, n={q['trials']} | {q[f'busy_ms_{stat}']:.0f} | "
            f"{q[f'alone_ms_{stat}']:.0f} | {q[f'ratio_{stat}']:.2f}x | "
            f"{'<= 2x' if stat == 'p95' else ''} | {q['load'][1]:.2f} |"
        )
    return "\n".join(rows)


def notes(results: dict[str, Any]) -> str:
    lines = []
    for where in ("ram", "disk"):
        if f"swap_{where}" not in results:  # --skip-swap
            continue
        s = results[f"swap_{where}"]
        by = s["swap_ins_by_where"]
        lines.append(
            f"- swap {where}: {s['swap_ins']} swap-ins ({by['ram']} from RAM, {by['disk']} from "
            f"disk; RAM budget {s['ram_budget_mb']:g} MB, {s['spill_to_disk']} spills to disk), "
            f"all swap-ins median {s['all_swap_in_ms_median']:.1f} ms / p95 "
            f"{s['all_swap_in_ms_p95']:.1f} ms; swap-out median "
            f"{s['swap_out_ms_median']:.1f} ms / p95 {s['swap_out_ms_p95']:.1f} ms; state "
            f"{s.get('bytes_median', 0) / 2**20:.1f} MiB median; slowest pair "
            f"{s.get('ratio_pairs_min', 0):.0f}x; turns that re-evaluated restored tokens: "
            f"{s['short_reuse']}; re-prefills counted by the engine: {s['reprefill_counter']}; "
            f"wall {s['wall_s']:.0f} s"
        )
    t = results["throughput"]
    per_step = t["sequences_per_step"]
    lines.append(
        f"- throughput: generated {t['generated_tokens']['concurrent']} tokens concurrently, "
        f"{t['generated_tokens']['sequential']} one after another; runs "
        f"{', '.join(f'{v:.1f}' for v in t['concurrent_tok_s_runs'])} vs "
        f"{', '.join(f'{v:.1f}' for v in t['sequential_tok_s_runs'])} tok/s; sequences per "
        f"decode step {per_step['concurrent']:.1f} vs {per_step['sequential']:.1f} (max "
        f"{t['batch_max']}); wall per step {t['ms_per_step']['concurrent']:.0f} ms vs "
        f"{t['ms_per_step']['sequential']:.0f} ms: a batched step costs "
        f"{t['step_cost_ratio']:.1f}x a single one"
    )
    q = results["ttft"]

    def parts(figures: dict[str, float]) -> str:
        return ", ".join(f"{part[:-3]} {figures[part]:.0f}" for part in PARTS)

    lines.append(
        f"- TTFT: the probe's turn shared decode steps with up to "
        f"{q['probe_batch_max_median']:.0f} sequences (median); parts in ms (median) with the "
        f"streams: {parts(q['busy_parts_median'])}; alone: {parts(q['alone_parts_median'])}; "
        f"slowest trial ({q['busy_slowest']['ttft_ms']:.0f} ms): {parts(q['busy_slowest'])}; "
        f"load 1-min at start, end of the loaded trials, end: "
        f"{', '.join(f'{v:.2f}' for v in q['load'])}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: embedded SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="a smaller run (about 2 minutes)")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--oracle-every", type=int, default=16, help="re-prefill oracle sampling")
    parser.add_argument("--full-messages", action="store_true", help="do not cut messages")
    parser.add_argument("--ram-mb", type=float, default=None, help="RAM swap budget (default)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs of each kind")
    parser.add_argument("--trials", type=int, default=16, help="TTFT trials of each kind")
    # One thread by default: llama.cpp's spinning threads crawl on a shared, busy machine.
    parser.add_argument("--n-threads", type=int, default=1)
    parser.add_argument(
        "--split",
        action="store_true",
        help="batching parts on split KV streams (kv_unified=False): each token attends to its "
        "own conversation's cells only, not the whole pool",
    )
    parser.add_argument("--skip-swap", action="store_true", help="only the batching parts")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.oracle_every = 8, 4, 2
        args.max_tokens, args.repeats, args.trials = 32, 1, 6
    args.oracle_every = max(2, args.oracle_every)
    results: dict[str, Any] = {
        "model": args.model or "SmolLM2-135M (embedded)",
        "n_threads": args.n_threads,
        "conversations": args.conversations,
        "turns": args.turns,
        "slots_swap": 4,
        "kv_unified_batching": not args.split,
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if not args.skip_swap:
            results["swap_ram"] = swap_part(args, tmp, "ram")
            results["swap_disk"] = swap_part(args, tmp, "disk")
        with (
            loaded(
                args.model,
                tmp,
                "batch",
                n_ctx=1024,
                slots=8,
                n_threads=args.n_threads,
                kv_unified=not args.split,
            ) as engine,
            Store(f"sqlite:///{tmp / 'batch.db'}") as store,
        ):
            results["throughput"] = throughput_part(args, engine, store)
            results["ttft"] = ttft_part(args, engine, store)
    results["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{results['model']}, n_threads {args.n_threads}; swap: {args.conversations} "
        f"conversations x {args.turns} turns round-robin on 4 slots (n_ctx 1024 each, "
        f"{'whole messages' if args.full_messages else 'first sentence of each message'}); "
        f"batching: slots=8 ({'split streams' if args.split else 'unified pool'}), greedy, "
        f"max_tokens {args.max_tokens}; wall "
        f"{results['wall_s']:.0f} s\n"
    )
    print(table(results))
    print()
    print(notes(results))


if __name__ == "__main__":
    main()
