"""chatctx on llama-server vs llama-server alone (issue 22). Run by hand; prints ratios.

    python bench/llama_server_bench.py peers  [--chats 2] [--budgets 512,1024] [--rows a,b,c,d,e]
    python bench/llama_server_bench.py scale  [--convs 32] [--turns 6] [--setups ...]
    python bench/llama_server_bench.py decode [--tokens 64] [--streams 8]

``peers``: real long chats with planted facts (``bench/facts``), teacher-forced (each turn
prefills and samples one token), per budget:
  (a) naive trimming (system + the most recent messages that fit, starting on a user
      message) -> llama-server as it ships (``cache_prompt`` true, ``id_slot`` -1);
  (b) the same -> llama-server ``--cache-reuse 64``;
  (c) chatctx in process (``Engine``);  (d) chatctx -> llama-server (``LlamaServerBackend``);
  (e) chatctx -> llama-server ``--cache-reuse 64``.
Prefill amplification = evaluated / new tokens (new: what the full conversation adds each
turn, counted once for every row), hit ratio = reused / prompt tokens, TTFT p50 of the last
10 turns / the first 10 (pooled over chats), fact retention = probes whose answer is in the
context sent with the question. For the server rows evaluated and reused are the server's
``timings.prompt_n`` and ``timings.cache_n``, and the evaluated sum is checked against its
``/metrics`` counter. Retention is also given on all the set's chats without a model (what
is sent does not depend on the cache).

``scale``: N llama-servers, conversations x turns from client threads, each thread taking
turns of its conversations in rotation (so many more conversations are live than there are
slots); prefix hit ratio = sum cache_n / sum prompt tokens from the servers' timings, for
chatctx's ``Router`` and raw-HTTP routing (rendezvous, round-robin, random, one big server).

``decode``: tokens/s of one stream and of ``--streams`` concurrent ones, greedy, the same
token prompts: chatctx in process (``Engine``, slots), chatctx -> llama-server, and
llama-server ``/completion`` directly (the same server as chatctx's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _llama_server as ls
import httpx
import recall_bench as rb

from chatctx.engine import Engine, default_model_path
from chatctx.engine._codec import PromptCodec, open_codec
from chatctx.replay import LoggedConversation, ReplayConfig, Replayer
from chatctx.replay._run import _retained

RESERVE = 16  # a teacher-forced replay's reply reserve
ROWS = {
    "a": "(a) naive trim -> llama-server (default)",
    "b": "(b) naive trim -> llama-server --cache-reuse 64",
    "c": "(c) chatctx in process (Engine)",
    "d": "(d) chatctx -> llama-server (default)",
    "e": "(e) chatctx -> llama-server --cache-reuse 64",
}


def backend_module() -> Any:
    try:
        import chatctx.llama_server as module
    except ImportError:
        return None
    return module


# peers ------------------------------------------------------------------------------------


def full_messages(c: LoggedConversation) -> list[dict[str, Any]]:
    """The whole logged conversation as sent to a model: system, then user + its replies."""
    out: list[dict[str, Any]] = []
    if c.system_prompt is not None:
        out.append({"role": "system", "content": c.system_prompt})
    for user, logged in c.turns():
        out.append({"role": "user", "content": user})
        out += logged or [{"role": "assistant", "content": ""}]
    return out


def cut(c: LoggedConversation, turns: int | None) -> LoggedConversation:
    """The first ``turns`` user turns of ``c`` (and the probes asked in them)."""
    if turns is None:
        return c
    users = user_indices(c.messages)
    end = users[turns] if turns < len(users) else len(c.messages)
    probes = [p for p in c.probes if p.asked_turn < turns]
    return dataclasses.replace(c, messages=c.messages[:end], probes=probes)


def user_indices(messages: Sequence[dict[str, Any]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "user"]


def new_tokens(codec: PromptCodec, messages: list[dict[str, Any]]) -> list[int]:
    """Tokens each turn adds to the full, untrimmed conversation (the same for every row)."""
    counts, previous = [], 0
    for i in user_indices(messages):
        n = len(codec.prompt_tokens(messages[: i + 1]))
        counts.append(n - previous)
        previous = n
    return counts


def naive_chat(
    url: str, c: LoggedConversation, codec: PromptCodec, budget: int
) -> list[dict[str, Any]]:
    """Trim-to-fit every turn, prompts as token arrays, the server picks the slot."""
    messages = full_messages(c)
    asked = {p.asked_turn: p.fact for p in c.probes}
    rows = []
    with httpx.Client(base_url=url, timeout=900) as http:
        http.post("/slots/0?action=erase")  # best effort: a clean start for each chat
        for turn, i in enumerate(user_indices(messages)):
            sent = ls.trim_last(codec, messages[: i + 1], budget)
            tokens = codec.prompt_tokens(sent)
            body = {"prompt": tokens, "n_predict": 1, "cache_prompt": True, "id_slot": -1}
            out, wall = ls.completion(http, body | {"temperature": 0.0})
            t = out["timings"]
            rows.append(
                {
                    "prompt": len(tokens),
                    "reused": int(t["cache_n"]),
                    "evaluated": int(t["prompt_n"]),
                    "ttft_ms": wall,
                    "probe": _retained(asked[turn], sent[:-1]) if turn in asked else None,
                }
            )
    return rows


def chatctx_chat(backend: Any, c: LoggedConversation, budget: int) -> list[dict[str, Any]]:
    """One chat through ``Replayer`` (a ``ChatSession`` per chat, ``record_turn``)."""
    import chatctx.replay._run as run

    rows: list[dict[str, Any]] = []
    cfg = ReplayConfig(mode="teacher", budget=budget, reserve=RESERVE)
    outcomes: list[bool] = []

    def retained(fact: str, messages: Sequence[dict[str, Any]]) -> bool:
        found = _retained(fact, messages)
        outcomes.append(found)
        return found

    # Replayer counts retained probes; which ones is read from its own check, in turn order.
    run._retained = retained
    try:
        with Replayer(cfg, engine=backend) as replayer:
            report = replayer.replay(c, on_turn=lambda t: rows.append(_turn_row(t)))
    finally:
        run._retained = _retained
    asked = sorted(p.asked_turn for p in c.probes if p.asked_turn < len(rows))
    for turn, found in zip(asked, outcomes, strict=True):
        rows[turn]["probe"] = found
    assert report.retained_in_context == sum(outcomes)
    return rows


def _turn_row(t: Any) -> dict[str, Any]:
    return {
        "prompt": t.prompt_tokens,
        "reused": t.reused_tokens,
        "evaluated": t.evaluated_tokens,
        "ttft_ms": t.ttft_ms or 0.0,
        "probe": None,
    }


def figures(chats: list[list[dict[str, Any]]], new: int) -> dict[str, Any]:
    turns = [r for chat in chats for r in chat]
    prompt = sum(r["prompt"] for r in turns)
    first = [r["ttft_ms"] for chat in chats for r in chat[:10]]
    last = [r["ttft_ms"] for chat in chats for r in chat[-10:]]
    probes = [r["probe"] for r in turns if r["probe"] is not None]
    evaluated = sum(r["evaluated"] for r in turns)
    return {
        "turns": len(turns),
        "prompt": prompt,
        "evaluated": evaluated,
        "new": new,
        "amplification": evaluated / new,
        "hit": sum(r["reused"] for r in turns) / prompt,
        "ttft_first_ms": statistics.median(first),
        "ttft_last_ms": statistics.median(last),
        "ttft_ratio": statistics.median(last) / statistics.median(first),
        "retained": sum(probes),
        "probes": len(probes),
    }


def dry_retention(
    conversations: Sequence[LoggedConversation], codec: PromptCodec, budget: int
) -> dict[str, float]:
    """Retention on every chat of the set, from the context alone (no model, no cache)."""
    kept = probes = 0
    for c in conversations:
        messages = full_messages(c)
        asked = {p.asked_turn: p.fact for p in c.probes}
        for turn, i in enumerate(user_indices(messages)):
            if turn in asked:
                probes += 1
                kept += _retained(asked[turn], ls.trim_last(codec, messages[: i + 1], budget)[:-1])
    result = rb.run(conversations, ReplayConfig(mode="dry", budget=budget), codec)
    return {"naive": kept / probes, "chatctx": result["retained"] / result["probes"]}


def peers(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or default_model_path()
    codec = open_codec(model)
    conversations, _ = rb.load(args.probes)
    chats = [cut(c, args.max_turns) for c in conversations[args.skip : args.skip + args.chats]]
    module = backend_module()
    results: dict[str, Any] = {"set": args.probes.name, "chats": [c.id for c in chats]}
    for budget in (int(b) for b in args.budgets.split(",")):
        n_ctx = ls.pad256(budget + RESERVE)
        new = sum(sum(new_tokens(codec, full_messages(c))) for c in chats)
        probes = sum(len(c.probes) for c in chats)
        print(
            f"\n### prompt budget {budget} (n_ctx {n_ctx} per slot), {len(chats)} chats of "
            f"{args.probes.name}, {sum(len(c.turns()) for c in chats)} user turns, {new:,} "
            f"conversation tokens ({new / budget / len(chats):.1f}x the budget per chat), "
            f"{probes} probes\n",
            flush=True,
        )
        print("| setup | prefill amplification | hit ratio | TTFT p50 first 10 ms | "
              "TTFT p50 last 10 ms | last/first | fact retention | evaluated (server "
              "/metrics) | wall s |")  # fmt: skip
        print("|---" * 9 + "|")
        table: dict[str, Any] = {}
        for key in args.rows.split(","):
            started = time.perf_counter()
            check = ""
            if key in "ab":
                extra = ["--cache-reuse", "64"] if key == "b" else []
                with ls.llama_server(
                    args.binary, model, slots=1, n_ctx=n_ctx, threads=args.threads, extra=extra
                ) as server:
                    per_chat = [naive_chat(server.url, c, codec, budget) for c in chats]
                    check = str(ls.prompt_tokens_total([server.url]))
            elif key == "c":
                with Engine.load(model, n_ctx=n_ctx, n_seq_max=2, n_threads=args.threads) as engine:
                    per_chat = [chatctx_chat(engine, c, budget) for c in chats]
            else:
                if module is None:
                    print(f"| {ROWS[key]} | (chatctx.llama_server not available) |" + " |" * 7)
                    continue
                extra = ["--cache-reuse", "64"] if key == "e" else []
                # Two slots: chatctx keeps the last one for summaries.
                with (
                    ls.llama_server(
                        args.binary, model, slots=2, n_ctx=n_ctx, threads=args.threads,
                        extra=extra,
                    ) as server,
                    module.LlamaServerBackend(server.url, model=model) as backend,
                ):  # fmt: skip
                    per_chat = [chatctx_chat(backend, c, budget) for c in chats]
                    check = str(ls.prompt_tokens_total([server.url]))
            f = figures(per_chat, new)
            f["wall_s"] = time.perf_counter() - started
            f["metrics_evaluated"] = check or None
            table[key] = f
            print(
                f"| {ROWS[key]} | {f['amplification']:.2f} | {f['hit']:.2f} | "
                f"{f['ttft_first_ms']:.0f} | {f['ttft_last_ms']:.0f} | {f['ttft_ratio']:.2f} | "
                f"{f['retained']}/{f['probes']} = {f['retained'] / max(1, f['probes']):.2f} | "
                f"{f['evaluated']:,}" + (f" ({int(check):,})" if check else "") + " | "
                f"{f['wall_s']:.0f} |",
                flush=True,
            )
        if not args.no_dry:
            dry = dry_retention(conversations, codec, budget)
            print(
                f"\nretention on all {len(conversations)} chats of the set, from the context "
                f"alone (no model): naive trim {dry['naive']:.2f}, chatctx {dry['chatctx']:.2f}",
                flush=True,
            )
            table["dry_retention_all_chats"] = dry
        results[str(budget)] = table
    return results


# main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", dest="binary", default=None, help="llama-server binary")
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per model")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("peers", help="the peer table on real chats with planted facts")
    p.add_argument("--probes", type=Path, default=rb.HERE / "facts" / "final_probes.jsonl.gz")
    p.add_argument("--chats", type=int, default=2, help="chats run live (40: the whole set)")
    p.add_argument("--skip", type=int, default=0, help="start at this chat of the set")
    p.add_argument("--budgets", default="512,1024")
    p.add_argument("--rows", default="a,b,c,d,e")
    p.add_argument("--max-turns", type=int, default=None, help="cut each chat (a quick look)")
    p.add_argument("--no-dry", action="store_true", help="skip retention on all chats")
    add_scale(sub)
    add_decode(sub)
    args = parser.parse_args()
    args.binary = ls.find_binary(args.binary)
    runners: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "peers": peers,
        "scale": scale,
        "decode": decode,
    }
    started = time.perf_counter()
    results = runners[args.command](args)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


# scale and decode are below main so that the peer table reads first --------------------------


def add_scale(sub: Any) -> None:
    p = sub.add_parser("scale", help="prefix hit ratio of routings over several servers")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--slots", type=int, default=4, help="slots per server")
    p.add_argument("--convs", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--clients", type=int, default=8, help="client threads")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--n-ctx", type=int, default=1024, help="tokens per slot")
    p.add_argument("--setups", default="router,rendezvous,round-robin,random,one-server")


def add_decode(sub: Any) -> None:
    p = sub.add_parser("decode", help="decode tokens/s: in process, through chatctx, direct")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n-ctx", type=int, default=512, help="tokens per slot")


def scale(args: argparse.Namespace) -> dict[str, Any]:
    raise NotImplementedError


def decode(args: argparse.Namespace) -> dict[str, Any]:
    raise NotImplementedError


if __name__ == "__main__":
    main()
