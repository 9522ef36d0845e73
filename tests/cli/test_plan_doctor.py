"""``chatctx plan`` and ``chatctx doctor`` driven through the CLI, against llama.cpp's own log."""

from __future__ import annotations

import csv
import json
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from chatctx.cli import cli
from chatctx.cli.doctor import child_check
from chatctx.store import Store
from chatctx.store._migrate import head_revision


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_plan_json_by_hand(tiny_llama3_path: Path) -> None:
    code, out = run(
        "plan", "--model", str(tiny_llama3_path), "--n-ctx", "1000", "--slots", "3", "--json"
    )
    assert code == 0, out
    plan = json.loads(out)
    # 3 slots x pad256(1000) + the summary room min(1024, 1792) = 4096 cells, each
    # 2 layers x 2 KV heads x (16 K + 16 V) values x 2 bytes
    assert plan["kv_cells"] == 4096 and plan["kv_bytes"] == 4096 * 2 * 2 * 32 * 2
    assert plan["measured_kv_bytes"] is None and plan["fits"] is True
    assert {"weights_bytes", "compute_bytes", "fits", "rope"} <= set(plan)


def test_plan_measure_matches_llama_cpp(tiny_llama3_path: Path) -> None:
    code, out = run(
        "plan",
        "-m",
        str(tiny_llama3_path),
        "--n-ctx",
        "700",
        "--slots",
        "2",
        "--split",
        "--measure",
        "--json",
    )
    assert code == 0, out
    plan = json.loads(out)
    assert plan["kv_cells"] == 3 * 768  # 2 slots + the summary stream, each pad256(700)
    assert abs(plan["kv_bytes"] - plan["measured_kv_bytes"]) <= 0.1 * plan["measured_kv_bytes"]
    assert (
        abs(plan["weights_bytes"] - plan["measured_weights_bytes"])
        <= 0.1 * plan["measured_weights_bytes"]
    )
    compute, measured = plan["compute_bytes"], plan["measured_compute_bytes"]
    assert abs(compute - measured) <= 0.1 * measured


def test_plan_that_does_not_fit_offers_what_would(tiny_llama3_path: Path) -> None:
    options = {"--model": str(tiny_llama3_path), "--n-ctx": "65536", "--slots": "4"}
    options["--ram"] = "300M"

    def args(opts: dict[str, str]) -> list[str]:
        return ["plan", *[x for item in opts.items() for x in item]]

    code, out = run(*args(options), "--json")
    plan = json.loads(out)
    assert code == 1 and plan["fits"] is False and plan["cpu_bytes"] > 300 * 2**20
    changes = [a["change"] for a in plan["alternatives"]]
    assert {c.split()[0] for c in changes} >= {"--n-ctx", "--slots", "--n-ubatch"}, changes
    for alternative in plan["alternatives"]:
        assert alternative["fits"] is True and alternative["cpu_bytes"] <= 300 * 2**20
        # Each is a real plan: asking for it says it fits.
        flag, value = alternative["change"].split()
        code, again = run(*args(options | {flag: value}), "--json")
        assert code == 0 and json.loads(again)["cpu_bytes"] == alternative["cpu_bytes"]
    assert any("exceeds the model's trained context 8192" in w for w in plan["warnings"])


def test_plan_refuses_quantized_v_without_flash_attention(tiny_llama3_path: Path) -> None:
    code, out = run("plan", "-m", str(tiny_llama3_path), "--type-v", "q8_0", "--flash-attn", "off")
    assert code == 1 and "needs flash attention" in out and "flash_attn is off" in out


def test_doctor_json_on_tiny_model(tiny_llama3_path: Path, db_url: str) -> None:
    with Store(db_url):
        pass  # create and migrate
    code, out = run("doctor", "--model", str(tiny_llama3_path), "--db", db_url, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] is True, out
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["decode"]["ok"] is True and checks["decode"]["data"]["prompt_tokens"] > 0
    assert checks["database"]["data"] == {"current": head_revision(), "head": head_revision()}
    assert checks["disk"]["data"]["free_bytes"] > 0
    assert "AVX" in checks["build"]["data"]["system_info"] or checks["build"]["data"]["features"]


def test_doctor_fails_on_a_missing_model(tmp_path: Path, db_url: str) -> None:
    code, out = run("doctor", "--model", str(tmp_path / "none.gguf"), "--db", db_url)
    assert code == 1 and "FAIL" in out and "not found" in out


@pytest.mark.parametrize(("sig", "name"), [(signal.SIGILL, "SIGILL"), (signal.SIGSEGV, "SIGSEGV")])
def test_crashing_child_is_reported_with_signal_and_remedy(sig: int, name: str) -> None:
    code = f"import os, signal; os.kill(os.getpid(), {int(sig)})"
    check = child_check("decode", [sys.executable, "-c", code], timeout=60)
    assert check.ok is False and check.data["returncode"] == -int(sig)
    assert name in check.detail
    assert check.remedy is not None and "make setup" in check.remedy
    assert "CHATCTX_LLAMA_BUILD=native" in check.remedy


@pytest.mark.slow  # two teacher-forced replays
def test_tune_by_micro_batch(tiny_llama3_path: Path, tmp_path: Path) -> None:
    logs = str(Path(__file__).resolve().parents[2] / "examples" / "data" / "support_logs.jsonl")
    code, out = run("tune", logs, "--n-ubatch", "64")
    assert code == 1 and "needs --with-model" in out
    code, out = run(
        "tune",
        logs,
        "--model",
        str(tiny_llama3_path),
        "--with-model",
        "--limit",
        "1",
        "--budgets",
        "256",
        "--n-ubatch",
        "32,128",
        "--out",
        str(tmp_path),
    )
    assert code == 0, out
    rows = list(csv.DictReader((tmp_path / "tune_ubatch.csv").open()))
    assert [int(r["n_ubatch"]) for r in rows] == [32, 128]
    assert all(
        float(r["prefill_tokens_per_s"]) > 0 and int(r["evaluated_tokens"]) > 0 for r in rows
    )
    # The planner's compute buffer for each size, as `chatctx plan` gives it
    for r in rows:
        code, planned = run(
            "plan",
            "-m",
            str(tiny_llama3_path),
            "--n-ctx",
            str(256 + 16),
            "--n-ubatch",
            r["n_ubatch"],
            "--json",
        )
        assert json.loads(planned)["compute_bytes"] == int(r["compute_bytes_planned"])
    assert "micro-batch" in out


def test_doctor_database_behind_head(db_url: str) -> None:
    from sqlalchemy import create_engine

    from chatctx.cli.doctor import database_check
    from chatctx.store._migrate import upgrade

    engine = create_engine(db_url)
    upgrade(engine, "0001")
    engine.dispose()
    check = database_check(db_url)
    assert check.ok is False and check.data["current"] == "0001"
    assert check.remedy == "run `chatctx db upgrade`"
