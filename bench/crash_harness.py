"""Crash harness: kill -9 a process streaming replies into a store, again and again.

    .venv/bin/python bench/crash_harness.py [--kills 100] [--turns 4] [--max-tokens 128]
                                            [--model GGUF] [--db URL] [--seed 0] [--json]

Each round starts a child that opens a ``ChatSession`` on one SQLite file and conversation
(the tiny random-weight Llama 3 model unless ``--model``) and streams several turns with a long
``max_tokens``; the parent sends it SIGKILL after a random delay: most rounds at a random time
after the child is ready (prefill, streaming, storing, between turns), some while it starts
(model load, store open). The child prints ``STARTED <message>`` after a reply's first chunk.

After every kill, checked with sqlite3 directly (not through chatctx): every user message whose
reply had started is stored, ``PRAGMA integrity_check`` is ok, positions are 0..n-1. The next
round's child must send a turn on the same conversation; a last child, not killed, must finish
one. Any child that exits by itself with an error fails the run. Prints the figures (exit
status 1 when a check failed).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONVERSATION = "crash"
STARTED = "STARTED "
DONE = "DONE "
READY = "READY"


# child ----------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """Stream ``args.turns`` turns, printing a marker line after each reply's first chunk."""
    from chatctx import ChatSession

    with ChatSession.open(
        args.db,
        conversation_id=CONVERSATION,
        model=args.model,
        system_prompt="You are a support bot.",
        settings={"max_tokens": args.max_tokens, "temperature": 0.8, "seed": args.seed},
        engine_options={"n_ctx": args.n_ctx, "n_threads": args.n_threads},
    ) as chat:
        print(READY, flush=True)
        for turn in range(args.turns):
            text = f"{args.tag}-{turn}: where is order {args.seed * 100 + turn}?"
            started = False
            stream = chat.stream(text)
            try:
                for _chunk in stream:
                    if not started:
                        print(STARTED + text, flush=True)
                        started = True
            finally:
                stream.close()
            reason = chat.last_reply.stop_reason if chat.last_reply else "-"
            print(f"{DONE}{text} {reason}", flush=True)


# parent ---------------------------------------------------------------------------------------


@dataclass
class Figures:
    rounds: int = 0
    kills: int = 0
    kills_at_startup: int = 0
    kills_while_streaming: int = 0
    child_errors: int = 0
    user_expected: int = 0  # user messages whose reply had started
    user_stored: int = 0  # of those, found in the database
    user_messages_total: int = 0
    integrity_ok: int = 0
    positions_ok: int = 0
    turns_continued: int = 0  # rounds after a kill whose child started a turn
    rounds_after_kill: int = 0
    final_turn_complete: bool = False
    missing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.child_errors == 0
            and self.user_stored == self.user_expected
            and self.integrity_ok == self.rounds
            and self.positions_ok == self.rounds
            and self.final_turn_complete
        )


