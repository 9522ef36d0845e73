"""A real ``chatctx serve`` process on a free port, and what tests read back from it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from chatctx.store import Store

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """``python -m chatctx serve`` as a subprocess; stderr (the access log) goes to a file."""

    def __init__(
        self,
        tmp: Path,
        model: Path,
        *args: str,
        keys: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db_url = f"sqlite:///{tmp / 'serve.db'}"
        self.log_path = tmp / "serve.log"
        command = [
            sys.executable,
            "-m",
            "chatctx",
            "serve",
            "--port",
            str(self.port),
            "--model",
            str(model),
            "--db",
            self.db_url,
            *args,
        ]
        if keys is not None:
            keys_file = tmp / "keys.json"
            keys_file.write_text(json.dumps(keys))
            command += ["--api-keys", str(keys_file)]
        environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            command, cwd=tmp, env=environment, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"chatctx serve exited {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"chatctx serve not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def access_log(self) -> list[dict[str, Any]]:
        entries = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                entries.append(json.loads(line))
        return entries

    def store(self) -> Store:
        return Store(self.db_url)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Any]:
    """``start_server(model, *args, keys=...)``: a server stopped (SIGTERM) after the test."""
    started: list[ServerProcess] = []

    def start(model: Path, *args: str, **kwargs: Any) -> ServerProcess:
        folder = tmp_path / f"server{len(started)}"
        folder.mkdir()
        server = ServerProcess(folder, model, *args, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def tiny_server(
    tiny_llama3_path: Path, embedder_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One tiny-model server for a whole module (4 slots of 512 tokens, no keys)."""
    folder = tmp_path_factory.mktemp("tiny-server")
    server = ServerProcess(
        folder,
        tiny_llama3_path,
        "--n-ctx",
        "512",
        "--slots",
        "4",
        env={"CHATCTX_HOME": str(folder / "home"), "CHATCTX_EMBEDDER": str(embedder_path)},
    )
    yield server
    server.stop()
