"""Store benchmark (issue 24): the same replay and the same writers on SQLite and PostgreSQL.

    .venv/bin/python bench/store_bench.py [--chats 40] [--max-turns 60] [--writers 8]
        [--appends 200] [--pg URL]

A. Dry replays (tokenizer and template only, no weights; SmolLM2's tokenizer) of the 40 real
   chats of ``bench/facts/everyday_probes.jsonl.gz`` through ``ChatSession`` on a ``Store``
   (every read and write of a turn goes to the database: conversation, context state,
   window, token counts, recall by words, the user message, the reply and the turn record),
   once on a SQLite file and once on PostgreSQL, in one process one after the other: turns/s
   and the ratio.
B. ``--writers`` processes appending ``--appends`` messages each, at once (a barrier), to a
   conversation of their own and then all to one shared conversation: appends/s over the
   wall time of the slowest writer.

PostgreSQL is a throwaway cluster (``chatctx.testing.ThrowawayPostgres``: fsync on,
``synchronous_commit=off``) unless ``--pg`` names a server; SQLite is a WAL file in a
temporary directory (``synchronous=NORMAL``): the same durability, both lose at most the last
commits in an OS crash and neither is corrupted by one.
"""

from __future__ import annotations

import argparse
import gzip
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from multiprocessing.synchronize import Barrier
from pathlib import Path

from chatctx.model.codec import open_codec
from chatctx.model.paths import default_model_path
from chatctx.replay import LoggedConversation, ReplayConfig, Replayer, parse_logged, replay_all
from chatctx.store import Store
from chatctx.testing import ThrowawayPostgres, create_database

HERE = Path(__file__).resolve().parent
CHATS = HERE / "facts" / "everyday_probes.jsonl.gz"
SPAWN = multiprocessing.get_context("forkserver")


def load(count: int) -> list[LoggedConversation]:
    with gzip.open(CHATS, "rt", encoding="utf-8") as f:
        return [parse_logged(line, line=n) for n, line in enumerate(f, start=1)][:count]


def fresh_store(url: str) -> Callable[[str], Store]:
    Store(url).close()  # the schema, once

    def open_store(conversation_id: str) -> Store:
        store = Store(url)
        if store.has_conversation(conversation_id):
            store.delete_conversation(conversation_id)
        return store

    return open_store


def replay(url: str, chats: Sequence[LoggedConversation], max_turns: int) -> tuple[int, float]:
    """(user turns replayed, seconds)."""
    cfg = ReplayConfig(mode="dry", budget=1024, recall_search="words", max_turns=max_turns)
    codec = open_codec(default_model_path())
    errors: list[str] = []
    with Replayer(cfg, codec=codec, store=fresh_store(url)) as replayer:
        t0 = time.perf_counter()
        reports = replay_all(replayer, chats, errors=errors, on_error="skip")
        seconds = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"replay stopped: {errors[:3]}")
    return sum(len(r.turns) for r in reports), seconds


def _writer(url: str, cid: str, appends: int, barrier: Barrier, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with Store(url) as store:
        store.get_or_create_conversation(cid)
        barrier.wait()
        t0 = time.perf_counter()
        for index in range(appends):
            store.add_message(cid, "user", f"{cid} message {index} " + "words " * 20)
        out.put(time.perf_counter() - t0)


def writers(url: str, count: int, appends: int, shared: bool) -> float:
    """Appends per second of ``count`` concurrent writer processes."""
    Store(url).close()
    barrier = SPAWN.Barrier(count)
    out: multiprocessing.Queue = SPAWN.Queue()  # type: ignore[type-arg]
    tag = "shared" if shared else "own"
    processes = [
        SPAWN.Process(
            target=_writer,
            args=(url, f"{tag}" if shared else f"{tag}{w}", appends, barrier, out),
        )
        for w in range(count)
    ]
    for process in processes:
        process.start()
    times = [out.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"a writer failed ({process.exitcode})")
    return count * appends / max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=40)
    parser.add_argument("--max-turns", type=int, default=60, help="user turns per chat")
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--appends", type=int, default=200, help="per writer")
    parser.add_argument("--pg", default=None, help="a PostgreSQL server URL (default: throwaway)")
    args = parser.parse_args()
    chats = load(args.chats)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        # fsync on, commits not waiting for it: the durability of SQLite's WAL with
        # synchronous=NORMAL (an OS crash may lose the last commits, never corrupts).
        throwaway = ThrowawayPostgres(durable=True, settings={"synchronous_commit": "off"})
        server = args.pg or stack.enter_context(throwaway).url
        urls = {
            "SQLite": lambda name: f"sqlite:///{tmp / name}.db",
            "PostgreSQL": lambda name: create_database(server, f"store_bench_{name}"),
        }
        print(f"## A. dry replay of {len(chats)} chats, at most {args.max_turns} user turns each\n")
        print("| store | turns | s | turns/s |\n|---|---|---|---|")
        rates = {}
        for label, url in urls.items():
            turns, seconds = replay(url("replay"), chats, args.max_turns)
            rates[label] = turns / seconds
            print(f"| {label} | {turns} | {seconds:.1f} | {rates[label]:.1f} |", flush=True)
        print(f"\nPostgreSQL / SQLite turns/s: {rates['PostgreSQL'] / rates['SQLite']:.2f}")
        print(f"\n## B. {args.writers} writer processes x {args.appends} appends\n")
        print("| store | own conversations, appends/s | one shared conversation, appends/s |")
        print("|---|---|---|")
        for label, url in urls.items():
            own = writers(url("own"), args.writers, args.appends, shared=False)
            one = writers(url("shared"), args.writers, args.appends, shared=True)
            print(f"| {label} | {own:.0f} | {one:.0f} |", flush=True)


if __name__ == "__main__":
    main()