class Child:
    """A child process and the marker lines it printed (read on a thread, timestamped)."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.ready_at: float | None = None
        self.stderr = ""
        self._out = threading.Thread(target=self._read_stdout, daemon=True)
        self._err = threading.Thread(target=self._read_stderr, daemon=True)
        self._out.start()
        self._err.start()

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(READY):
                self.ready_at = time.perf_counter()
                self.ready.set()
        self.ready.set()  # exited

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        self.stderr = self.process.stderr.read()

    def kill(self) -> bool:
        """SIGKILL it if it is still running; True if it was."""
        if self.process.poll() is not None:
            return False
        self.process.send_signal(signal.SIGKILL)
        return True

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self._out.join(timeout=10)
        self._err.join(timeout=10)
        return code

    def marked(self, marker: str) -> list[str]:
        return [line[len(marker) :] for line in self.lines if line.startswith(marker)]


def _check_database(path: Path) -> tuple[bool, bool, set[str]]:
    """(integrity ok, positions 0..n-1, stored user texts), read with sqlite3 directly."""
    with sqlite3.connect(path, timeout=30) as conn:
        integrity = conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = conn.execute(
            "SELECT position, role, content FROM messages WHERE conversation_id = ? "
            "ORDER BY position",
            (CONVERSATION,),
        ).fetchall()
    conn.close()
    positions = [r[0] for r in rows] == list(range(len(rows)))
    return integrity, positions, {r[2] for r in rows if r[1] == "user"}


def _child_command(args: argparse.Namespace, tag: str, seed: int, turns: int) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "child",
        "--model",
        str(args.model),
        "--db",
        args.db,
        "--tag",
        tag,
        "--seed",
        str(seed),
        "--turns",
        str(turns),
        "--max-tokens",
        str(args.max_tokens),
        "--n-ctx",
        str(args.n_ctx),
        "--n-threads",
        str(args.n_threads),
    ]


def run(args: argparse.Namespace) -> Figures:
    """Kill ``args.kills`` children at random points; check the database after each.

    A child that finishes its turns before its kill time makes the kill window shorter and
    adds a round (at most ``2 * kills`` rounds).
    """
    rng = random.Random(args.seed)
    figures = Figures()
    db_path = Path(args.db.removeprefix("sqlite:///"))
    expected: set[str] = set()
    t0 = time.perf_counter()
    # Calibration: how long a child takes to get ready and to stream one turn.
    probe = Child(_child_command(args, "probe", args.seed, 1))
    probe.ready.wait(timeout=300)
    t_ready = time.perf_counter() - t0
    code = probe.wait(timeout=600)
    if code != 0:
        raise SystemExit(f"calibration child failed ({code}):\n{probe.stderr}")
    t_turn = max(0.2, time.perf_counter() - t0 - t_ready)
    expected.update(probe.marked(STARTED))
    killed_before = False
    round_no = 0
    while figures.kills < args.kills and round_no < 2 * args.kills:
        round_no += 1
        figures.rounds += 1
        tag = f"r{round_no}"
        start = time.perf_counter()
        current = Child(_child_command(args, tag, args.seed + round_no + 1, args.turns))
        if rng.random() < args.startup_share:
            delay = rng.uniform(0.0, t_ready)  # while importing, loading or opening the store
            time.sleep(delay)
        else:
            current.ready.wait(timeout=300)
            # Within the time its turns take, so that most rounds end in a kill.
            time.sleep(rng.uniform(0.0, 0.9 * args.turns * t_turn))
        was_running = current.kill()
        code = current.wait(timeout=60)
        started = current.marked(STARTED)
        done = current.marked(DONE)
        if was_running:
            figures.kills += 1
            figures.kills_at_startup += READY not in current.lines
            figures.kills_while_streaming += len(started) > len(done)
        elif code != 0:
            figures.child_errors += 1
            figures.errors.append(f"round {round_no}: exit {code}: {current.stderr[-2000:]}")
        elif current.ready_at is not None:
            # It finished every turn before the kill: turns are quicker than estimated.
            t_turn = min(t_turn, (time.perf_counter() - current.ready_at) / args.turns)
        if killed_before:
            figures.rounds_after_kill += 1
            figures.turns_continued += bool(started)
        killed_before = was_running
        expected.update(started)
        integrity, positions, stored = _check_database(db_path)
        figures.integrity_ok += integrity
        figures.positions_ok += positions
        missing = sorted(expected - stored)
        figures.missing.extend(m for m in missing if m not in figures.missing)
        if args.verbose:
            print(
                f"round {round_no}: {time.perf_counter() - start:.1f} s, "
                f"{'killed' if was_running else f'exit {code}'}, started {len(started)}, "
                f"done {len(done)}, integrity {integrity}, missing {len(missing)}",
                file=sys.stderr,
                flush=True,
            )
    # The conversation must still take a turn after the last kill.
    last = Child(_child_command(args, "final", args.seed, 1))
    code = last.wait(timeout=600)
    figures.final_turn_complete = code == 0 and len(last.marked(DONE)) == 1
    if code != 0:
        figures.errors.append(f"final child: exit {code}: {last.stderr[-2000:]}")
    expected.update(last.marked(STARTED))
    integrity, positions, stored = _check_database(db_path)
    figures.user_expected = len(expected)
    figures.user_stored = len(expected & stored)
    figures.user_messages_total = len(stored)
    figures.seconds = time.perf_counter() - t0
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    kid = sub.add_parser("child", help="(internal) the process that gets killed")
    for p in (parser, kid):
        p.add_argument("--model", type=Path, default=None, help="GGUF (default: tiny Llama 3)")
        p.add_argument("--db", default=None, help="SQLite URL (default: a temporary file)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--turns", type=int, default=4, help="turns per child")
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--n-ctx", type=int, default=2048)
        # One thread: llama.cpp's spinning threads crawl on a loaded machine (a child streams
        # about 20x faster with one thread than with two on two busy cores).
        p.add_argument("--n-threads", type=int, default=1)
    kid.add_argument("--tag", required=True)
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument(
        "--startup-share", type=float, default=0.1, help="share of kills during start-up"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--verbose", action="store_true", help="one line per round on stderr")
    args = parser.parse_args()
    if args.mode == "child":
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from chatctx.testing import write_tiny_llama3

            args.model = write_tiny_llama3(Path(tmp) / "tiny-llama3.gguf")
        if args.db is None:
            args.db = f"sqlite:///{Path(tmp) / 'crash.db'}"
        figures = run(args)
    if args.json:
        print(json.dumps(asdict(figures) | {"ok": figures.ok}, indent=2))
    else:
        print(
            f"kills {figures.kills} of {figures.rounds} rounds ({figures.kills_at_startup} during "
            f"start-up, {figures.kills_while_streaming} while streaming) · user messages "
            f"expected {figures.user_expected}, stored {figures.user_stored} (all user "
            f"messages {figures.user_messages_total}) · integrity ok "
            f"{figures.integrity_ok}/{figures.rounds} · positions ok "
            f"{figures.positions_ok}/{figures.rounds} · turns continued "
            f"{figures.turns_continued}/{figures.rounds_after_kill} after a kill · final turn "
            f"{'complete' if figures.final_turn_complete else 'FAILED'} · child errors "
            f"{figures.child_errors} · {figures.seconds:.0f} s"
        )
        for error in figures.errors:
            print(error, file=sys.stderr)
        if figures.missing:
            print(f"missing user messages: {figures.missing}", file=sys.stderr)
    raise SystemExit(0 if figures.ok else 1)


if __name__ == "__main__":
    main()
