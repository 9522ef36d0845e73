"""Shared fixtures: an isolated CHATCTX_HOME per test, and real models built once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from chatctx.backends.engine import Engine
from chatctx.errors import StoreError
from chatctx.model.embedder import default_embedder_path
from chatctx.model.paths import default_model_path
from chatctx.testing import ThrowawayPostgres, create_database, drop_database, write_tiny_llama3

ROOT = Path(__file__).resolve().parent.parent
# Fetched assets (the Llama 3 vocabulary) outlive one test's CHATCTX_HOME.
os.environ.setdefault("CHATCTX_ASSETS", str(ROOT / ".cache" / "assets"))


@pytest.fixture(scope="session", autouse=True)
def _session_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # Session- and module-scoped engines are built before the per-test home below is set:
    # their swap files and slot table must not land in the developer's real home.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CHATCTX_HOME", str(tmp_path_factory.mktemp("session-home")))
        yield


@pytest.fixture(scope="session")
def embedder_path(_session_home: None) -> Path:
    # all-MiniLM-L6-v2, converted once from the wheel `make setup` installs (a missing wheel
    # is a failure, never a silent skip): recall by meaning is on by default.
    return default_embedder_path()


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embedder_path: Path) -> None:
    monkeypatch.setenv("CHATCTX_HOME", str(tmp_path / "home"))
    for name in ("CHATCTX_DB", "CHATCTX_MODEL", "CHATCTX_N_CTX", "CHATCTX_N_GPU_LAYERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CHATCTX_EMBEDDER", str(embedder_path))


@pytest.fixture(scope="session")
def tiny_llama3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama3(tmp_path_factory.mktemp("models") / "tiny-llama3.gguf")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    # Installed by `make setup`; a missing model is a failure, never a silent skip.
    return default_model_path()


@pytest.fixture(scope="session")
def llama3_engine(tiny_llama3_path: Path) -> Iterator[Engine]:
    with Engine.load(tiny_llama3_path, n_ctx=2048, n_seq_max=2) as engine:
        yield engine


@pytest.fixture(scope="session")
def smol_engine(smollm2_path: Path) -> Iterator[Engine]:
    with Engine.load(smollm2_path, n_ctx=2048) as engine:
        yield engine


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'chat.db'}"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file, for tests of what only SQLite has (PRAGMAs, FTS5, file locks)."""
    return f"sqlite:///{tmp_path / 'chat.db'}"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """The URL of a PostgreSQL server that test databases are made on.

    ``CHATCTX_TEST_PG`` names one (any database on it; the role needs CREATEDB); otherwise a
    throwaway cluster is started from the installed server binaries. No PostgreSQL at all is
    a failure of every test that needs it, never a skip.
    """
    url = os.environ.get("CHATCTX_TEST_PG")
    if url:
        yield url
        return
    try:
        server = ThrowawayPostgres().start()
    except StoreError as exc:
        pytest.fail(f"PostgreSQL is needed for the store tests: {exc}", pytrace=False)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    url = create_database(pg_server)
    yield url
    drop_database(pg_server, str(make_url(url).database))


DATABASES = ["sqlite", "postgresql"]


def any_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL for the ``DATABASES`` parameter of ``request``: a SQLite file or a fresh
    PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'chat.db'}"
    return str(request.getfixturevalue("pg_url"))
