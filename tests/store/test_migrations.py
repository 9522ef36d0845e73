import subprocess
import sys
import zipfile
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from chatctx.store import Store, create_db_engine, current_revision, head_revision, upgrade
from chatctx.store._models import Base
from chatctx.store._search import include_name

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
