"""The CLI's options follow the settings models: names, defaults, ranges, choices and help are
declared once, on the model (issue 41). The oracle is the model itself: its fields, and what
it accepts or refuses at the option's bounds."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from pydantic import BaseModel, ValidationError

from chatctx.cli import cli
from chatctx.cli._options import FieldOption
from chatctx.errors import ConfigError
from chatctx.settings import (
    REPLAY_CONTEXT,
    ContextSettings,
    EngineConfig,
    GenerationSettings,
    Limits,
    ReplayConfig,
    ServeConfig,
    Settings,
)

MODELS: list[type[BaseModel]] = [
    ContextSettings,
    EngineConfig,
    GenerationSettings,
    Limits,
    ReplayConfig,
    ServeConfig,
    Settings,
]

# Options named like a settings field that are not that field, each with why.
NOT_FIELDS = {
    "db": "shared by every command; its default is resolved from CHATCTX_DB (Settings)",
    "model": "shared by every command; its default is resolved from CHATCTX_MODEL (Settings)",
    ("serve", "api_keys"): "a file holding ServeConfig.api_keys, not the keys themselves",
    ("stats", "slots"): "a flag: show the slot table",
    ("synth", "seed"): "the seed of the generated conversations, not of sampling",
    ("tune", "n_ubatch"): "a comma-separated list of micro-batch sizes to time",
}


def commands() -> Iterator[tuple[str, click.Command]]:
    def walk(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from walk(sub, f"{path} {name}".strip())
        else:
            yield path, command

    yield from walk(cli, "")


def field_options() -> list[tuple[str, FieldOption]]:
    return [
        (path, option)
        for path, command in commands()
        for option in command.params
        if isinstance(option, FieldOption)
    ]


def test_options_named_like_a_field_are_made_from_it() -> None:
    fields = {name for model in MODELS for name in model.model_fields}
    handwritten = [
        f"{path} --{option.name}"
        for path, command in commands()
        for option in command.params
        if isinstance(option, click.Option)
        and not isinstance(option, FieldOption)
        and option.name in fields
        and option.name not in NOT_FIELDS
        and (path, option.name) not in NOT_FIELDS
    ]
    assert handwritten == []
    assert len(field_options()) >= 60  # replay, serve, plan, chat, demo, models, tune


@pytest.mark.parametrize(("path", "option"), field_options(), ids=lambda v: str(v))
def test_each_field_option_matches_its_field(path: str, option: FieldOption) -> None:
    info = option.model.model_fields[option.field]
    expected = (
        getattr(option.defaults, option.field)
        if option.defaults is not None
        else info.get_default(call_default_factory=True)
    )
    if option.deferred:
        assert option.default is None and expected is not None
        assert option.help and "Default:" in option.help  # says where it comes from
    elif option.multiple:
        assert list(option.default or []) == expected
    else:
        assert option.default == expected
    assert option.help is not None and option.help.startswith(info.description or "")
    kind = option.type
    if isinstance(kind, click.Choice):  # every choice is a value the model takes
        for choice in kind.choices:
            _accepts(option, choice if option.field != "flash_attn" else "auto")
    if isinstance(kind, click.IntRange | click.FloatRange):
        step = 1 if isinstance(kind, click.IntRange) else 1e-9
        if kind.min is not None:
            low = kind.min + (step if kind.min_open else 0)
            _accepts(option, low)
            _refuses(option, low - step)
        if kind.max is not None:
            high = kind.max - (step if kind.max_open else 0)
            _accepts(option, high)
            _refuses(option, high + step)


def _field_errors(option: FieldOption, value: Any) -> list[Any]:
    """The model's refusals of ``value`` for this field alone (a check across fields, such as
    low below high, is not about the option's own range)."""
    data: dict[str, Any] = {option.field: value}
    if option.model is EngineConfig:
        data["model_path"] = "x.gguf"
    if option.model is Settings:
        data["db"] = "sqlite://"
    try:
        option.model.model_validate(data)
    except ValidationError as exc:
        return [e for e in exc.errors() if option.field in e["loc"]]
    except ConfigError as exc:
        return [str(exc)]
    return []


def _accepts(option: FieldOption, value: Any) -> None:
    assert _field_errors(option, value) == [], (option.field, value)


def _refuses(option: FieldOption, value: Any) -> None:
    assert _field_errors(option, value) != [], (option.field, value)


def test_serve_without_options_is_create_app_with_default_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`chatctx serve` and `create_app(ServeConfig())` are the same server (slots 4 in both)."""
    import chatctx.serve

    seen: list[ServeConfig] = []
    monkeypatch.setattr(chatctx.serve, "serve", seen.append)
    for name in ("CHATCTX_API_KEYS", "CHATCTX_API_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 0, result.output
    # engine_options carry the environment's n_ctx and GPU layers (Settings), as Engine.load
    # would default them.
    loose = {"engine_options"}
    assert seen[0].model_dump(exclude=loose) == ServeConfig().model_dump(exclude=loose)
    assert ServeConfig().slots == 4


def test_replay_without_options_is_the_default_replay_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    command = sys.modules["chatctx.cli.replay"]  # the module, not the command it defines
    seen: list[ReplayConfig] = []

    class Stop(Exception):
        pass

    def capture(config: ReplayConfig, **_: Any) -> None:
        seen.append(config)
        raise Stop

    monkeypatch.setattr(command, "Replayer", capture)
    logs = tmp_path / "x.jsonl"
    logs.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    result = CliRunner().invoke(cli, ["replay", "--dry-run", str(logs)])
    assert isinstance(result.exception, Stop), result.output
    assert seen[0] == ReplayConfig(mode="dry")
    assert seen[0].context == REPLAY_CONTEXT and REPLAY_CONTEXT.budget == 1024


def test_flat_context_fields_fold_into_the_replay_context() -> None:
    config = ReplayConfig(budget=512, low=0.5, recall=False)  # type: ignore[call-arg]
    assert config.context == ContextSettings(budget=512, low=0.5, recall=False)
    # Unset context fields take ContextSettings' defaults, the budget the replay's.
    assert ReplayConfig(context=ContextSettings(low=0.5)).context.budget == 1024
    assert ReplayConfig(context={"layout": "append"}).context.budget == 1024  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"low watermark 0\.9 is above high"):
        ReplayConfig(low=0.9, high=0.5)  # type: ignore[call-arg]


def test_serve_no_kv_unified_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The setting that makes replies independent of load (bench/load_independence.py)."""
    import chatctx.serve

    seen: list[ServeConfig] = []
    monkeypatch.setattr(chatctx.serve, "serve", seen.append)
    for name in ("CHATCTX_API_KEYS", "CHATCTX_API_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(cli, ["serve", "--no-kv-unified"])
    assert result.exit_code == 0, result.output
    assert seen[0].engine_options["kv_unified"] is False
    EngineConfig.model_validate({"model_path": "x.gguf", **seen[0].engine_options})
