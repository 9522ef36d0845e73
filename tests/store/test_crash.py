"""Interrupted and killed processes: what they had stored survives.

SIGTERM / SIGINT during a streamed reply of ``chatctx chat`` or ``chatctx demo`` (a real CLI
process on the tiny Llama 3 model): the user message is stored and the reply so far is stored
as ``partial``. Oracle: the database read back afterwards, and the reply text printed before
the signal, which the stored partial reply must start with.

kill -9 at random points (bench/crash_harness.py, a smaller count): every user message whose
reply had started is in the database (read with sqlite3 here, not through chatctx), SQLite's
integrity check is ok and the conversation goes on.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chatctx.cli._signals import interruptible
from chatctx.store import Store

ROOT = Path(__file__).resolve().parents[2]
USER_TEXT = "hello, is my order 1234 on its way?"


class Output:
    """A child's stdout, read as it arrives."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.data = b""
        assert process.stdout is not None
        self._fd = process.stdout.fileno()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while chunk := os.read(self._fd, 4096):
            self.data += chunk

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")

    def wait_for_reply(self, marker: str, chars: int = 60, timeout: float = 120) -> str:
        """Wait until ``chars`` characters of the reply are printed after ``marker``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text()
            if marker in text and len(text.split(marker, 1)[1]) >= chars:
                return text.split(marker, 1)[1]
            time.sleep(0.02)
        raise AssertionError(f"no reply streamed within {timeout} s: {self.text()[-500:]!r}")


def _alnum(text: str) -> str:
    # The terminal output and the stored text compared on what no console rewrites.
    return "".join(c for c in text if c.isascii() and c.isalnum())


def _start(command: str, model: Path, url: str) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "chatctx", command, "--model", str(model), "--db", url]
    args += ["--max-tokens", "1500"]
    if command == "chat":
        args += ["-c", "sig"]
    return subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        # A test run in the background ignores SIGINT, and children inherit that: undo it,
        # as a terminal would have it.
        preexec_fn=_default_signals,
    )


def _default_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", ["chat", "demo"])
def test_signal_during_a_reply_stores_it_as_partial(
    tiny_llama3_path: Path, db_url: str, command: str, signum: int
) -> None:
    process = _start(command, tiny_llama3_path, db_url)
    out = Output(process)
    assert process.stdin is not None
    if command == "chat":
        process.stdin.write(f"{USER_TEXT}\n".encode())
        process.stdin.flush()
        marker = "> "
    else:
        marker = "assistant: "
    printed = out.wait_for_reply(marker)
    process.send_signal(signum)
    if command == "chat" and signum == signal.SIGINT:
        # Ctrl-C ends the reply, not the REPL: it asks for the next message.
        out.wait_for_reply("[interrupted]", chars=3, timeout=60)
        process.stdin.write(b"/quit\n")
        process.stdin.flush()
    process.stdin.close()
    code = process.wait(timeout=60)
    assert process.stderr is not None
    stderr = process.stderr.read().decode()
    assert "Traceback" not in stderr, stderr
    if signum == signal.SIGTERM:
        expected_code = 128 + signal.SIGTERM
    else:  # the REPL goes on after Ctrl-C; the demo aborts (click: status 1)
        expected_code = 0 if command == "chat" else 1
    assert code == expected_code, (code, stderr)

    with Store(db_url) as store:
        (conversation,) = store.list_conversations()
        messages = store.messages(conversation.id)
        turns = store.turns(conversation.id)
    user, reply = messages[-2:]
    assert user.role == "user"
    if command == "chat":
        assert user.content == USER_TEXT
    assert reply.role == "assistant"
    assert reply.status == "partial"
    # What was on screen before the signal is the start of what was stored.
    assert _alnum(printed)
    assert _alnum(reply.content).startswith(_alnum(printed)[:12])
    assert turns[-1].stop_reason == "interrupted"
    assert turns[-1].assistant_message_id == reply.id


def test_a_signal_during_the_unwinding_waits_until_rearmed() -> None:
    # The first signal raises; a second one must not abort the partial reply's store write,
    # so it is held back and raised by rearm(). SIGTERM then exits with 128 + 15.
    steps: list[str] = []
    with pytest.raises(SystemExit) as exit_info, interruptible() as interrupts:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # held back: nothing raised while "storing"
        steps.append("stored")
        interrupts.rearm()
        steps.append("not reached")
    assert steps == ["stored"]
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored


@pytest.mark.slow
def test_kill_9_at_random_points(tiny_llama3_path: Path, tmp_path: Path) -> None:
    db_path = tmp_path / "crash.db"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "crash_harness.py"),
            "--kills",
            "12",
            "--turns",
            "3",
            "--max-tokens",
            "128",
            "--model",
            str(tiny_llama3_path),
            "--db",
            f"sqlite:///{db_path}",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    figures = json.loads(result.stdout)
    assert figures["errors"] == [], figures["errors"]
    assert result.returncode == 0, result.stderr
    assert figures["kills"] == 12
    assert figures["user_expected"] > 0
    assert figures["missing"] == []
    assert figures["integrity_ok"] == figures["positions_ok"] == figures["rounds"] >= 12
    assert figures["final_turn_complete"]
    # Independently of the harness: the database it leaves behind.
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = conn.execute(
            "SELECT position, role, content, status FROM messages ORDER BY position"
        ).fetchall()
    conn.close()
    assert [r[0] for r in rows] == list(range(len(rows)))
    users = [r[2] for r in rows if r[1] == "user"]
    assert len(users) == len(set(users)) == figures["user_messages_total"]
    # The final, unkilled turn is the last exchange and is complete.
    assert rows[-2][1:3] == ("user", users[-1]) and users[-1].startswith("final-0:")
    assert rows[-1][1] == "assistant" and rows[-1][3] == "complete"
