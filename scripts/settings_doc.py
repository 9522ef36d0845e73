"""Write docs/settings.md: every settings model's fields, defaults, ranges and help.

The table is generated from the pydantic models themselves, so it cannot drift from the code;
tests/test_docs.py fails when docs/settings.md is not what this script writes.

    .venv/bin/python scripts/settings_doc.py          # rewrite docs/settings.md
    .venv/bin/python scripts/settings_doc.py --check  # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"

INTRO = """\
# Settings

Generated from the pydantic models by `scripts/settings_doc.py` (a test keeps it in sync); do
not edit by hand. Each model validates on construction: a value out of range is a one-line
error naming the field (on the command line, naming the option).
"""


def _models() -> list[tuple[str, type[BaseModel], str]]:
    from chatctx.settings import (
        ContextSettings,
        ConversationSettings,
        EngineConfig,
        GenerationSettings,
        Limits,
        ReplayConfig,
        ServeConfig,
        Settings,
    )

    return [
        (
            "chatctx.GenerationSettings",
            GenerationSettings,
            "Sampling and the reply limit of a turn.",
        ),
        ("chatctx.ContextSettings", ContextSettings, "How a conversation is fitted to its budget."),
        (
            "chatctx.ConversationSettings",
            ConversationSettings,
            "What a conversation stores: its generation and context settings.",
        ),
        ("chatctx.EngineConfig", EngineConfig, "The in-process llama.cpp engine (`Engine.load`)."),
        ("chatctx.Settings", Settings, "Read from `CHATCTX_*` environment variables."),
        (
            "chatctx.serve.ServeConfig",
            ServeConfig,
            "`chatctx serve` (`create_app(ServeConfig())` is the same server).",
        ),
        ("chatctx.serve.Limits", Limits, "`ServeConfig.limits`: what a request may take."),
        (
            "chatctx.replay.ReplayConfig",
            ReplayConfig,
            "`chatctx replay` and `chatctx tune`; context fields may also be given flat.",
        ),
    ]


def _type(annotation: Any) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("None" if a is type(None) else _type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]"
    return str(annotation).replace("typing.", "")


def _range(field: FieldInfo) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    parts = []
    for item in field.metadata:
        for attr, sign in words.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory is not None:
            value = field.default_factory()  # type: ignore[call-arg]
            return f"`{value!r}`" if not isinstance(value, BaseModel) else type(value).__name__
        return "required"
    value = field.default
    if isinstance(value, BaseModel):
        return type(value).__name__
    return f"`{value!r}`"


def render() -> str:
    out = [INTRO]
    for name, model, about in _models():
        out += [f"## `{name}`", "", about, "", "| field | type | default | range | meaning |"]
        out.append("|---|---|---|---|---|")
        for key, field in model.model_fields.items():
            help_text = " ".join((field.description or "").split()).replace("|", "\\|")
            out.append(
                f"| `{key}` | {_type(field.annotation)} | {_default(field)} | {_range(field)} "
                f"| {help_text} |"
            )
        out.append("")
    from chatctx.environment import VARIABLES

    out += [
        "## Environment variables",
        "",
        "Declared once, in `chatctx/environment.py`; no other module reads a `CHATCTX_*` variable.",
        "",
        "| variable | sets | when unset |",
        "|---|---|---|",
    ]
    out += [f"| `{name}` | {sets} | {unset} |" for name, (sets, unset) in VARIABLES.items()]
    out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/settings.md differs")
    args = parser.parse_args()
    text = render()
    if args.check:
        if DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is out of date: run scripts/settings_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
