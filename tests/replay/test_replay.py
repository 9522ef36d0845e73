"""chatctx replay and tune: formats, modes, bad input, outputs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from chatctx import ChatSession, Engine, GenerationSettings
from chatctx.cli import cli
from chatctx.errors import ImportFormatError
from chatctx.replay import (
    ReplayConfig,
    Replayer,
    TurnReport,
    parse_logged,
    read_logs,
    replay_all,
)
from chatctx.store import Store
from chatctx.synthetic import support_conversation
from tests.llama_counters import counted, prime_counters

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


def test_teacher_forced_and_dry_runs_count_what_llama_cpp_evaluated(
    tiny_llama3_path: Path,
) -> None:
    # The oracle is llama.cpp's own count of the tokens it evaluated on each turn (one
    # sequence decodes, so the counters are attributable), not chatctx's plan.
    conv = parse_logged(json.dumps(support_conversation(50, seed=4)), line=1)
    config = ReplayConfig(mode="teacher", budget=400)
    counts: list[int] = []
    cells: list[int] = []
    with Engine.load(
        tiny_llama3_path, n_ctx=400 + config.reserve_tokens, n_seq_max=2, n_threads=1
    ) as engine:
        prime_counters(engine)
        seen = [counted(engine)]

        def on_turn(_turn: TurnReport) -> None:
            now = counted(engine)
            counts.append(now - seen[-1])
            seen.append(now)
            cells.append(engine.context.seq_pos_max(0) + 1)

        with Replayer(config, engine=engine) as replayer:
            teacher = replayer.replay(conv, on_turn=on_turn)
    with Replayer(config.model_copy(update={"mode": "dry"}), model=tiny_llama3_path) as replayer:
        dry = replayer.replay(conv)
    assert len(teacher.turns) == len(dry.turns) == len(counts) == 50
    # A teacher-forced prefill leaves exactly the prompt in llama.cpp's cache.
    assert [t.prompt_tokens for t in teacher.turns] == cells
    # Teacher-forced: the evaluated tokens reported are the ones llama.cpp evaluated.
    assert [t.evaluated_tokens for t in teacher.turns] == counts
    # Dry (no weights): the same figures, computed from the tokenizer alone.
    assert [t.prompt_tokens for t in dry.turns] == cells
    assert [t.evaluated_tokens for t in dry.turns] == counts
    assert [t.reused_tokens for t in dry.turns] == [
        c - n for c, n in zip(cells, counts, strict=True)
    ]
    assert [(t.evicted_tokens, t.shifted_tokens) for t in dry.turns] == [
        (t.evicted_tokens, t.shifted_tokens) for t in teacher.turns
    ]
    assert any(t.shifted_tokens for t in dry.turns)  # the shift path ran
    assert dry.probes == teacher.probes == 5


def test_regenerate_counts_the_answers_that_contain_the_fact(tiny_llama3_path: Path) -> None:
    # Oracle: a solo run of the same chat (greedy, same engine and settings) gives the replies
    # the replay will regenerate. Three probes ask for a piece of the reply the model gives at
    # that turn, two for text it never writes: exactly three answers contain their fact.
    base = support_conversation(20, seed=5)
    config = ReplayConfig(mode="regenerate", budget=600, max_tokens=8)
    asked_turns = [10, 12, 14, 16, 18]
    with Engine.load(
        tiny_llama3_path, n_ctx=600 + config.reserve_tokens, n_seq_max=2, n_threads=1
    ) as engine:
        conv = parse_logged(json.dumps(base), line=1)
        replies: list[str] = []
        with (
            Store("sqlite://") as store,
            ChatSession.open(
                store,
                conversation_id=conv.id,
                model=engine,
                system_prompt=conv.system_prompt,
                settings=GenerationSettings(max_tokens=8, temperature=0.0),
                context=config.session_context(),
            ) as chat,
        ):
            engine.clear()
            replies = [chat.send(user).text for user, _ in conv.turns()]
        # (The random-weight model's greedy replies are runs of newlines: a piece is one.)
        pieces = [replies[t][:4] for t in asked_turns[:3]]
        assert all(pieces)
        probes = [
            {"fact": fact, "asked_turn": turn}
            for fact, turn in zip(
                [*pieces, "never-written-1", "never-written-2"], asked_turns, strict=True
            )
        ]
        expected = sum(
            p["fact"].casefold() in replies[int(p["asked_turn"])].casefold() for p in probes
        )
        assert expected == 3
        probed = parse_logged(json.dumps(base | {"probes": probes}), line=1)
        with Replayer(config, engine=engine) as replayer:
            report = replayer.replay(probed)
    assert report.answer_probes == report.probes == 5
    assert report.retained_in_answer == expected
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


def table_cells(text: str, first: str) -> list[list[str]]:
    """The body rows of the text tables whose first cell is ``first``."""
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in text.splitlines()]
    return [r for r in rows if r and r[0] == first]


def test_replay_stdin_dry_run_and_text_output(tiny_llama3_path: Path) -> None:
    # The text tables print the figures of the same replay's JSON rows, turn by turn.
    text = json.dumps(support_conversation(30, seed=6)) + "\n"
    args = ["replay", "-", "--dry-run", "--model", str(tiny_llama3_path), "--budget", "300"]
    result = CliRunner().invoke(cli, args, input=text)
    assert result.exit_code == 0, result.output
    as_json = CliRunner().invoke(cli, [*args, "--json"], input=text)
    doc = json.loads(as_json.output)
    turns = table_cells(result.output, "synthetic-6")
    assert [[int(c) for c in row[1:3] + row[6:10]] for row in turns[:30]] == [
        [
            t["turn"],
            t["prompt_tokens"],
            t["reused_tokens"],
            t["evaluated_tokens"],
            t["evicted_tokens"],
            t["shifted_tokens"],
        ]
        for t in doc["turns"]
    ]
    (overall,) = table_cells(result.output, "overall")
    evaluated = sum(t["evaluated_tokens"] for t in doc["turns"])
    new = sum(t["new_tokens"] for t in doc["turns"])
    reused = sum(t["reused_tokens"] for t in doc["turns"])
    prompt = sum(t["prompt_tokens"] for t in doc["turns"])
    assert overall[1:5] == [
        "30",
        f"{evaluated / new:.2f}",
        f"{reused / prompt:.2f}",
        str(sum(t["evicted"] for t in doc["turns"])),
    ]


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


def test_llm_summaries_are_written_between_turns_and_across_conversations(
    tiny_llama3_path: Path,
) -> None:
    # A replay sends turns back to back; a person takes long enough to read and type for a
    # background summary to finish. By default the replay lets it finish, so the turn after
    # an eviction takes it. And a summary still running when a conversation ends must not
    # stop the next conversation (it did: "sequence 1 is in use by a running generation").
    conversations = [
        parse_logged(json.dumps(support_conversation(12, seed=s)), line=s) for s in (7, 8)
    ]
    config = ReplayConfig(mode="teacher", budget=300, summarizer="llm", summary_max_tokens=32)
    errors: list[str] = []
    with (
        Engine.load(tiny_llama3_path, n_ctx=1024, n_seq_max=2, n_threads=1) as engine,
        Replayer(config, engine=engine) as replayer,
    ):
        reports = replay_all(replayer, conversations, errors=errors, on_error="skip")
        spare = engine.spare_seq
        assert spare is not None and engine.kv_cells(spare) == 0  # llama.cpp's count
    assert errors == [] and len(reports) == 2
    for report in reports:
        turns = report.turns
        evicting = [i for i, t in enumerate(turns[:-1]) if t.evicted]
        assert evicting, "no turn evicted"
        # The turn after each eviction took the summary of what was evicted.
        assert all(turns[i + 1].summarized > 0 for i in evicting)


def test_replay_cli_layout_and_simulated_llama_server(tiny_llama3_path: Path) -> None:
    # "auto" is the layout the simulated cache keeps best: summary-first for the engine,
    # append for llama-server (the same figures as naming it); on llama-server's walk the
    # append layout evaluates less than the summary in front (which hides the kept turns).
    text = json.dumps(support_conversation(40, seed=6)) + "\n"
    base = ["replay", "-", "--dry-run", "--model", str(tiny_llama3_path), "--budget", "300"]

    def evaluated(*extra: str) -> list[int]:
        result = CliRunner().invoke(cli, [*base, *extra, "--json"], input=text)
        assert result.exit_code == 0, result.output
        return [t["evaluated_tokens"] for t in json.loads(result.output)["turns"]]

    engine = evaluated()
    assert evaluated("--layout", "summary-first") == engine
    server = evaluated("--simulate", "llama-server")
    assert server == evaluated("--simulate", "llama-server", "--layout", "append")
    front = evaluated("--simulate", "llama-server", "--layout", "summary-first")
    assert sum(server) < sum(front)
    for args, message in (
        (["--simulate", "llama-server"], "--simulate is for --dry-run"),
        (["--dry-run", "--backend", "http://127.0.0.1:9"], "--backend runs on a llama-server"),
    ):
        args = ["replay", "-", "--model", str(tiny_llama3_path), *args]
        result = CliRunner().invoke(cli, args, input=text)
        assert result.exit_code == 1 and message in result.output, result.output
