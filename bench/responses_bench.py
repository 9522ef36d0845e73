"""An agent loop through ``/v1/responses``: chatctx's stored chain vs llama-server's own.

``--clients`` customers x ``--turns`` turns (``--chat long``'s support messages of 50-120
tokens, ``--max-tokens`` per reply, temperature 0, streamed), two ways, each on a fresh
llama-server of the same shape (``--slots`` slots of ``--n-ctx`` tokens, ``--metrics``):

1. ``chatctx``: ``chatctx serve --backend`` in front of it; each turn is ``POST
   /v1/responses`` with only the new user message, ``previous_response_id`` (the customer's
   last response) and ``truncation: "auto"`` (chatctx's own fitting: whole turns out,
   summary, recall). A customer whose slot went to another comes back through llama-server's
   host-RAM prompt cache (chatctx asks for its last prompt first when an eviction edited
   it); with ``--swap`` llama-server runs with ``--slot-save-path`` on both sides and
   chatctx serve saves a customer's slot there when another takes it;
2. ``direct``: llama-server's own ``/v1/responses``, which is stateless (it refuses
   ``previous_response_id``): each turn resends the customer's whole history as input items
   (user messages, the assistant's ``output_text`` messages). A turn it refuses with 400
   (over its context) is counted as an error; the customer drops its oldest turn and asks
   again (TTFT counts from the first try), as serve_bench's ``llama_server_trim`` does.

TTFT is from the request to the first ``response.output_text.delta`` event (both servers
send it). Prompt tokens evaluated: each turn's own figure (chatctx's ``chatctx.
evaluated_tokens``, llama-server's ``timings.prompt_n`` on its ``response.completed``
event) and llama-server's ``prompt_tokens_total`` (``/metrics``) over each run.

A customer's history **outgrows the budget** at the turn llama-server first refuses it
(the direct run of the same round); its turns from then on are "after", those before
"before", on both sides. The targets: prompt tokens evaluated per turn after ≤ 0.5x
llama-server's, and TTFT p50 before within 10% of llama-server's (≤ 1.10x). ``--rounds N``
runs both sides N times, alternating which goes first, and reports each round's ratios,
their medians, and the table by turn index over all rounds.

    python bench/responses_bench.py --llama-server BIN [--model GGUF] [--clients 8]
        [--turns 10] [--rounds 3] [--n-ctx 1024] [--slots 4] [--swap] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _sse import HTTPStatusError, SSEClient
from serve_bench import (
    Refused,
    _tree_ticks,
    llama_server,
    load_average,
    others_cores,
    prompt_tokens,
    question,
    server,
)

from chatctx.model.paths import default_model_path
from chatctx.monitor import percentile

SIDES = ("chatctx", "direct")


async def responses_turn(client: SSEClient, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed ``POST /v1/responses``: TTFT (ms, at the first text delta), the reply, the
    final response object and llama-server's ``timings`` (on its last event)."""
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    final: dict[str, Any] | None = None
    timings: dict[str, Any] = {}
    try:
        async for raw in client.lines("/v1/responses", {**body, "stream": True}):
            if not raw.startswith(b"data: "):
                continue
            event = json.loads(raw[6:])
            kind = event.get("type")
            if kind == "response.output_text.delta":
                if first is None:
                    first = (time.perf_counter() - started) * 1000
                parts.append(event["delta"])
            elif kind in ("response.completed", "response.incomplete"):
                final = event["response"]
                timings = event.get("timings") or timings
            elif kind in ("error", "response.failed"):
                raise RuntimeError(f"{kind}: {json.dumps(event)[:300]}")
    except HTTPStatusError as exc:
        if str(exc).startswith("400:"):
            raise Refused(str(exc)) from exc
        raise
    if final is None:
        raise RuntimeError("the stream ended without response.completed")
    if first is None:  # an empty reply: its first token was the end
        first = (time.perf_counter() - started) * 1000
    return {"ttft_ms": first, "reply": "".join(parts), "response": final, "timings": timings}


