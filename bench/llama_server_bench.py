"""chatctx on llama-server vs llama-server alone (issue 22). Run by hand; prints ratios.

    python bench/llama_server_bench.py peers  [--chats 2] [--budgets 512,1024] [--rows a,b,c,d,e]
                                              [--layout auto|append|abridge]
    python bench/llama_server_bench.py scale  [--convs 32] [--turns 6] [--setups ...]
    python bench/llama_server_bench.py decode [--tokens 64] [--streams 8] [--cold]
    python bench/llama_server_bench.py reuse  [--chunk 16]

``peers``: real long chats with planted facts (``bench/facts``), teacher-forced (each turn
prefills and samples one token), per budget:
  (a) naive trimming (system + the most recent messages that fit, starting on a user
      message) -> llama-server as it ships (``cache_prompt`` true, ``id_slot`` -1);
  (b) the same -> llama-server ``--cache-reuse 64``;
  (c) chatctx in process (``Engine``);  (d) chatctx -> llama-server (``LlamaServerBackend``);
  (e) chatctx -> llama-server ``--cache-reuse 64``;  c0, d0, e0: (c)-(e) with recall off;
  (w), (x): chatctx with no model, its prompts through the engine's simulated cache (w) or
      llama-server's simulated walk (x; ``DryBackend(cache_edits="deletions")``).
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

``reuse``: what ``--cache-reuse`` gives back when turns are deleted and the text in front
of the kept ones is kept, rewritten or appended to.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import random
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _llama_server as ls
import httpx
import recall_bench as rb

from chatctx.backends.engine import Engine
from chatctx.backends.llama_server._http import sse_lines
from chatctx.model.codec import PromptCodec, open_codec
from chatctx.model.kv import common_prefix
from chatctx.model.paths import default_model_path
from chatctx.replay import DryBackend, LoggedConversation, ReplayConfig, Replayer
from chatctx.replay._run import _retained
from chatctx.synthetic import support_conversation

RESERVE = 16  # a teacher-forced replay's reply reserve
ROWS = {
    "a": "(a) naive trim -> llama-server (default)",
    "b": "(b) naive trim -> llama-server --cache-reuse 64",
    "c": "(c) chatctx in process (Engine)",
    "d": "(d) chatctx -> llama-server (default)",
    "e": "(e) chatctx -> llama-server --cache-reuse 64",
    # The same with recall off (the extractive summary alone): recalled messages are
    # evaluated in front of the new one, and count as overhead against the full
    # conversation's new tokens.
    "c0": "(c') chatctx in process, recall off",
    "d0": "(d') chatctx -> llama-server (default), recall off",
    "e0": "(e') chatctx -> llama-server --cache-reuse 64, recall off",
    # Without a model or a server: chatctx's prompts through a simulated cache, the
    # engine's in-place edits (w) or llama-server's walk with chatctx's n_cache_reuse (x),
    # whose evaluated tokens the live rows (c), (d) reproduce; fast enough for all 40 chats.
    "w": "(w) chatctx, the engine's cache simulated (dry)",
    "x": "(x) chatctx, llama-server's cache walk simulated (dry)",
    "w0": "(w') chatctx, the engine's cache simulated (dry), recall off",
    "x0": "(x') chatctx, llama-server's cache walk simulated (dry), recall off",
}


def backend_module() -> Any:
    try:
        import chatctx.backends.llama_server as module
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


def chatctx_chat(
    backend: Any, c: LoggedConversation, budget: int, recall: bool = True, layout: str = "auto"
) -> list[dict[str, Any]]:
    """One chat through ``Replayer`` (a ``ChatSession`` per chat, ``record_turn``)."""
    import chatctx.replay._run as run

    rows: list[dict[str, Any]] = []
    cfg = ReplayConfig(mode="teacher", budget=budget, reserve=RESERVE, recall=recall, layout=layout)
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
        "own_new": t.new_tokens,  # chatctx's own count: recalled tokens are new there
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
        "ttft_ratio": statistics.median(last) / statistics.median(first)
        if statistics.median(first)
        else float("nan"),  # dry rows: no model, no time
        "retained": sum(probes),
        "probes": len(probes),
        # For chatctx rows: evaluated over chatctx's own new tokens, where a recalled
        # message counts as new (it was never at that place in a prompt), as recall_bench has it.
        "own_amplification": evaluated / sum(r.get("own_new", 0) for r in turns)
        if all("own_new" in r for r in turns)
        else None,
    }


def dry_retention(
    conversations: Sequence[LoggedConversation], codec: PromptCodec, budget: int, layout: str
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
    out = {"naive": kept / probes}
    for name, recall in (("chatctx", True), ("chatctx, recall off", False)):
        result = rb.run(
            conversations,
            ReplayConfig(mode="dry", budget=budget, recall=recall, layout=layout),
            codec,
        )
        out[name] = result["retained"] / result["probes"]
    return out


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
              "/metrics) | amplification, recalled tokens as new | wall s |")  # fmt: skip
        print("|---" * 10 + "|")
        table: dict[str, Any] = {}
        for key in args.rows.split(","):
            started = time.perf_counter()
            check = ""
            if key in ("a", "b"):
                extra = ["--cache-reuse", "64"] if key == "b" else []
                with ls.llama_server(
                    args.binary, model, slots=1, n_ctx=n_ctx, threads=args.threads, extra=extra
                ) as server:
                    per_chat = [naive_chat(server.url, c, codec, budget) for c in chats]
                    check = str(ls.prompt_tokens_total([server.url]))
            elif key[0] in "wx":
                edits = "in-place" if key[0] == "w" else "deletions"
                with DryBackend(codec, n_ctx=n_ctx, model_path=model, cache_edits=edits) as dry:
                    per_chat = [
                        chatctx_chat(dry, c, budget, len(key) == 1, args.layout) for c in chats
                    ]
            elif key.startswith("c"):
                with Engine.load(model, n_ctx=n_ctx, n_seq_max=2, n_threads=args.threads) as engine:
                    per_chat = [
                        chatctx_chat(engine, c, budget, key == "c", args.layout) for c in chats
                    ]
            else:
                if module is None:
                    print(
                        f"| {ROWS[key]} | (chatctx.backends.llama_server not available) |"
                        + " |" * 8
                    )
                    continue
                extra = ["--cache-reuse", "64"] if key.startswith("e") else []
                # Two slots: chatctx keeps the last one for summaries.
                with (
                    ls.llama_server(
                        args.binary, model, slots=2, n_ctx=n_ctx, threads=args.threads,
                        extra=extra,
                    ) as server,
                    module.LlamaServerBackend(server.url, model=model) as backend,
                ):  # fmt: skip
                    per_chat = [
                        chatctx_chat(backend, c, budget, len(key) == 1, args.layout) for c in chats
                    ]
                    check = str(ls.prompt_tokens_total([server.url]))
            f = figures(per_chat, new)
            f["wall_s"] = time.perf_counter() - started
            f["metrics_evaluated"] = check or None
            table[key] = f
            print(
                f"| {ROWS[key]} | {f['amplification']:.2f} | {f['hit']:.2f} | "
                f"{f['ttft_first_ms']:.0f} | {f['ttft_last_ms']:.0f} | {f['ttft_ratio']:.2f} | "
                f"{f['retained']}/{f['probes']} = {f['retained'] / max(1, f['probes']):.2f} | "
                f"{f['evaluated']:,}"
                + (f" ({int(check):,})" if check else "")
                + " | "
                + (f"{f['own_amplification']:.2f}" if f["own_amplification"] else "-")
                + f" | {f['wall_s']:.0f} |",
                flush=True,
            )
        if not args.no_dry:
            kept = dry_retention(conversations, codec, budget, args.layout)
            print(
                f"\nretention on all {len(conversations)} chats of the set, from the context "
                f"alone (no model): naive trim {kept['naive']:.2f}, chatctx {kept['chatctx']:.2f}, "
                f"chatctx with recall off {kept['chatctx, recall off']:.2f}",
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
    p.add_argument(
        "--layout",
        default="auto",
        choices=("auto", "summary-first", "append", "abridge"),
        help="chatctx's layout (auto: summary-first in process, append on llama-server)",
    )
    add_scale(sub)
    add_decode(sub)
    r = sub.add_parser("reuse", help="what --cache-reuse reuses after a deletion vs an insertion")
    r.add_argument("--chunk", type=int, default=16, help="--cache-reuse N")
    args = parser.parse_args()
    args.binary = ls.find_binary(args.binary)
    runners: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "peers": peers,
        "scale": scale,
        "decode": decode,
        "reuse": reuse,
    }
    started = time.perf_counter()
    results = runners[args.command](args)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


def reuse(args: argparse.Namespace) -> dict[str, Any]:
    """One slot holds [system][summary][turn 1][turn 2]; the next prompt drops turn 1 and
    (1) keeps the summary, (2) rewrites it, (3) appends to it. ``--cache-reuse`` shifts the
    kept turn into place only in (1): its scan never skips prompt tokens, so new text in
    front of a cached run hides the run."""
    model = args.model or default_model_path()
    out: dict[str, Any] = {}
    with (
        ls.llama_server(
            args.binary, model, slots=1, n_ctx=1024, threads=args.threads,
            extra=["--cache-reuse", str(args.chunk)],
        ) as server,
        httpx.Client(base_url=server.url, timeout=600) as http,
    ):  # fmt: skip

        def tok(text: str) -> list[int]:
            tokens: list[int] = http.post("/tokenize", json={"content": text}).json()["tokens"]
            return tokens

        system = tok("System prompt: you are a helpful support bot. " * 3)
        s1 = tok(" Summary: the user likes tea and lives in Oslo.")
        s2 = tok(" Summary: the user likes coffee now, lives in Bergen and has a cat.")
        t1 = tok(" Turn one: hello there, how are you doing today my friend? " * 3)
        t2 = tok(" Turn two: I would like to ask about my parcel number 4471 please. " * 3)
        new = tok(" A new question?")
        cached = system + s1 + t1 + t2
        cases = {
            "turn 1 deleted, summary kept": system + s1 + t2 + new,
            "turn 1 deleted, summary rewritten": system + s2 + t2 + new,
            "turn 1 deleted, summary appended to": system + s1 + tok(" Has a cat.") + t2 + new,
        }
        print(f"\n--cache-reuse {args.chunk}; cached: system {len(system)}, summary {len(s1)}, "
              f"turn 1 {len(t1)}, turn 2 {len(t2)} tokens\n")  # fmt: skip
        print("| next prompt | prompt tokens | reused (cache_n) | evaluated (prompt_n) |")
        print("|---|---|---|---|")
        for label, prompt in cases.items():
            body = {"cache_prompt": True, "id_slot": 0, "temperature": 0.0}
            ls.completion(http, body | {"prompt": cached, "n_predict": 0})
            r, _ = ls.completion(http, body | {"prompt": prompt, "n_predict": 1})
            t = r["timings"]
            out[label] = {"prompt": len(prompt), "cache_n": t["cache_n"], "prompt_n": t["prompt_n"]}
            print(f"| {label} | {len(prompt)} | {t['cache_n']} | {t['prompt_n']} |")
    return out


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
    p.add_argument("--cold", action="store_true", help="erase the server's slots before each run")


SCALE_ROWS = {
    "router": "(i) chatctx Router (rendezvous, sticky placement), a LlamaServerBackend per server",
    "router-swap": "(i+) the same, swap=True: a slot given away is saved to --slot-save-path",
    "rendezvous": "(i') raw HTTP, the router's rendezvous function, id_slot -1",
    "round-robin": "(ii) raw HTTP, round-robin over servers per request, id_slot -1",
    "random": "(ii') raw HTTP, a random server per request, id_slot -1",
    "one-server": "(iii) raw HTTP, one llama-server with all the slots, id_slot -1",
}


def first_sentence(text: str) -> str:
    match = re.match(r".+?[.!?](\s|$)", text)
    return match.group(0).strip() if match else text


def scripts(args: argparse.Namespace) -> dict[str, list[dict[str, str]]]:
    """The same short support chats for every setup: system + first sentences."""
    out = {}
    for n in range(args.convs):
        messages = support_conversation(args.turns, seed=100 + n)["messages"]
        out[f"conv-{n}"] = messages[:1] + [
            {"role": m["role"], "content": first_sentence(m["content"])}
            for m in messages[1:]
            if m["role"] == "user"
        ]
    return out


def in_rotation(
    args: argparse.Namespace,
    conversations: Sequence[str],
    turn: Callable[[str, int], tuple[int, int, int]],
) -> tuple[int, int, int, float]:
    """``args.clients`` threads, each taking turn t of each of its conversations in turn.

    ``turn(conversation, t)`` returns (prompt tokens, reused, reusable) tokens; reusable is
    what a cache holding the conversation's last prompt and reply could have reused (0 where
    unknown). Returns the sums and the wall time.
    """
    sums = [0, 0, 0]
    lock = threading.Lock()
    failures: list[BaseException] = []

    def client(mine: Sequence[str]) -> None:
        try:
            for t in range(args.turns):
                for cid in mine:
                    prompt, reused, reusable = turn(cid, t)
                    with lock:
                        sums[0] += prompt
                        sums[1] += reused
                        sums[2] += reusable
        except BaseException as exc:
            failures.append(exc)

    started = time.perf_counter()
    threads = [
        threading.Thread(target=client, args=(conversations[i :: args.clients],))
        for i in range(args.clients)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if failures:
        raise failures[0]
    return sums[0], sums[1], sums[2], time.perf_counter() - started


def raw_scale(
    args: argparse.Namespace,
    urls: Sequence[str],
    pick: Callable[[str, int], str],
    chats: dict[str, list[dict[str, str]]],
    codec: PromptCodec,
) -> tuple[int, int, int, float]:
    histories = {cid: m[:1] for cid, m in chats.items()}
    cached: dict[str, list[int]] = {cid: [] for cid in chats}  # last prompt + reply tokens
    first = next(iter(chats.values()))
    system = codec.prompt_tokens(first[:1], add_generation_prompt=False)
    local = threading.local()

    def turn(cid: str, t: int) -> tuple[int, int, int]:
        if not hasattr(local, "http"):
            local.http = {u: httpx.Client(base_url=u, timeout=900) for u in urls}
        messages = histories[cid] + [chats[cid][1 + t]]
        tokens = codec.prompt_tokens(messages)
        body = {"prompt": tokens, "n_predict": args.max_tokens, "cache_prompt": True}
        body |= {"id_slot": -1, "temperature": 0.0, "return_tokens": True}
        out, _ = ls.completion(local.http[pick(cid, t)], body)
        histories[cid] = [*messages, {"role": "assistant", "content": out["content"]}]
        # The most a cache could give: this conversation's last prompt and reply, or the
        # system prompt that every conversation shares.
        shared = common_prefix(system, tokens)
        reusable = min(max(common_prefix(cached[cid], tokens), shared), len(tokens) - 1)
        cached[cid] = tokens + list(out.get("tokens") or [])
        timings = out["timings"]
        prompt = int(timings["cache_n"]) + int(timings["prompt_n"])
        return prompt, int(timings["cache_n"]), reusable

    return in_rotation(args, list(chats), turn)


def router_scale(
    args: argparse.Namespace,
    urls: Sequence[str],
    chats: dict[str, list[dict[str, str]]],
    swap_to: Sequence[Path] | None = None,
) -> tuple[int, int, int, float]:
    from chatctx.backends.router import Router
    from chatctx.session import ChatSession
    from chatctx.store import Store

    module = backend_module()
    model = args.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/scale.db")
        # No summary slot: these chats never evict, and the raw setups get every slot too.
        backends = [
            module.LlamaServerBackend(
                u,
                model=model,
                summary_slot=False,
                **({"slot_save_path": swap_to[i], "swap": True} if swap_to else {}),
            )
            for i, u in enumerate(urls)
        ]
        router = Router(backends, store=store, own=True)
        sessions: dict[str, Any] = {}
        lock = threading.Lock()

        def turn(cid: str, t: int) -> tuple[int, int, int]:
            with lock:
                session = sessions.get(cid)
            if session is None:
                session = ChatSession.open(
                    store,
                    conversation_id=cid,
                    model=router,
                    system_prompt=chats[cid][0]["content"],
                    settings={"max_tokens": args.max_tokens, "temperature": 0.0},
                )
                with lock:
                    sessions[cid] = session
            reply = session.send(chats[cid][1 + t]["content"])
            return reply.usage.prompt_tokens, reply.usage.reused_tokens, 0

        try:
            return in_rotation(args, list(chats), turn)
        finally:
            for session in sessions.values():
                session.close()
            router.close()
            store.close()


def picker(setup: str, urls: Sequence[str]) -> Callable[[str, int], str]:
    """Which server gets turn ``t`` of conversation ``cid``."""
    chooser = random.Random(7)
    counter = itertools.count()
    lock = threading.Lock()

    def pick(cid: str, t: int) -> str:
        if setup in ("rendezvous", "one-server"):
            return max(urls, key=lambda u: ls.score(cid, u))
        with lock:
            if setup == "random":
                return chooser.choice(urls)
            return urls[next(counter) % len(urls)]

    return pick


def scale(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or default_model_path()
    codec = open_codec(model)
    chats = scripts(args)
    module = backend_module()
    results: dict[str, Any] = {}
    print(
        f"\n{args.convs} conversations x {args.turns} turns from {args.clients} threads, "
        f"{args.servers} llama-servers x {args.slots} slots of {args.n_ctx} tokens, "
        f"replies of {args.max_tokens} tokens, {model.name}\n"
    )
    print(
        "| setup | prompt tokens | reused | prefix hit ratio | reusable (last prompt + reply "
        "cached) | hit / reusable | evaluated (/metrics) | wall s |"
    )
    print("|---" * 8 + "|")
    for setup in args.setups.split(","):
        if setup.startswith("router") and module is None:
            print(
                f"| {SCALE_ROWS[setup]} | (chatctx.backends.llama_server not available) |"
                + " |" * 6
            )
            continue
        one = setup == "one-server"
        counts = [1] if one else [args.slots] * args.servers
        with contextlib.ExitStack() as stack:
            folders = None  # each server's --slot-save-path, for the router's swap
            if setup == "router-swap":
                base = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                folders = [base / str(i) for i in range(len(counts))]
                for folder in folders:
                    folder.mkdir()
            servers = [
                stack.enter_context(
                    ls.llama_server(
                        args.binary,
                        model,
                        slots=n if not one else args.slots * args.servers,
                        n_ctx=args.n_ctx,
                        threads=args.threads,
                        extra=["--slot-save-path", f"{folders[i]}/"] if folders else (),
                    )
                )
                for i, n in enumerate(counts)
            ]
            urls = [s.url for s in servers]
            pick = picker(setup, urls)
            if setup.startswith("router"):
                prompt, reused, reusable, wall = router_scale(args, urls, chats, folders)
            else:
                prompt, reused, reusable, wall = raw_scale(args, urls, pick, chats, codec)
            evaluated = ls.prompt_tokens_total(urls)
        results[setup] = {
            "prompt": prompt,
            "reused": reused,
            "hit": reused / prompt,
            "reusable": reusable or None,
            "metrics_evaluated": evaluated,
            "wall_s": wall,
        }
        print(
            f"| {SCALE_ROWS[setup]} | {prompt:,} | {reused:,} | {reused / prompt:.3f} | "
            + (f"{reusable / prompt:.3f} | {reused / reusable:.3f}" if reusable else "- | -")
            + f" | {evaluated:,} | {wall:.0f} |",
            flush=True,
        )
    return results


# decode -----------------------------------------------------------------------------------


def decode_prompts(n: int) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        messages = support_conversation(1, seed=300 + i)["messages"]
        out.append(messages[:2])
    return out


Stamp = tuple[float, float, float, int]  # start, first token, end (perf_counter s), tokens


def concurrently(jobs: Sequence[Callable[[], Stamp]]) -> list[Stamp]:
    """Run ``jobs`` in threads, all started together."""
    stamps: list[Stamp | None] = [None] * len(jobs)
    failures: list[BaseException] = []
    go = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        try:
            go.wait()
            stamps[i] = jobs[i]()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if failures:
        raise failures[0]
    return [s for s in stamps if s is not None]


def rates(stamps: Sequence[Stamp]) -> dict[str, float]:
    """End-to-end tokens/s (prefill included), decode tokens/s (after each first token:
    all tokens but the first over the time from the earliest first token to the last end),
    TTFT median ms."""
    tokens = sum(s[3] for s in stamps)
    wall = max(s[2] for s in stamps) - min(s[0] for s in stamps)
    window = max(s[2] for s in stamps) - min(s[1] for s in stamps)
    return {
        "tokens": tokens,
        "e2e": tokens / wall,
        "decode": (tokens - len(stamps)) / window,
        "ttft_ms": statistics.median((s[1] - s[0]) * 1000 for s in stamps),
    }


def decode(args: argparse.Namespace) -> dict[str, Any]:
    from chatctx.session import ChatSession
    from chatctx.store import Store

    model = args.model or default_model_path()
    codec = open_codec(model)
    module = backend_module()
    prompts = decode_prompts(args.streams)
    settings = {"max_tokens": args.tokens, "temperature": 0.0}
    round_ = itertools.count()

    def via_session(
        backend: Any, store: Any, messages: list[dict[str, str]]
    ) -> Callable[[], Stamp]:
        def job() -> Stamp:
            with ChatSession.open(
                store,
                conversation_id=f"decode-{next(round_)}",
                model=backend,
                system_prompt=messages[0]["content"],
                settings=settings,
            ) as chat:
                start = time.perf_counter()
                first = 0.0
                for _ in chat.stream(messages[1]["content"]):
                    first = first or time.perf_counter()
                end = time.perf_counter()
                reply = chat.last_reply
                assert reply is not None
                assert reply.usage.prompt_tokens == len(codec.prompt_tokens(messages))
                return start, first, end, reply.usage.generated_tokens

        return job

    def direct(url: str, messages: list[dict[str, str]]) -> Callable[[], Stamp]:
        tokens = codec.prompt_tokens(messages)

        def job() -> Stamp:
            body = {"prompt": tokens, "n_predict": args.tokens, "temperature": 0.0}
            body |= {"cache_prompt": True, "stream": True, "id_slot": -1}
            made, first = 0, 0.0
            start = time.perf_counter()
            with (
                httpx.Client(base_url=url, timeout=900) as http,
                http.stream("POST", "/completion", json=body) as r,
            ):
                for line in sse_lines(r.iter_bytes()):  # iter_lines cuts at U+2028
                    if line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        first = first or time.perf_counter()
                        if chunk.get("stop"):
                            made = int(chunk["timings"]["predicted_n"])
            return start, first, time.perf_counter(), made

        return job

    n_ctx = ls.pad256(args.n_ctx)
    table: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        store = stack.enter_context(Store(f"sqlite:///{tmp}/decode.db"))
        engine = stack.enter_context(
            Engine.load(model, n_ctx=n_ctx, slots=args.streams, n_threads=args.threads)
        )
        # One slot more than streams: chatctx keeps the last for summaries.
        saves = Path(tmp) / "slots"
        saves.mkdir()
        server = stack.enter_context(
            ls.llama_server(
                args.binary,
                model,
                slots=args.streams + 1,
                n_ctx=n_ctx,
                threads=args.threads,
                # --cold erases the slots, and keeps no host-RAM prompt cache to restore from
                extra=["--slot-save-path", str(saves)]
                + (["--cache-ram", "0"] if args.cold else []),
            )
        )

        def erase() -> None:
            if args.cold:  # every setup prefills its prompts, as the engine does
                for slot in range(args.streams + 1):
                    httpx.post(f"{server.url}/slots/{slot}?action=erase", timeout=60)

        setups: dict[str, Callable[[list[dict[str, str]]], Callable[[], Stamp]]] = {
            "chatctx in process (Engine)": lambda m: via_session(engine, store, m),
            "llama-server /completion direct": lambda m: direct(server.url, m),
        }
        if module is not None:
            backend = stack.enter_context(module.LlamaServerBackend(server.url, model=model))
            setups["chatctx -> llama-server"] = lambda m: via_session(backend, store, m)
        for _name, make in setups.items():  # warm-up: the prompts once each
            concurrently([make(m) for m in prompts])
        for _ in range(args.repeats):
            for streams in (1, args.streams):
                for name, make in setups.items():
                    erase()
                    r = rates(concurrently([make(m) for m in prompts[:streams]]))
                    table.setdefault(name, {}).setdefault(str(streams), []).append(r)
                    print(
                        f"{name}, {streams} streams: {r['tokens']} tokens, e2e "
                        f"{r['e2e']:.1f} tok/s, decode {r['decode']:.1f} tok/s, "
                        f"TTFT {r['ttft_ms']:.0f} ms",
                        flush=True,
                    )
    n = str(args.streams)
    print(f"\n| setup | 1 stream decode tok/s | {n} streams decode tok/s | 1 stream e2e tok/s | "
          f"{n} streams e2e tok/s | decode vs direct (1 / {n}) | e2e vs direct (1 / {n}) | "
          f"TTFT ms (1 / {n}) |")  # fmt: skip
    print("|---" * 8 + "|")

    def med(name: str, streams: str, key: str) -> float:
        return statistics.median(r[key] for r in table[name][streams])

    base = "llama-server /completion direct"
    for name in table:
        d1, dn = med(name, "1", "decode"), med(name, n, "decode")
        e1, en = med(name, "1", "e2e"), med(name, n, "e2e")
        print(
            f"| {name} | {d1:.1f} | {dn:.1f} | {e1:.1f} | {en:.1f} | "
            f"{d1 / med(base, '1', 'decode'):.3f} / {dn / med(base, n, 'decode'):.3f} | "
            f"{e1 / med(base, '1', 'e2e'):.3f} / {en / med(base, n, 'e2e'):.3f} | "
            f"{med(name, '1', 'ttft_ms'):.0f} / {med(name, n, 'ttft_ms'):.0f} |"
        )
    return table


if __name__ == "__main__":
    main()
