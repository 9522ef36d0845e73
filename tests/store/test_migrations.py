import json
import subprocess
import sys
import zipfile
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy import Engine, inspect

from chatctx.cli import cli
from chatctx.store import Store, create_db_engine, current_revision, head_revision, upgrade
from chatctx.store._migrate import _config
from chatctx.store._models import Base
from chatctx.store.search import include_name

ROOT = Path(__file__).resolve().parents[2]


def test_upgrade_from_empty_equals_orm_metadata(db_url: str) -> None:
    engine = create_db_engine(db_url)
    assert current_revision(engine) is None
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_name": include_name})
        diff = compare_metadata(context, Base.metadata)
    engine.dispose()
    assert diff == []


def test_opening_a_store_upgrades_it(db_url: str) -> None:
    Store(db_url).close()
    engine = create_db_engine(db_url)
    assert current_revision(engine) == head_revision()
    engine.dispose()


def test_migrations_work_from_an_installed_wheel(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
    )
    wheel = next((tmp_path / "dist").glob("chatctx-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "chatctx/_migrations/env.py" in names
        assert any(n.startswith("chatctx/_migrations/versions/0001") for n in names)
        zf.extractall(tmp_path / "site")
    code = (
        "import chatctx.store as s, sys;"
        "assert s.migrations_dir().name == '_migrations', s.migrations_dir();"
        f"st = s.Store('sqlite:///{tmp_path / 'w.db'}'); st.close();"
        f"e = s.create_db_engine('sqlite:///{tmp_path / 'w.db'}');"
        "print(s.current_revision(e))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin"},
    )
    assert out.stdout.strip() == head_revision()


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_downgrade_to_base_and_upgrade_again(db_url: str) -> None:
    engine = create_db_engine(db_url)
    try:
        upgrade(engine)
        orm_tables = set(Base.metadata.tables)
        assert orm_tables <= _tables(engine)
        with Store(db_url) as store:  # a row in every table that goes, through the store
            store.create_conversation("c")
            (m,) = store.add_messages("c", [{"role": "user", "content": "kept?"}])
            store.put_token_counts("tok", {m.id: 3})
            store.put_embeddings("emb", {m.id: ("0" * 64, 1, b"\0\0\0\0")})
            store.save_context_state("c", window_start=1)
        with engine.begin() as conn:
            command.downgrade(_config(conn), "base")
        assert current_revision(engine) is None
        assert _tables(engine) == set()  # every table and index is gone
        with engine.begin() as conn:
            command.upgrade(_config(conn), "head")
        assert current_revision(engine) == head_revision()
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"include_name": include_name})
            assert compare_metadata(context, Base.metadata) == []
        with Store(db_url) as store:
            assert store.list_conversations() == []
    finally:
        engine.dispose()


def test_each_step_down_and_up_keeps_the_schema(db_url: str) -> None:
    # 0008 -> 0007 -> ... -> 0001 and back, one revision at a time.
    engine = create_db_engine(db_url)
    try:
        upgrade(engine)
        revisions = [f"{n:04d}" for n in range(int(head_revision() or "0"), 0, -1)]
        for target in [*revisions[1:], "base"]:
            with engine.begin() as conn:
                command.downgrade(_config(conn), "-1")
            assert current_revision(engine) == (None if target == "base" else target)
        for target in reversed(revisions):
            with engine.begin() as conn:
                command.upgrade(_config(conn), "+1")
            assert current_revision(engine) == target
    finally:
        engine.dispose()


def test_cli_db_upgrade_and_current(db_url: str) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["db", "current", "--db", db_url, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {
        "current": None,
        "head": head_revision(),
        "up_to_date": False,
    }
    result = runner.invoke(cli, ["db", "upgrade", "--db", db_url, "--revision", "0006"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "empty -> 0006"
    result = runner.invoke(cli, ["db", "upgrade", "--db", db_url])
    assert result.output.strip() == f"0006 -> {head_revision()}"
    result = runner.invoke(cli, ["db", "current", "--db", db_url])
    assert (
        result.output.strip()
        == f"current: {head_revision()}  head: {head_revision()}  (up to date)"
    )
    engine = create_db_engine(db_url)
    try:
        assert current_revision(engine) == head_revision()  # the database itself says so
    finally:
        engine.dispose()
