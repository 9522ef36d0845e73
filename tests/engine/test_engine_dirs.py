"""Two engines under one CHATCTX_HOME (two bot processes) keep their swapped states apart.

Oracle: the turn records' ``swap_in`` (a disk restore, or nothing: a re-prefill) and the
files on disk. Both processes serve conversations with the same ids, as two workers of one
bot do; before, they shared ``$CHATCTX_HOME/kv`` and each overwrote, took and trimmed the
other's files, so its customers came back to nothing and were prefilled again.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

from chatctx import ChatSession, Engine
from chatctx.backends.engine._instance import live_directories
from chatctx.store import Store

ROUNDS = 4
CUSTOMERS = ("c0", "c1", "c2")


def _serve(home: str, model: str, start: Any, finish: Any, out: Any) -> None:
    os.environ["CHATCTX_HOME"] = home
    swaps: list[tuple[str, int, str | None, str | None]] = []
    # One slot and no RAM for swaps: every change of customer goes through a file.
    with (
        Engine.load(model, n_ctx=256, slots=1, swap_ram_mb=0) as engine,
        Store("sqlite://") as store,
    ):
        start.wait(60)
        for r in range(ROUNDS):
            for cid in CUSTOMERS:
                with ChatSession.open(
                    store,
                    conversation_id=cid,
                    model=engine,
                    settings={"max_tokens": 2, "temperature": 0.0},
                ) as chat:
                    turn = chat.send(f"round {r} from {os.getpid()}").turn
                    assert turn is not None
                    swaps.append((cid, r, turn.swap_in, turn.reprefill_reason))
        # Both run until both are done: an engine that closed early is gone, and the other
        # would rightly adopt its states for conversations new to it (a restart's path).
        finish.wait(120)
    out.put(swaps)


def test_two_processes_with_one_home_keep_their_swapped_states(
    tmp_path: Path, tiny_llama3_path: Path
) -> None:
    home = tmp_path / "shared-home"
    context = multiprocessing.get_context("spawn")
    start, finish, out = context.Barrier(2), context.Barrier(2), context.Queue()
    workers = [
        context.Process(target=_serve, args=(str(home), str(tiny_llama3_path), start, finish, out))
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    results = [out.get(timeout=300) for _ in workers]
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0, 0]
    for swaps in results:
        later = [(cid, r, where, why) for cid, r, where, why in swaps if r > 0]
        # Every customer coming back found its own state on disk: none was prefilled again.
        assert later == [(cid, r, "disk", None) for cid, r, _, _ in later]
        assert len(later) == (ROUNDS - 1) * len(CUSTOMERS)
    # Both closed: their states stay for the next run, in directories nobody holds.
    assert live_directories(home / "engines") == []
    assert len(list((home / "engines").glob("*/kv/*.kv"))) == 2 * len(CUSTOMERS)


def test_a_restarted_engine_adopts_the_states_of_the_one_before(
    tmp_path: Path, tiny_llama3_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'bot.db'}"
    options: dict[str, Any] = {"n_ctx": 256, "slots": 1}
    settings = {"max_tokens": 2, "temperature": 0.0}
    with (
        Engine.load(tiny_llama3_path, **options) as first,
        ChatSession.open(store_url, conversation_id="a", model=first, settings=settings) as a,
    ):
        a.send("hello from a")
    # The first engine's directory is let go at close, with a's state in it.
    assert len(list((tmp_path / "home" / "engines").glob("*/kv/*.kv"))) == 1
    with Engine.load(tiny_llama3_path, **options) as second:
        with ChatSession.open(store_url, conversation_id="a", model=second) as a:
            turn = a.send("and again").turn
        assert turn is not None and turn.swap_in == "disk" and turn.reprefill_reason is None
        assert turn.reused_tokens > 0
