"""Every test here runs on SQLite and on PostgreSQL (``db_url``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import DATABASES, any_db_url


@pytest.fixture(params=DATABASES)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return any_db_url(request, tmp_path)