async def agent_loop(url: str, args: argparse.Namespace, side: str) -> list[dict[str, Any]]:
    """Every customer's turns, all customers at once; one record per turn asked."""
    records: list[dict[str, Any]] = []

    conversations: dict[int, str] = {}  # chatctx: each customer's, named after its first

    async def customer(client: SSEClient, n: int) -> None:
        previous: str | None = None  # chatctx: the customer's last response
        history: list[dict[str, Any]] = []  # direct: the input items resent each turn
        outgrown = False  # direct: refused once (the history is longer than the context)
        for turn in range(args.turns):
            text = question(n, turn, "long")
            new = {"type": "message", "role": "user", "content": text}
            body: dict[str, Any] = {"max_output_tokens": args.max_tokens, "temperature": 0.0}
            if side == "chatctx":
                body |= {"input": text, "truncation": "auto"}
                if previous is not None:
                    body["previous_response_id"] = previous
            record: dict[str, Any] = {"client": n, "turn": turn, "retries": 0}
            started = time.perf_counter()
            while True:
                if side == "direct":
                    body["input"] = [*history, new]
                attempt = time.perf_counter()
                try:
                    answer = await responses_turn(client, body)
                except Refused as exc:
                    if side == "direct" and history:
                        outgrown = True
                        history = history[2:]  # the oldest turn goes; the customer asks again
                        record["retries"] += 1
                        continue
                    record["error"] = str(exc)[:300]
                    break
                response = answer["response"]
                usage = response.get("usage") or {}
                extension = response.get("chatctx") or {}
                evaluated = extension.get("evaluated_tokens")
                if evaluated is None:
                    evaluated = answer["timings"].get("prompt_n")
                record |= {
                    # From the customer's first try: a client that trims waits for its retries.
                    "ttft_ms": round((attempt - started) * 1000 + answer["ttft_ms"], 1),
                    "evaluated": evaluated,
                    "input_tokens": usage.get("input_tokens"),
                    "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens"),
                    "output_tokens": usage.get("output_tokens"),
                    "evicted_messages": extension.get("evicted_messages"),
                    "session_ttft_ms": extension.get("ttft_ms"),
                    "outgrown": outgrown,
                }
                previous = response["id"]
                conversations.setdefault(n, previous)
                reply = {"type": "output_text", "text": answer["reply"]}
                history += [new, {"type": "message", "role": "assistant", "content": [reply]}]
                break
            records.append(record)

    # llama-server closes a kept-alive connection after a few idle seconds: its clients open
    # one per turn (as serve_bench's); chatctx's keep theirs.
    clients = [SSEClient(url, keepalive=side == "chatctx") for _ in range(args.clients)]
    try:
        await asyncio.gather(*(customer(clients[n], n) for n in range(args.clients)))
    finally:
        for client in clients:
            await client.aclose()
    if side == "chatctx":
        await turn_figures(url, conversations, records)
    return records


# Where a chatctx turn's time went, from its turn record (``/v1/conversations/{id}/stats``).
TURN_FIGURES = (
    "queue_ms", "build_ms", "store_ms", "summary_ms", "recall_ms", "recall_tokens",
    "summary_tokens", "prefill_ms", "engine_ttft_ms", "slot", "swap_in", "reprefill_reason",
    "kv_fallback", "reused_tokens", "swap_in_ms", "swap_in_bytes",
)  # fmt: skip


