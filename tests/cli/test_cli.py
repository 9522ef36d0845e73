import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from chatctx import Engine
from chatctx.cli import cli
from chatctx.store import Store

SAMPLE = json.dumps(
    {
        "id": "s1",
        "messages": [
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi, how can I help?"},
        ],
    }
)


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield (*prefix, name), command
        if isinstance(command, click.Group):
            yield from all_commands(command, (*prefix, name))


def test_every_command_has_help_text() -> None:
    runner = CliRunner()
    for path, command in all_commands(cli):
        assert command.help, f"{' '.join(path)} has no help"
        result = runner.invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, path
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"{' '.join(path)} {param.opts} has no help"


def test_models_info_json(tiny_llama3_path: Path, smollm2_path: Path) -> None:
    result = CliRunner().invoke(cli, ["models", "info", str(tiny_llama3_path), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    assert facts["vocab_size"] == 128256 and facts["chat_template"] is True
    default = CliRunner().invoke(cli, ["models", "info"])  # the embedded default
    assert default.exit_code == 0 and "SmolLM2" in default.output and "30" in default.output


@pytest.mark.parametrize(
    ("n_ctx", "slots", "layout"),
    [(512, 2, "--unified"), (300, 3, "--split"), (4096, 1, "--unified")],
)
def test_models_info_sizes_the_pool_like_the_engine(
    tiny_llama3_path: Path, n_ctx: int, slots: int, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --n-ctx is one conversation's context: the figures are those of an engine loaded so.
    monkeypatch.setenv("CHATCTX_N_CTX", str(n_ctx))  # the default when --n-ctx is not given
    args = ["models", "info", str(tiny_llama3_path), "--slots", str(slots), layout]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    unified = layout == "--unified"
    with Engine.load(tiny_llama3_path, n_ctx=n_ctx, slots=slots, kv_unified=unified) as engine:
        info = engine.info()
        assert (facts["n_ctx"], facts["slots"], facts["n_seq_max"], facts["kv_cells"]) == (
            info.n_ctx,
            info.slots,
            info.n_seq_max,
            info.kv_cells,
        )
        assert facts["kv_cells"] == engine.context.n_ctx  # what llama.cpp allocated
    assert facts["kv_unified"] is unified
    assert facts["kv_cache_bytes_f16"] == info.kv_cells * facts["kv_bytes_per_token_f16"]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0, text.output
    assert f"\nn_ctx                 {info.n_ctx} tokens: one conversation's context" in (
        text.output
    )
    assert f"\nslots                 {slots} (+1 sequence reserved for summaries)\n" in (
        text.output
    )
    assert f"\nKV cells              {info.kv_cells} (" in text.output


def test_models_info_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    result = CliRunner().invoke(cli, ["models", "info", str(bad)])
    assert result.exit_code == 1 and "not a GGUF" in result.output
    small = CliRunner().invoke(cli, ["models", "info", "--n-ctx", "16"])
    assert small.exit_code == 2 and "Invalid value for '--n-ctx'" in small.output


def test_import_export_list_show(db_url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    src = tmp_path / "in.jsonl"
    src.write_text(SAMPLE + "\n")
    result = runner.invoke(cli, ["conversations", "import", str(src), "--db", db_url])
    assert result.exit_code == 0, result.output
    assert "imported 1 conversation(s): s1" in result.output
    listed = json.loads(
        runner.invoke(cli, ["conversations", "list", "--db", db_url, "--json"]).output
    )
    assert [(c["id"], c["messages"]) for c in listed] == [("s1", 2)]
    shown = json.loads(
        runner.invoke(cli, ["conversations", "show", "s1", "--db", db_url, "--json"]).output
    )
    assert [m["content"] for m in shown["messages"]] == ["Hello", "Hi, how can I help?"]
    exported = runner.invoke(cli, ["conversations", "export", "s1", "--db", db_url])
    assert json.loads(exported.stdout) == json.loads(SAMPLE)


def test_malformed_import_names_the_line_and_stores_nothing(db_url: str, tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(SAMPLE + "\n" + '{"id": "s2", "messages": [{"role": "usr", "content": "x"}]}\n')
    result = CliRunner().invoke(cli, ["conversations", "import", str(src), "--db", db_url])
    assert result.exit_code == 1
    assert f"{src}:2: message 1: unknown role 'usr'" in result.output
    with Store(db_url) as store:
        assert store.list_conversations() == []


def test_unknown_conversation(db_url: str) -> None:
    for args in (["conversations", "show", "ghost"], ["conversations", "export", "ghost"]):
        result = CliRunner().invoke(cli, [*args, "--db", db_url])
        assert result.exit_code == 1
        assert "no conversation with id 'ghost'" in result.output


def test_db_upgrade_and_current(db_url: str) -> None:
    runner = CliRunner()
    before = json.loads(runner.invoke(cli, ["db", "current", "--db", db_url, "--json"]).output)
    assert before["current"] is None and before["up_to_date"] is False
    assert runner.invoke(cli, ["db", "upgrade", "--db", db_url]).exit_code == 0
    after = json.loads(runner.invoke(cli, ["db", "current", "--db", db_url, "--json"]).output)
    assert after["current"] == after["head"] and after["up_to_date"] is True


def test_env_settings_are_used(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHATCTX_DB", db_url)
    src = tmp_path / "in.jsonl"
    src.write_text(SAMPLE + "\n")
    assert CliRunner().invoke(cli, ["conversations", "import", str(src)]).exit_code == 0
    with Store(db_url) as store:
        assert store.has_conversation("s1")


def test_chat_repl(db_url: str, tiny_llama3_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "chat",
            "--db",
            db_url,
            "--model",
            str(tiny_llama3_path),
            "-c",
            "r1",
            "--max-tokens",
            "4",
            "--n-ctx",
            "512",
            "--system",
            "Be brief.",
        ],
        input="hello there\n/history\n/stats\n/quit\n",
    )
    assert result.exit_code == 0, result.output
    assert "user: hello there" in result.output
    assert "prompt " in result.output and "reused" in result.output
    with Store(db_url) as store:
        messages = store.messages("r1")
        assert [m.role for m in messages] == ["user", "assistant"]
        assert store.get_conversation("r1").settings["generation"]["max_tokens"] == 4


def test_chat_missing_model(db_url: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["chat", "--db", db_url, "--model", str(tmp_path / "none.gguf")], input="/quit\n"
    )
    assert result.exit_code == 1 and "model file not found" in result.output


def test_demo_json(db_url: str, tiny_llama3_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        ["demo", "--db", db_url, "--model", str(tiny_llama3_path), "--max-tokens", "4", "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    turns = report["turns"]
    assert len(turns) == 16
    assert turns[0]["reused_tokens"] == 0
    assert all(t["reused_tokens"] > 0 for t in turns[1:])
    # The sample outgrows the demo's budget: turns are evicted (and shifted in place),
    # summarized, and the last one, which asks a fact back, gets a recall section.
    assert all(t["prompt_tokens"] <= 384 for t in turns)
    assert any(t["evicted_tokens"] > 0 for t in turns)
    assert any(t["shifted_tokens"] > 0 for t in turns)
    assert turns[-1]["summary_tokens"] > 0 and turns[-1]["recall_tokens"] > 0
    dry = report["dry_run"]
    assert dry["trim-every-turn"]["evaluated_tokens"] > dry["watermarks"]["evaluated_tokens"]
    with Store(db_url) as store:
        messages = store.messages(report["conversation"])
        assert len(messages) == 32
        summary = store.context_state(report["conversation"]).summary
        assert summary is not None and "NH-48213" in summary.content


def test_show_and_list_print_markup_like_text_verbatim(db_url: str) -> None:
    # Imported or typed text is data, never rich markup (an unmatched [/x] used to crash).
    with Store(db_url) as store:
        store.create_conversation("c[/b]", title="[/t] title", system_prompt="sys [bold]x")
        store.add_message("c[/b]", "user", "hi [/x] there [red]")
    shown = CliRunner().invoke(cli, ["conversations", "show", "c[/b]", "--db", db_url])
    assert shown.exit_code == 0, shown.output
    assert "hi [/x] there [red]" in shown.output and "sys [bold]x" in shown.output
    listed = CliRunner().invoke(cli, ["conversations", "list", "--db", db_url])
    assert listed.exit_code == 0, listed.output
    assert "c[/b]" in listed.output and "[/t] title" in listed.output


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--low", "1.5"], "Invalid value for '--low': 1.5 is not in the range 0.0<x<=1.0."),
        (["--low", "0.9", "--high", "0.5"], "low watermark 0.9 is above high watermark 0.5"),
    ],
)
def test_a_refused_option_value_is_one_line_naming_it(
    tmp_path: Path, args: list[str], named: str
) -> None:
    logs = tmp_path / "x.jsonl"
    logs.write_text(SAMPLE + "\n")
    result = CliRunner().invoke(cli, ["replay", "--dry-run", *args, str(logs)])
    assert result.exit_code == 2, result.output
    assert f"Error: {named}\n" in result.output
    assert isinstance(result.exception, SystemExit)  # click's exit, not a raised traceback
