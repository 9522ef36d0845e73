"""chatctx.testing.ThrowawayPostgres: a real server that goes away with its owner, and a clear
failure (never a skip) when there is no PostgreSQL.

Oracles: the server's own answers over TCP (psql's exit status, the process table), the data
directory on disk, pytest's exit status and output in a child run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chatctx.errors import StoreError
from chatctx.testing import ThrowawayPostgres, find_postgres_bindir

ROOT = Path(__file__).resolve().parent.parent

OWNER = """
import sys, time
from chatctx.testing import ThrowawayPostgres
server = ThrowawayPostgres().start()
print(server.root, server.port, flush=True)
time.sleep(600)
"""


def _answers(port: int) -> bool:
    bindir = find_postgres_bindir()
    assert bindir is not None
    result = subprocess.run(
        [str(bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-t", "2"],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def test_the_server_stops_and_its_files_go_when_the_owner_is_killed() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert owner.stdout is not None
    root, port = owner.stdout.readline().split()
    assert Path(root, "data", "postmaster.pid").is_file()
    assert _answers(int(port))
    owner.send_signal(signal.SIGKILL)  # no cleanup code of the owner runs
    owner.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(root).exists():
        time.sleep(0.2)
    assert not Path(root).exists()
    assert not _answers(int(port))


def test_a_database_per_call_and_cleanup_on_exit() -> None:
    with ThrowawayPostgres() as server:
        first, second = server.create_database(), server.create_database()
        assert first != second and first.startswith("postgresql+psycopg://postgres@127.0.0.1:")
        root = server.root
        assert root is not None and root.exists()
    assert not root.exists()
    assert not _answers(server.port)


def test_no_server_binaries_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CHATCTX_PG_BINDIR", str(tmp_path))
    with pytest.raises(StoreError, match="no PostgreSQL server found"):
        ThrowawayPostgres()


def test_the_suite_fails_without_postgresql_instead_of_skipping(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CHATCTX_TEST_PG", "PYTEST_ADDOPTS")}
    env.update(CHATCTX_PG_BINDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/store/test_store.py::test_delete_cascades",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout[-2000:]
    assert "1 passed, 1 error" in result.stdout  # SQLite ran; PostgreSQL errored, no skip
    assert "PostgreSQL is needed for the store tests: no PostgreSQL server found" in result.stdout