async def turn_figures(
    url: str, conversations: dict[int, str], records: list[dict[str, Any]]
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for n, conversation in conversations.items():
            r = await http.get(f"/v1/conversations/{conversation}/stats")
            r.raise_for_status()
            turns = r.json()["turns"]
            mine = sorted(
                (x for x in records if x["client"] == n and "error" not in x),
                key=lambda x: x["turn"],
            )
            for record, row in zip(mine, turns, strict=False):
                record |= {k: row.get(k) for k in TURN_FIGURES}


def run_side(side: str, model: Path, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One side on a fresh llama-server (and, for chatctx, a fresh ``chatctx serve``)."""
    folder = folder / side
    folder.mkdir()
    machine: dict[str, Any] = {}
    # The same llama-server both ways; a slot-save path changes nothing for llama-server's own
    # serving, and lets chatctx save a customer's slot when another takes it.
    slots = ["--slot-save-path", str(folder / "slots")] if args.swap else []
    if args.swap:
        (folder / "slots").mkdir()  # llama-server refuses a save path that is not there
    with llama_server(model, args, folder, slots) as direct, contextlib.ExitStack() as stack:
        url = direct
        if side == "chatctx":
            url = stack.enter_context(server(model, args, folder, backend=direct, extra=slots))
        with others_cores(machine):
            before = prompt_tokens(direct)
            ticks = _tree_ticks(os.getpid())
            started = time.perf_counter()
            records = asyncio.run(agent_loop(url, args, side))
            elapsed = time.perf_counter() - started
            counted = prompt_tokens(direct) - before  # the server's own counter
            cpu = cpu_seconds(ticks, _tree_ticks(os.getpid()))
    answered = sum(1 for r in records if "error" not in r)
    return {
        "elapsed_s": round(elapsed, 1),
        "turns_per_s": round(answered / elapsed, 3),
        "answered": answered,
        "errors": len(records) - answered,
        "refusals": sum(r["retries"] for r in records),
        "server_evaluated": counted,
        "server_evaluated_per_turn": round(counted / max(answered, 1), 1),
        "turn_evaluated_sum": sum(r.get("evaluated") or 0 for r in records),
        "cpu_s": cpu,
        "load_average": load_average(),
        **machine,
        "records": records,
    }


def cpu_seconds(before: dict[int, int], after: dict[int, int]) -> dict[str, float]:
    """CPU seconds of this process and its children over the run, by kind: llama-server,
    chatctx serve, this benchmark (its clients)."""
    out: dict[str, float] = {}
    for pid, ticks in after.items():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        kind = (
            "llama-server"
            if "llama-server" in command
            else "chatctx serve"
            if "chatctx serve" in command
            else "bench"
        )
        spent = (ticks - before.get(pid, 0)) / os.sysconf("SC_CLK_TCK")
        out[kind] = round(out.get(kind, 0.0) + spent, 1)
    return out


# figures -----------------------------------------------------------------------------------


def mark_phases(results: dict[str, Any]) -> None:
    """``after`` on both sides' records: the customer's history had outgrown llama-server's
    context by that turn (the direct run of the same round refused it, then or before)."""
    outgrown = {(r["client"], r["turn"]) for r in results["direct"]["records"] if r.get("outgrown")}
    for side in SIDES:
        for r in results[side]["records"]:
            r["after"] = (r["client"], r["turn"]) in outgrown


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if "error" not in r]
    ttfts = [r["ttft_ms"] for r in ok]
    evaluated = [r["evaluated"] for r in ok if r.get("evaluated") is not None]
    out: dict[str, Any] = {
        "n": len(ok),
        "errors": len(records) - len(ok),
        "ttft_p50_ms": round(percentile(ttfts, 50) or 0, 1),
        "ttft_p95_ms": round(percentile(ttfts, 95) or 0, 1),
        "evaluated_per_turn": round(statistics.mean(evaluated), 1) if evaluated else None,
        "input_tokens_per_turn": round(
            statistics.mean([r["input_tokens"] for r in ok if r.get("input_tokens")] or [0]), 1
        ),
    }
    for key in ("queue_ms", "build_ms", "prefill_ms"):  # chatctx's turn records
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            out[f"{key}_p50"] = round(percentile(values, 50) or 0, 1)
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """All turns, before and after the history outgrew the budget, and by turn index."""
    by_turn: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_turn.setdefault(r["turn"], []).append(r)
    return {
        "all": _summary(records),
        "before": _summary([r for r in records if not r["after"]]),
        "after": _summary([r for r in records if r["after"]]),
        "by_turn": {
            t: _summary(rs) | {"outgrown": sum(r["after"] for r in rs)}
            for t, rs in sorted(by_turn.items())
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    ours, theirs = summary["chatctx"], summary["direct"]
    out: dict[str, float | None] = {}
    for phase in ("before", "after", "all"):
        for key in ("evaluated_per_turn", "ttft_p50_ms", "ttft_p95_ms"):
            out[f"{phase}_{key}"] = _ratio(ours[phase][key], theirs[phase][key])
    return out


def one_round(model: Path, args: argparse.Namespace, number: int, folder: Path) -> dict[str, Any]:
    """Both sides, the first one alternating from round to round."""
    results: dict[str, Any] = {"order": list(SIDES if number % 2 == 0 else SIDES[::-1])}
    for side in results["order"]:
        results[side] = run_side(side, model, args, folder)
        brief = {k: v for k, v in results[side].items() if k != "records"}
        print(f"round {number} {side}", json.dumps(brief), flush=True)
    mark_phases(results)
    summary = {side: summarize(results[side]["records"]) for side in SIDES}
    results["summary"] = summary
    results["ratios"] = ratios(summary)
    results["ratios"]["server_evaluated_per_turn"] = _ratio(
        results["chatctx"]["server_evaluated_per_turn"],
        results["direct"]["server_evaluated_per_turn"],
    )
    print(f"round {number} ratios", json.dumps(results["ratios"]), flush=True)
    return results


def table(summary: dict[str, dict[str, Any]]) -> str:
    """Markdown: by turn index, then before / after / all."""
    lines = [
        "| turn | histories outgrown | evaluated / turn: chatctx / direct | ratio "
        "| TTFT p50 ms: chatctx / direct | TTFT p95 ms: chatctx / direct | errors |",
        "|---|---|---|---|---|---|---|",
    ]

    def row(name: str, ours: dict[str, Any], theirs: dict[str, Any], outgrown: str) -> str:
        return (
            f"| {name} | {outgrown} | {ours['evaluated_per_turn']} / "
            f"{theirs['evaluated_per_turn']} | "
            f"{_ratio(ours['evaluated_per_turn'], theirs['evaluated_per_turn'])} | "
            f"{ours['ttft_p50_ms']:.0f} / {theirs['ttft_p50_ms']:.0f} | "
            f"{ours['ttft_p95_ms']:.0f} / {theirs['ttft_p95_ms']:.0f} | "
            f"{ours['errors']} / {theirs['errors']} |"
        )

    ours, theirs = summary["chatctx"], summary["direct"]
    for t, mine in ours["by_turn"].items():
        other = theirs["by_turn"][t]
        asked = other["n"] + other["errors"]
        lines.append(row(str(t), mine, other, f"{other['outgrown']}/{asked}"))
    for phase in ("before", "after", "all"):
        lines.append(row(f"**{phase}**", ours[phase], theirs[phase], ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-server", type=Path, required=True, help="llama-server binary (both sides)"
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--slots", type=int, default=4, help="llama-server -np")
    parser.add_argument("--n-ctx", type=int, default=1024, help="tokens a slot (the budget)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_output_tokens")
    parser.add_argument("--threads", type=int, default=None, help="llama-server -t")
    parser.add_argument("--rounds", type=int, default=1, help="both sides this often")
    parser.add_argument(
        "--swap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="llama-server with --slot-save-path, chatctx serve saving a customer's slot when "
        "another takes it (default: the server's host-RAM prompt cache only)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    model = args.model or default_model_path()
    results: dict[str, Any] = {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
    }
    results["model"] = model.name
    results["load_average_before"] = load_average()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.rounds):
            folder = Path(tmp) / f"round{number}"
            folder.mkdir()
            rounds.append(one_round(model, args, number, folder))
    results["rounds"] = rounds
    results["median_ratios"] = {
        key: statistics.median(v)
        if (v := [r["ratios"][key] for r in rounds if r["ratios"][key] is not None])
        else None
        for key in rounds[0]["ratios"]
    }
    pooled = {
        side: summarize([rec for r in rounds for rec in r[side]["records"]]) for side in SIDES
    }
    results["pooled"] = pooled
    results["pooled_ratios"] = ratios(pooled)
    print(table(pooled))
    print("median ratios over rounds", json.dumps(results["median_ratios"], indent=2))
    target = results["median_ratios"]
    print(
        f"prefill after the budget, chatctx / direct: {target['after_evaluated_per_turn']} "
        f"(target <= 0.5); TTFT p50 before it: {target['before_ttft_p50_ms']} "
        "(target <= 1.10)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
