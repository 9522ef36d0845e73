"""Every example runs as written (in a fast form: the tiny model, few tokens)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout + result.stderr


def test_support_bot(tmp_path: Path, tiny_llama3_path: Path) -> None:
    out = run(
        "support_bot.py",
        "--model",
        str(tiny_llama3_path),
        "--max-tokens",
        "4",
        "--n-ctx",
        "512",
        "--db",
        f"sqlite:///{tmp_path / 'bot.db'}",
        cwd=tmp_path,
    )
    assert "[cust-42]" in out and "[cust-77]" in out
    assert "cust-42 turn" in out and "reused" in out  # the KV figures are logged per turn


def test_tune_budget(tmp_path: Path, tiny_llama3_path: Path) -> None:
    out = run(
        "tune_budget.py",
        "--model",
        str(tiny_llama3_path),
        "--budgets",
        "384,768",
        "--out",
        str(tmp_path / "t"),
        cwd=tmp_path,
    )
    assert "objective" in out and (tmp_path / "t" / "tune.png").stat().st_size > 10_000


@pytest.mark.parametrize("mode", [["--dry-run"], []])
def test_replay_logs(tmp_path: Path, tiny_llama3_path: Path, mode: list[str]) -> None:
    out = run("replay_logs.py", "--model", str(tiny_llama3_path), *mode, cwd=tmp_path)
    assert "overall: amplification" in out and "costliest turn" in out
