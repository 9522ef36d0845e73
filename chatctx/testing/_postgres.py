"""A throwaway PostgreSQL server for tests and benchmarks (``chatctx.testing.ThrowawayPostgres``).

It runs a fresh cluster in a temporary directory on a free loopback port: ``initdb`` with trust
authentication for the local socket and 127.0.0.1 only, ``pg_ctl start``, and at the end
``pg_ctl stop`` and the directory removed. PostgreSQL refuses to run as root, so as root the
cluster belongs to the ``postgres`` system user (Debian's package creates it). A watchdog
process stops the cluster and removes its directory when the process that started it dies
without stopping it (``kill -9`` of a test run), so no server outlives its owner.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from chatctx.environment import variable
from chatctx.errors import StoreError

if TYPE_CHECKING:
    from sqlalchemy import Engine

# Where Debian and Ubuntu put the server binaries (not on PATH).
_DEBIAN_BINDIRS = "/usr/lib/postgresql/*/bin"
_SYSTEM_USER = "postgres"

_WATCHDOG = """
import os, shutil, subprocess, sys, time
parent, pg_ctl, data, root = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
prefix = sys.argv[5:]
while True:
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        break
    if not os.path.isdir(data):
        sys.exit(0)
    time.sleep(0.5)
subprocess.run([*prefix, pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
shutil.rmtree(root, ignore_errors=True)
"""


def find_postgres_bindir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or None.

    ``CHATCTX_PG_BINDIR`` when set (None if it lacks them); else ``pg_config --bindir``, then
    PATH, then Debian's ``/usr/lib/postgresql/<version>/bin`` (newest version first).
    """
    names = ("initdb", "pg_ctl", "postgres")
    bindir = variable("CHATCTX_PG_BINDIR")
    if bindir:  # given: that one or none
        given = Path(bindir)
        return given if all((given / name).is_file() for name in names) else None
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).parent)

    def version(path: str) -> tuple[int, ...]:
        digits = Path(path).parent.name
        return tuple(int(p) for p in digits.split(".") if p.isdigit())

    candidates += [Path(p) for p in sorted(glob.glob(_DEBIAN_BINDIRS), key=version, reverse=True)]
    for candidate in candidates:
        if all((candidate / name).is_file() for name in names):
            return candidate
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayPostgres:
    """A PostgreSQL cluster that exists while this context manager is open.

    ``url`` is a SQLAlchemy URL (``postgresql+psycopg://postgres@127.0.0.1:PORT/postgres``);
    ``create_database()`` makes a fresh, empty database and returns its URL. ``durable=False``
    (the default) turns fsync off: fast, and fine for data that is thrown away; ``settings``
    are more server settings (``{"synchronous_commit": "off"}``). Raises
    ``StoreError`` when no PostgreSQL server binaries are installed.
    """

    def __init__(
        self,
        *,
        bindir: Path | None = None,
        durable: bool = False,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        found = bindir or find_postgres_bindir()
        if found is None:
            raise StoreError(
                "no PostgreSQL server found (initdb, pg_ctl, postgres): install it "
                "(apt-get install postgresql), set CHATCTX_PG_BINDIR, or point the tests at a "
                "server with CHATCTX_TEST_PG=postgresql+psycopg://..."
            )
        self.bindir = found
        self.durable = durable
        self.settings = dict(settings or {})
        self.port = 0
        self.root: Path | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None

    @property
    def _prefix(self) -> list[str]:
        # initdb and postgres refuse to run as root: run them as the postgres system user.
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            return ["runuser", "-u", _SYSTEM_USER, "--"]
        return []

    @property
    def data_dir(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        result = subprocess.run([*self._prefix, *args], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            log = ""
            if self.root is not None and (self.root / "server.log").is_file():
                log = (self.root / "server.log").read_text(errors="replace")[-2000:]
            raise StoreError(
                f"{Path(args[0]).name} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}\n{log}"
            )

    def start(self) -> ThrowawayPostgres:
        self.root = Path(tempfile.mkdtemp(prefix="chatctx-pg-"))
        try:
            if self._prefix:
                shutil.chown(self.root, user=_SYSTEM_USER)
            self._run(
                str(self.bindir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            )
            # Trust on the socket and loopback only; nothing listens anywhere else.
            (self.data_dir / "pg_hba.conf").write_text(
                "local all all trust\nhost all all 127.0.0.1/32 trust\n"
            )
            if self._prefix:
                shutil.chown(self.data_dir / "pg_hba.conf", user=_SYSTEM_USER)
            self._spawn_watchdog()
            options = [f"-c listen_addresses=127.0.0.1 -k {self.root} -c max_connections=300"]
            if not self.durable:
                options.append("-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
            options += [f"-c {name}={value}" for name, value in self.settings.items()]
            for attempt in range(5):
                self.port = _free_port()
                try:
                    self._run(
                        str(self.bindir / "pg_ctl"),
                        "-D",
                        str(self.data_dir),
                        "-l",
                        str(self.root / "server.log"),
                        "-o",
                        f"-p {self.port} " + " ".join(options),
                        "-w",
                        "-t",
                        "60",
                        "start",
                    )
                    break
                except StoreError:
                    if attempt == 4:  # the port was taken between the probe and the start
                        raise
            return self
        except BaseException:
            self.stop()
            raise

    def _spawn_watchdog(self) -> None:
        assert self.root is not None
        self._watchdog = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WATCHDOG,
                str(os.getpid()),
                str(self.bindir / "pg_ctl"),
                str(self.data_dir),
                str(self.root),
                *self._prefix,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C or kill of the test's process group spares it
        )

    def stop(self) -> None:
        """Stop the server and remove its directory (safe to call twice)."""
        root, self.root = self.root, None
        if root is None:
            return
        data = root / "data"
        if (data / "postmaster.pid").exists():
            subprocess.run(
                [
                    *self._prefix,
                    str(self.bindir / "pg_ctl"),
                    "-D",
                    str(data),
                    "-m",
                    "fast",
                    "-w",
                    "stop",
                ],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(root, ignore_errors=True)
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database; returns its SQLAlchemy URL."""
        return create_database(self.url, name)

    def __enter__(self) -> ThrowawayPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _admin(url: str) -> Engine:
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    try:
        return create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    except ImportError as exc:
        raise StoreError("PostgreSQL needs psycopg: pip install 'chatctx[postgres]'") from exc


def create_database(server_url: str, name: str | None = None) -> str:
    """Create an empty database on the server of ``server_url``; returns its URL."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    name = name or f"chatctx_{uuid.uuid4().hex[:12]}"
    if not name.replace("_", "").isalnum():
        raise StoreError(f"not a plain database name: {name!r}")
    engine = _admin(server_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE template0'))
    finally:
        engine.dispose()
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def drop_database(server_url: str, name: str) -> None:
    """Drop a database made by ``create_database`` (its open connections are ended)."""
    from sqlalchemy import text

    engine = _admin(server_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


def wait_gone(path: Path, timeout: float = 10.0) -> bool:
    """Whether ``path`` disappears within ``timeout`` seconds (a watchdog's cleanup)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not path.exists():
            return True
        time.sleep(0.1)
    return not path.exists()
