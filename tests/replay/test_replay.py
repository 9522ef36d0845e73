"""chatctx replay and tune: formats, modes, bad input, outputs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from chatctx.cli import cli
from chatctx.errors import ImportFormatError
from chatctx.replay import ReplayConfig, Replayer, parse_logged, read_logs
from chatctx.store import Store
from chatctx.synthetic import support_conversation

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "data" / "support_logs.jsonl"


def sharegpt(conv: dict) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {
        "id": conv["id"],
        "probes": conv["probes"],
        "conversations": [
            {"from": names[m["role"]], "value": m["content"]} for m in conv["messages"]
        ],
    }


def test_both_formats_parse_to_the_same_conversation() -> None:
    conv = support_conversation(12, seed=1)
    a = parse_logged(json.dumps(conv), line=1)
    b = parse_logged(json.dumps(sharegpt(conv)), line=2)
    assert a.messages == b.messages and a.system_prompt == b.system_prompt
    assert a.probes == b.probes and len(a.turns()) == 12


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "not valid JSON"),
        ('{"id": 1, "messages": [{"role": "wizard", "content": "x"}]}', "unknown role 'wizard'"),
        ('{"id": 1, "conversations": [{"from": "alien", "value": "x"}]}', "unknown role 'alien'"),
        ('{"id": 1, "messages": [{"role": "system", "content": "only"}]}', "empty conversation"),
        ('{"id": 1, "messages": []}', "empty conversation"),
        ('{"id": 1}', r'"messages" \(OpenAI\) or "conversations"'),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "logs.jsonl"
    path.write_text(json.dumps(support_conversation(3, seed=2)) + "\n" + line + "\n")
    with pytest.raises(ImportFormatError, match=message) as info:
        list(read_logs([str(path)]))
    assert str(info.value).startswith(f"{path}:2:")
    errors: list[ImportFormatError] = []
    assert len(list(read_logs([str(path)], on_error="skip", errors=errors))) == 1
    assert len(errors) == 1 and errors[0].line == 2


def test_invalid_utf8_and_gzip(tmp_path: Path) -> None:
    good = json.dumps(support_conversation(3, seed=3)).encode()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(good + b"\n" + b'{"id": "\xff\xfe"}\n')
    with pytest.raises(ImportFormatError, match=r"bad.jsonl:2: invalid UTF-8"):
        list(read_logs([str(bad)]))
    packed = tmp_path / "logs.jsonl.gz"
    with gzip.open(packed, "wb") as f:
        f.write(good + b"\n")
    assert [c.id for c in read_logs([str(packed)])] == ["synthetic-3"]


def test_dry_run_matches_the_engine(tiny_llama3_path: Path) -> None:
    conv = parse_logged(json.dumps(support_conversation(50, seed=4)), line=1)
    results = {}
    for mode in ("dry", "teacher"):
        with Replayer(ReplayConfig(mode=mode, budget=400), model=tiny_llama3_path) as replayer:
            report = replayer.replay(conv)
        results[mode] = [
            (
                t.prompt_tokens,
                t.new_tokens,
                t.reused_tokens,
                t.evaluated_tokens,
                t.evicted_tokens,
                t.shifted_tokens,
            )
            for t in report.turns
        ]
        assert report.probes == 5
    assert results["dry"] == results["teacher"]
    assert any(row[5] for row in results["dry"])  # shifts happened


def test_regenerate_measures_answer_retention(tiny_llama3_path: Path) -> None:
    conv = parse_logged(json.dumps(support_conversation(20, seed=5)), line=1)
    config = ReplayConfig(mode="regenerate", budget=600, max_tokens=8)
    with Replayer(config, model=tiny_llama3_path) as replayer:
        report = replayer.replay(conv)
    assert report.answer_probes == report.probes == 5
    assert 0 <= report.retained_in_answer <= 5  # random weights: the number, not its value
    assert all(t.ttft_ms is not None for t in report.turns)


def test_replay_cli_json_and_csv(tmp_path: Path, tiny_llama3_path: Path) -> None:
    csv_path = tmp_path / "turns.csv"
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            str(SAMPLE),
            "--model",
            str(tiny_llama3_path),
            "--budget",
            "512",
            "--json",
            "--csv",
            str(csv_path),
            "--max-turns",
            "30",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    required = {
        "conversation",
        "turn",
        "prompt_tokens",
        "reused_tokens",
        "evaluated_tokens",
        "new_tokens",
        "evicted_tokens",
        "shifted_tokens",
        "ttft_ms",
    }
    assert doc["turns"] and required <= set(doc["turns"][0])
    assert {
        "prefill_amplification",
        "cache_hit_ratio",
        "turns",
        "conversations",
        "fact_retention",
    } <= set(doc["summary"])
    assert doc["summary"]["conversations"] == 4 and doc["summary"]["turns"] == 120
    assert csv_path.read_text().splitlines()[0].startswith("conversation,turn,prompt_tokens")
    assert len(csv_path.read_text().splitlines()) == 121


def test_replay_stdin_dry_run_and_text_output(tiny_llama3_path: Path) -> None:
    text = json.dumps(support_conversation(30, seed=6)) + "\n"
    result = CliRunner().invoke(
        cli,
        ["replay", "-", "--dry-run", "--model", str(tiny_llama3_path), "--budget", "300"],
        input=text,
    )
    assert result.exit_code == 0, result.output
    assert "per-turn" in result.output and "overall" in result.output


def test_replay_failure_keeps_results_so_far(tmp_path: Path, tiny_llama3_path: Path) -> None:
    path = tmp_path / "logs.jsonl"
    path.write_text(json.dumps(support_conversation(5, seed=7)) + "\n{broken\n")
    args = ["replay", str(path), "--dry-run", "--model", str(tiny_llama3_path), "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    doc = json.loads(result.output[: result.output.rindex("}") + 1])
    assert doc["summary"]["turns"] == 5  # the first conversation's results were written
    assert f"{path}:2: not valid JSON" in result.output
    skipped = CliRunner().invoke(cli, [*args, "--on-error", "skip"])
    assert skipped.exit_code == 0
    assert json.loads(skipped.output)["errors"] == [
        f"{path}:2: not valid JSON (Expecting property name enclosed in double quotes at column 2)"
    ]


def test_replay_from_db(db_url: str, tiny_llama3_path: Path) -> None:
    runner = CliRunner()
    with Store(db_url) as store:
        store.create_conversation("c1", system_prompt="Be kind.")
        store.add_messages(
            "c1",
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "order NH-1?"},
            ],
        )
    result = runner.invoke(
        cli,
        [
            "replay",
            "--from-db",
            "--db",
            db_url,
            "--dry-run",
            "--model",
            str(tiny_llama3_path),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["summary"]["turns"] == 2


def test_dry_run_rejects_llm_summarizer(tiny_llama3_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            str(SAMPLE),
            "--dry-run",
            "--summarizer",
            "llm",
            "--model",
            str(tiny_llama3_path),
        ],
    )
    assert result.exit_code == 1 and "cannot use the llm summarizer" in result.output


def test_tune_writes_table_plot_and_recommendation(tmp_path: Path, tiny_llama3_path: Path) -> None:
    out = tmp_path / "tune"
    result = CliRunner().invoke(
        cli,
        [
            "tune",
            str(SAMPLE),
            "--model",
            str(tiny_llama3_path),
            "--budgets",
            "384,768",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "tune.json").read_text())
    assert len(rows) == 4 and {r["policy"] for r in rows} == {"watermarks", "trim-every-turn"}
    assert all(r["fact_retention"] is not None for r in rows)
    png = (out / "tune.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "recommended" in result.output or "no setting meets" in result.output
    bad = CliRunner().invoke(cli, ["tune", str(SAMPLE), "--budgets", "x", "--out", str(out)])
    assert bad.exit_code == 1 and "--budgets must be integers" in bad.output
