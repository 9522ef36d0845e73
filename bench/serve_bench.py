"""chatctx serve under load: HTTP overhead and what remembering saves.

Three runs of the same load (``--clients`` customers x ``--turns`` turns, ``--slots`` slots,
streamed, ``--max-tokens`` per reply):

1. ``serve``: through ``chatctx serve`` (a subprocess), stateful, sending only the new message;
2. ``in-process``: the same turns through ``ChatSession.astream`` on one shared ``Engine``;
3. ``stateless``: through ``chatctx serve`` without ``conversation``, each client resending
   its whole history (what a client of llama-server's own /v1/chat/completions does);
4. ``llama_server`` (with ``--llama-server BIN``): the same turns against llama-server's own
   ``/v1/chat/completions`` (``-np`` slots, ``-c`` slots x n_ctx, ``cache_prompt`` as it
   ships), each client resending its whole history; evaluated tokens are the server's
   ``timings.prompt_n``. A turn the server refuses (400: over its context) is counted as an
   error and the client goes on;
5. ``llama_server_trim``: the same, but a client refused with 400 drops its oldest turn and
   retries, as a client that trims does;
6. ``serve_backend``: ``chatctx serve --backend`` in front of such a llama-server, stateful.
   Its evaluated tokens, like the two direct runs', are the server's own counter
   (``/metrics`` prompt_tokens_total over the run).

``--chat long`` sends support messages of 50-120 tokens (the chats outgrow the slots),
``--chat short`` (the default) one-line questions. Each run reports TTFT p50/p95 by turn
index and the longest wait of a first turn (``turn0_max_ms``).

Reported: throughput (turns/s), TTFT p50/p95 and their ratios serve / in-process (the HTTP
overhead), and prompt tokens evaluated per turn, stateless / stateful and llama-server /
stateful (chatctx's figure from the final chunk's ``chatctx`` object). Each run also says
how much of its TTFT was the session's own (its turn record's ``ttft_ms``: the slot wait,
the build, the prefill) and how much came before and after it (``outside_session``: HTTP,
the request's checks and writes, the worker thread, the first chunk's way out), the load
average, and the cores other processes kept busy meanwhile (``others_cores``): on a shared
machine a run beside another job's llama.cpp can be several times slower, whatever it runs.
``--rounds N`` repeats the runs alternately and reports the median ratios as well.

    python bench/serve_bench.py [--model GGUF] [--clients 32] [--turns 10] [--json out.json]
        [--llama-server BIN] [--runs serve,stateless,in_process,llama_server] [--rounds 1]

Without ``--model`` the tiny random Llama 3 (``chatctx.testing``) is written once to
``$CHATCTX_HOME/bench/tiny-llama3.gguf``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from _sse import HTTPStatusError, SSEClient

from chatctx.backends.engine import Engine
from chatctx.monitor import percentile
from chatctx.session import ChatSession
from chatctx.settings import GenerationSettings, default_home
from chatctx.store import Store

ROOT = Path(__file__).resolve().parent.parent


def question(client: int, turn: int, chat: str = "short") -> str:
    if chat == "short":
        return f"Customer {client} asks, for the {turn}th time: where is my parcel 10{client}?"
    # 50-120 tokens, different for every client and turn (no two prompts share more than
    # the chat template's opening).
    parts = [
        f"Hello again, this is customer {client} writing for the {turn}th time today.",
        f"My order number is 10{client}{turn:02d} and it was placed on the {turn + 3}rd.",
        "The tracking page has not changed for several days and says the parcel is held.",
        f"I was told on the phone that a courier would come between {turn % 12 + 1} and "
        f"{turn % 12 + 3} o'clock, but nobody came and nobody called.",
        "Could you check with the warehouse and tell me what is going on, and whether I "
        "should ask for a refund instead of waiting any longer?",
        f"I also need the invoice sent to a different address, flat {client + turn}, "
        "because the old one is no longer mine.",
    ]
    return " ".join(parts[: 3 + (client + turn) % 4])


def figures(
    ttfts: list[float],
    evaluated: list[int],
    elapsed: float,
    turns: int,
    records: list[dict[str, Any]] | None = None,
    by_turn: dict[int, list[float]] | None = None,
    errors: int = 0,
) -> dict[str, Any]:
    """The run's figures; ``records`` (each turn's record: ``ttft_ms``, ``swap_in``, in the
    order of ``ttfts``) split TTFT into the session's own (from its turn's start, slot wait
    included) and the rest (HTTP, the request's checks and writes, the worker thread, the
    first chunk's way out)."""
    out: dict[str, Any] = {
        "turns": turns,
        "elapsed_s": round(elapsed, 2),
        "turns_per_s": round((turns - errors) / elapsed, 3),  # answered turns
        "ttft_p50_ms": round(percentile(ttfts, 50) or 0, 1),
        "ttft_p95_ms": round(percentile(ttfts, 95) or 0, 1),
        "evaluated_per_turn": round(sum(evaluated) / len(evaluated), 1) if evaluated else None,
        "errors": errors,
    }
    if by_turn:
        out["ttft_by_turn_ms"] = {
            turn: [round(percentile(v, 50) or 0), round(percentile(v, 95) or 0)]
            for turn, v in sorted(by_turn.items())
        }
        out["turn0_max_ms"] = round(max(by_turn.get(0, [0.0])), 1)
    pairs = [
        (ttft, float(r["ttft_ms"]))
        for ttft, r in zip(ttfts, records or (), strict=False)
        if r.get("ttft_ms") is not None
    ]
    if pairs:
        session = [inside for _, inside in pairs]
        outside = [ttft - inside for ttft, inside in pairs]
        out["session_ttft_p50_ms"] = round(percentile(session, 50) or 0, 1)
        out["session_ttft_p95_ms"] = round(percentile(session, 95) or 0, 1)
        out["outside_session_p50_ms"] = round(percentile(outside, 50) or 0, 1)
        out["outside_session_p95_ms"] = round(percentile(outside, 95) or 0, 1)
        out["swapped_in"] = sum(1 for r in records or () if r.get("swap_in"))
    return out


# over HTTP ---------------------------------------------------------------------------------


Client = SSEClient | httpx.AsyncClient


async def _event_lines(client: Client, body: dict[str, Any]) -> AsyncIterator[str]:
    if isinstance(client, SSEClient):
        try:
            async for raw in client.lines("/v1/chat/completions", body):
                yield raw.decode()
        except HTTPStatusError as exc:
            if str(exc).startswith("400:"):
                raise Refused(str(exc)) from exc
            raise
        return
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code == 400:
            raise Refused((await r.aread())[:300])
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            yield line


async def sse_turn(client: Client, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """One streamed turn: (TTFT ms, reply, the final chunk's chatctx figures)."""
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    extension: dict[str, Any] = {}
    async for line in _event_lines(client, {**body, "stream": True}):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if not chunk["choices"]:
            continue
        if first is None:
            first = (time.perf_counter() - started) * 1000
        parts.append(chunk["choices"][0]["delta"].get("content") or "")
        extension = chunk.get("chatctx") or extension
        if "timings" in chunk:  # llama-server's own figures, on its last chunk
            extension = {**extension, "evaluated_tokens": chunk["timings"]["prompt_n"]}
    assert first is not None
    return first, "".join(parts), extension


class Refused(Exception):
    """The server answered 400 (the history is over its context)."""


async def http_load(
    url: str,
    args: argparse.Namespace,
    *,
    stateful: bool,
    keepalive: bool = True,
    trim: bool = False,
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``args.clients`` customers x ``args.turns`` streamed turns. Stateless, a refused turn
    (400) is an error the customer goes on after, or with ``trim`` is retried without the
    customer's oldest turn until it fits."""
    ttfts: list[float] = []
    evaluated: list[int] = []
    records: list[dict[str, Any]] = []
    by_turn: dict[int, list[float]] = {}
    errors = 0
    # llama-server closes a kept-alive connection after a few idle seconds, which a loaded
    # machine reaches between two turns: its clients open a connection per turn.
    limits = httpx.Limits(
        max_connections=args.clients + 4, max_keepalive_connections=None if keepalive else 0
    )

    async def customer(client: Client, n: int) -> None:
        nonlocal errors
        history: list[dict[str, str]] = []
        for turn in range(args.turns):
            new = {"role": "user", "content": question(n, turn, args.chat)}
            body: dict[str, Any] = {"max_tokens": args.max_tokens, "seed": turn, **(sampling or {})}
            started = time.perf_counter()
            while True:
                if stateful:
                    body |= {"messages": [new], "conversation": f"bench-{n}"}
                else:
                    body |= {"messages": [*history, new]}
                attempt = time.perf_counter()
                try:
                    ttft, reply, extension = await sse_turn(client, body)
                except Refused:
                    if trim and history:
                        history = history[2:]  # the oldest turn goes; the client asks again
                        continue
                    errors += 1
                    break
                # From the customer's first try: a client that trims waits for its retries.
                ttft += (attempt - started) * 1000
                history += [new, {"role": "assistant", "content": reply}]
                ttfts.append(ttft)
                by_turn.setdefault(turn, []).append(ttft)
                if "evaluated_tokens" in extension:
                    evaluated.append(int(extension["evaluated_tokens"]))
                records.append(extension)
                break

    # Clients are made before the clock starts. httpx: one for every customer (one per
    # customer built its own TLS context, about 50 ms of CPU each, while the first turns
    # were being served on the same cores).
    async with contextlib.AsyncExitStack() as stack:
        clients: list[Client]
        if args.client == "httpx":
            shared = httpx.AsyncClient(base_url=url, timeout=900, limits=limits)
            clients = [await stack.enter_async_context(shared)] * args.clients
        else:
            clients = [SSEClient(url, keepalive=keepalive) for _ in range(args.clients)]
            for client in clients:
                stack.push_async_callback(client.aclose)
        started = time.perf_counter()
        await asyncio.gather(*(customer(clients[n], n) for n in range(args.clients)))
        elapsed = time.perf_counter() - started
    return figures(ttfts, evaluated, elapsed, args.clients * args.turns, records, by_turn, errors)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def server_tokens(url: str) -> tuple[int, int]:
    """llama-server's own counters since it started: tokens it evaluated for prompts
    (``prompt_tokens_total``) and tokens it generated (``tokens_predicted_total``)."""
    from _llama_server import metric

    return (
        int(metric(url, "llamacpp:prompt_tokens_total")),
        int(metric(url, "llamacpp:tokens_predicted_total")),
    )


@contextlib.contextmanager
def server(
    model: Path,
    args: argparse.Namespace,
    folder: Path,
    backend: str | None = None,
    extra: Sequence[str] = (),
) -> Any:
    """``chatctx serve`` on ``model`` in this process's place, or in front of the llama-server
    at ``backend`` (``model`` is then read for its tokenizer); ``extra``: more options."""
    port = free_port()
    command = [
        sys.executable, "-m", "chatctx", "serve", "--port", str(port), "--model", str(model),
        "--db", f"sqlite:///{folder / 'serve.db'}", "--n-ctx", str(args.n_ctx),
        "--slots", str(args.slots), "--max-concurrent-turns", str(args.clients),
        "--no-access-log", *(["--backend", backend] if backend else []), *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHATCTX_HOME": str(folder / "home")}
    with (folder / "serve.log").open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((folder / "serve.log").read_text()[-2000:])
                time.sleep(0.2)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


# in process --------------------------------------------------------------------------------


def reseed(session: ChatSession, seed: int) -> None:
    """Store the turn's seed as serve stores a request's (the same replies both ways)."""
    settings = session.conversation_settings().updated(generation={"seed": seed})
    session.store.update_conversation(session.conversation_id, settings=settings.to_json())


async def in_process(model: Path, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    ttfts: list[float] = []
    evaluated: list[int] = []
    records: list[dict[str, Any]] = []
    with (
        Engine.load(model, n_ctx=args.n_ctx, slots=args.slots) as engine,
        Store(f"sqlite:///{folder / 'inprocess.db'}") as store,
    ):
        # What serve builds before it reports ready (the codec, the sentence embedder), so
        # that both runs time the same turns.
        engine.codec()
        engine.embedder()

        async def customer(n: int) -> None:
            session = await asyncio.to_thread(
                ChatSession.open,
                store,
                conversation_id=f"bench-{n}",
                model=engine,
                settings={"max_tokens": args.max_tokens},
            )
            try:
                for turn in range(args.turns):
                    # Off the event loop, which it held 2-3 ms a turn (delaying the other
                    # customers' chunks), before the clock starts.
                    await asyncio.to_thread(reseed, session, turn)
                    started = time.perf_counter()
                    first: float | None = None
                    async for _ in session.astream(question(n, turn)):
                        if first is None:
                            first = (time.perf_counter() - started) * 1000
                    assert first is not None and session.last_reply is not None
                    ttfts.append(first)
                    evaluated.append(session.last_reply.usage.evaluated_tokens)
                    record = session.last_reply.turn
                    if record is not None:
                        records.append({"ttft_ms": record.ttft_ms, "swap_in": record.swap_in})
            finally:
                await asyncio.to_thread(session.close)

        started = time.perf_counter()
        await asyncio.gather(*(customer(n) for n in range(args.clients)))
        elapsed = time.perf_counter() - started
    return figures(ttfts, evaluated, elapsed, args.clients * args.turns, records)


# main --------------------------------------------------------------------------------------


def load_average() -> str | None:
    """/proc/loadavg's 1/5/15-minute figures (the machine is shared: say how busy it was)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def _busy_ticks() -> int:
    """Clock ticks every core spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def _tree_ticks(root: int) -> dict[int, int]:
    """Clock ticks (user + system) of ``root`` and its descendants, by pid."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    ours = {root}
    grew = True
    while grew:
        grew = False
        for pid, (parent, _) in stats.items():
            if parent in ours and pid not in ours:
                ours.add(pid)
                grew = True
    return {pid: stats[pid][1] for pid in ours if pid in stats}


@contextlib.contextmanager
def others_cores(into: dict[str, Any]) -> Any:
    """Sets ``into["others_cores"]``: the cores other processes kept busy during the block.

    The machine is shared: another job's llama.cpp threads on the same cores slow this
    run's by several times (both spin at barriers), which the load average hides.
    """
    try:
        busy, ours, started = _busy_ticks(), _tree_ticks(os.getpid()), time.monotonic()
    except OSError:  # no /proc
        yield
        return
    yield
    elapsed = time.monotonic() - started
    mine = sum(t - ours.get(pid, 0) for pid, t in _tree_ticks(os.getpid()).items())
    ticks = _busy_ticks() - busy - mine
    into["others_cores"] = round(ticks / os.sysconf("SC_CLK_TCK") / elapsed, 2)


def tiny_model() -> Path:
    from chatctx.testing import write_tiny_llama3

    path = default_home() / "bench" / "tiny-llama3.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_llama3(path)
    return path


@contextlib.contextmanager
def llama_server(
    model: Path, args: argparse.Namespace, folder: Path, extra: Sequence[str] = ()
) -> Any:
    """llama-server itself: ``--slots`` slots of ``--n-ctx`` tokens, cache_prompt as it ships
    (``extra``: more options)."""
    from _llama_server import llama_server as start

    threads = args.threads or os.cpu_count() or 1
    with start(
        str(args.llama_server),
        model,
        slots=args.slots,
        n_ctx=args.n_ctx,
        threads=threads,
        # every client served at once
        extra=["--threads-http", str(args.clients + 4), *shlex.split(args.server_args), *extra],
        log=folder / "llama-server.log",
    ) as proc:
        yield proc.url


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """The ratios the runs that ran allow."""
    out: dict[str, float] = {}
    serve, local = results.get("serve"), results.get("in_process")
    if serve and local:
        out["throughput_serve_vs_in_process"] = round(
            serve["turns_per_s"] / local["turns_per_s"], 3
        )
        out["ttft_p50_serve_vs_in_process"] = round(serve["ttft_p50_ms"] / local["ttft_p50_ms"], 3)
        out["ttft_p95_serve_vs_in_process"] = round(serve["ttft_p95_ms"] / local["ttft_p95_ms"], 3)
    for other in ("stateless", "llama_server"):
        if serve and results.get(other):
            out[f"evaluated_per_turn_{other}_vs_stateful"] = round(
                results[other]["evaluated_per_turn"] / serve["evaluated_per_turn"], 2
            )
    through = results.get("serve_backend")
    for other in ("llama_server", "llama_server_trim"):
        direct = results.get(other)
        if through and direct:
            tag = f"serve_backend_vs_{other}"
            out[f"throughput_{tag}"] = round(through["turns_per_s"] / direct["turns_per_s"], 3)
            for q in ("p50", "p95"):
                out[f"ttft_{q}_{tag}"] = round(through[f"ttft_{q}_ms"] / direct[f"ttft_{q}_ms"], 3)
            out[f"server_evaluated_{tag}"] = round(
                through["server_evaluated_per_turn"] / direct["server_evaluated_per_turn"], 3
            )
    if serve and results.get("llama_server"):
        server = results["llama_server"]
        out["ttft_p50_serve_vs_llama_server"] = round(
            serve["ttft_p50_ms"] / server["ttft_p50_ms"], 3
        )
        out["throughput_serve_vs_llama_server"] = round(
            serve["turns_per_s"] / server["turns_per_s"], 3
        )
    return out


# The runs in the order a round takes them (the next round in the other order).
ORDER = ("serve", "stateless", "llama_server", "llama_server_trim", "serve_backend", "in_process")
LLAMA_SERVER_RUNS = ("llama_server", "llama_server_trim", "serve_backend")


def one_round(
    model: Path,
    args: argparse.Namespace,
    runs: set[str],
    folder: Path,
    *,
    backwards: bool = False,
) -> dict[str, Any]:
    """Every run asked for, one after the other, each in a fresh folder and process;
    ``backwards``: in the other order (on a machine whose cores slow down under a long load
    the first run of a series is the fastest, so rounds alternate)."""
    results: dict[str, Any] = {"llama_server": None}
    order = [name for name in (ORDER[::-1] if backwards else ORDER) if name in runs]
    if args.llama_server is None:
        order = [name for name in order if name not in LLAMA_SERVER_RUNS]
    results["order"] = order
    for name in order:
        (folder / name).mkdir()
        machine: dict[str, Any] = {}
        with others_cores(machine):
            if name in LLAMA_SERVER_RUNS:
                results[name] = llama_server_run(model, args, name, folder / name)
            elif name == "in_process":
                os.environ["CHATCTX_HOME"] = str(folder / name / "home")
                results[name] = asyncio.run(in_process(model, args, folder / name))
            else:
                with server(model, args, folder / name) as url:
                    results[name] = asyncio.run(http_load(url, args, stateful=name == "serve"))
        results[name] |= machine | {"load_average": load_average()}
        print(name, results[name], flush=True)
    results["ratios"] = ratios(results)
    print(json.dumps(results["ratios"], indent=2), flush=True)
    return results


# Direct clients ask llama-server for chatctx's default sampling (the server's own defaults
# differ: temperature 0.8, no repeat penalty), so that both ways sample alike and write
# replies of about the same length (``server_generated_per_turn``).
SAME_SAMPLING = GenerationSettings().model_dump(exclude={"max_tokens", "seed"})


def llama_server_run(
    model: Path, args: argparse.Namespace, name: str, folder: Path
) -> dict[str, Any]:
    """One run on a fresh llama-server: its clients direct (``llama_server``, stateless;
    ``llama_server_trim``, trimming) or through ``chatctx serve --backend``, with what the
    server counted: tokens evaluated for prompts and generated, a turn."""
    with llama_server(model, args, folder) as direct:
        before = server_tokens(direct)  # llama-server's own counters
        if name == "serve_backend":
            with server(model, args, folder, backend=direct) as url:
                result = asyncio.run(http_load(url, args, stateful=True))
        else:
            result = asyncio.run(
                http_load(
                    direct,
                    args,
                    stateful=False,
                    keepalive=False,
                    trim=name.endswith("trim"),
                    sampling=SAME_SAMPLING,
                )
            )
        after = server_tokens(direct)
    turns = max(result["turns"] - result["errors"], 1)
    evaluated, generated = (a - b for a, b in zip(after, before, strict=True))
    result["server_evaluated_per_turn"] = round(evaluated / turns, 1)
    result["server_generated_per_turn"] = round(generated / turns, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: tiny Llama 3)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--llama-server", type=Path, default=None, help="llama-server binary: add its run"
    )
    parser.add_argument(
        "--runs",
        default="serve,stateless,in_process,llama_server",
        help="which runs (also llama_server_trim, serve_backend)",
    )
    parser.add_argument("--threads", type=int, default=None, help="llama-server -t")
    parser.add_argument(
        "--server-args",
        default="",
        help='more llama-server options, for every run on it (e.g. "--poll 0")',
    )
    parser.add_argument(
        "--chat",
        choices=("short", "long"),
        default="short",
        help="one-line questions, or support messages of 50-120 tokens",
    )
    parser.add_argument(
        "--client",
        choices=("lean", "httpx"),
        default="lean",
        help="the benchmark's HTTP client: lean (asyncio streams, bench/_sse.py) or httpx "
        "(about 5 ms more CPU per turn on the cores the server shares)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="the runs this often, alternating (the median ratios are reported too): "
        "other jobs come and go on a shared machine",
    )
    args = parser.parse_args()
    runs = set(args.runs.split(","))
    model = args.model or tiny_model()
    results: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "json"}
    results["model"] = model.name
    results["llama_server_binary"] = str(args.llama_server) if args.llama_server else None
    results["load_average_before"] = load_average()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.rounds):
            folder = Path(tmp) / f"round{number}"
            folder.mkdir()
            rounds.append(one_round(model, args, runs, folder, backwards=number % 2 == 1))
    results |= rounds[-1]  # the last round's runs and ratios at the top, as with one round
    if len(rounds) > 1:
        results["rounds"] = rounds
        results["median_ratios"] = {
            key: round(statistics.median(r["ratios"][key] for r in rounds), 3)
            for key in rounds[0]["ratios"]
        }
        print("median", json.dumps(results["median_ratios"], indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
