"""Start and stop a local ``llama-server`` process (tests, demos, benchmarks).

The binary is ``CHATCTX_LLAMA_SERVER``, else ``llama-server`` on ``PATH``; the repository's
``scripts/install_llama_server.py`` builds one with portable CPU flags and prints its path
(``make setup`` does it and sets nothing globally: pass the path on). On Linux the server is
started with ``PR_SET_PDEATHSIG``: it is killed when the thread that started it ends (or its
process dies), so a killed test run leaves no server behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from chatctx.environment import variable
from chatctx.errors import BackendUnavailable, ConfigError

PR_SET_PDEATHSIG = 1


def find_llama_server() -> Path:
    """The llama-server binary: ``CHATCTX_LLAMA_SERVER``, else ``llama-server`` on PATH."""
    explicit = variable("CHATCTX_LLAMA_SERVER")
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"CHATCTX_LLAMA_SERVER={explicit} is not an executable file")
        return path
    found = shutil.which("llama-server")
    if found is None:
        raise ConfigError(
            "no llama-server: set CHATCTX_LLAMA_SERVER to the binary "
            "(`python scripts/install_llama_server.py` builds one and prints its path)"
        )
    return Path(found)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent(parent: int) -> None:
    # Runs in the child between fork and exec: SIGKILL when the parent goes.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class LlamaServerProcess:
    """A llama-server on ``127.0.0.1:port`` serving ``model``; a context manager.

    ``slots`` is ``-np`` and ``n_ctx`` the tokens of each slot (``-c`` is their product, as
    the server divides it); ``slot_save_path`` enables slot save/restore/erase, ``metrics``
    ``/metrics``. ``start()`` returns once ``/health`` answers 200 (``ready_s`` at most); the
    log is kept in ``log_path`` (its tail is in every start error).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        slots: int = 4,
        n_ctx: int = 2048,
        port: int | None = None,
        slot_save_path: str | Path | None = None,
        metrics: bool = True,
        threads: int | None = None,
        extra_args: Sequence[str] = (),
        binary: str | Path | None = None,
        log_path: str | Path | None = None,
        ready_s: float = 120.0,
    ) -> None:
        self.binary = Path(binary) if binary is not None else find_llama_server()
        self.model = Path(model)
        self.slots = slots
        self.n_ctx = n_ctx
        self.port = port or free_port()
        self.slot_save_path = None if slot_save_path is None else Path(slot_save_path)
        self.log_path = Path(log_path) if log_path is not None else None
        self.ready_s = ready_s
        args = [
            str(self.binary),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-m",
            str(self.model),
            "-np",
            str(slots),
            "-c",
            str(n_ctx * slots),
            "--no-webui",
        ]
        if threads is not None:
            args += ["-t", str(threads)]
        if metrics:
            args.append("--metrics")
        if self.slot_save_path is not None:
            self.slot_save_path.mkdir(parents=True, exist_ok=True)
            # The server joins the path and the file name as strings: keep the slash.
            args += ["--slot-save-path", str(self.slot_save_path) + os.sep]
        self.args = [*args, *extra_args]
        self.process: subprocess.Popen[bytes] | None = None
        self._log: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, wait: bool = True) -> LlamaServerProcess:
        """Start the server; with ``wait``, return once ``/health`` answers 200.

        The server dies with the *thread* that started it (that is how PR_SET_PDEATHSIG
        works): start it from a thread that outlives it, the main thread say.
        """
        if self.process is not None:
            return self
        log = self.log_path.open("ab") if self.log_path is not None else subprocess.DEVNULL
        parent = os.getpid()
        preexec = (lambda: _die_with_parent(parent)) if sys.platform == "linux" else None
        self.process = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )
        if log is not subprocess.DEVNULL:
            log.close()  # type: ignore[union-attr]
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        """Wait until ``/health`` answers 200 (``ready_s`` at most); the server is stopped and
        ``BackendUnavailable`` raised, with the log's tail, when it exits or stays unready."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.ready_s
        assert self.process is not None
        with httpx.Client(base_url=self.url, timeout=2.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise BackendUnavailable(
                        f"llama-server exited with {code} while starting: {self.log_tail()}",
                        backend=self.url,
                        reason="down",
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise BackendUnavailable(
                        f"llama-server not healthy after {self.ready_s} s: {self.log_tail()}",
                        backend=self.url,
                        reason="loading",
                    )
                time.sleep(0.1)

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server (a crash, for tests) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> LlamaServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
