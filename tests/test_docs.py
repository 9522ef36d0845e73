"""The docs a newcomer reads stay true: the generated settings table, links, code that runs."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def _settings_doc() -> object:
    spec = importlib.util.spec_from_file_location("settings_doc", ROOT / "scripts/settings_doc.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_table_is_generated_from_the_models() -> None:
    module = _settings_doc()
    rendered = module.render()  # type: ignore[attr-defined]
    assert (ROOT / "docs" / "settings.md").read_text(encoding="utf-8") == rendered, (
        "docs/settings.md is out of date: run .venv/bin/python scripts/settings_doc.py"
    )


def test_the_settings_table_has_every_field_with_its_default() -> None:
    # An oracle apart from the generator: the models' own fields and defaults, read here.
    from chatctx.settings import ContextSettings, EngineConfig

    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    for model in (ContextSettings, EngineConfig):
        for name, field in model.model_fields.items():
            row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), "")
            assert row, f"{model.__name__}.{name} missing"
            if field.default is not None and not callable(field.default):
                assert repr(field.default) in row or field.is_required()


def test_every_relative_link_in_the_docs_points_at_a_file() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_the_readme_python_snippets_are_valid_python() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    snippets = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(snippets) >= 3
    for snippet in snippets:
        ast.parse(snippet)


def test_the_readme_answers_embed_serve_and_defaults_early() -> None:
    head = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:150])
    for needed in ("ChatSession.open", "chatctx serve", "OpenAI(", "## What the defaults do"):
        assert needed in head, needed


def test_the_readme_support_bot_runs(tiny_llama3_path: Path, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    bot = next(s for s in re.findall(r"```python\n(.*?)```", readme, re.S) if "def answer" in s)
    db = f"sqlite:///{tmp_path / 'bot.db'}"
    code = bot.replace('"model.gguf"', repr(str(tiny_llama3_path))).replace(
        '"sqlite:///bot.db"', repr(db)
    )
    scope: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), scope)
    try:
        reply = scope["answer"]("cust-1", "My order 1234 has not arrived.")  # type: ignore[operator]
        assert isinstance(reply, str)
        history = scope["store"].messages("cust-1")  # type: ignore[attr-defined]
        assert [m.role for m in history] == ["user", "assistant"]
        assert history[0].content == "My order 1234 has not arrived."
        assert history[1].content == reply
        conversation = scope["store"].get_conversation("cust-1")  # type: ignore[attr-defined]
        assert conversation.system_prompt == "You are the support assistant of Nimbus."
        assert len(scope["store"].turns("cust-1")) == 1  # type: ignore[attr-defined]
    finally:
        scope["store"].close()  # type: ignore[attr-defined]
        scope["engine"].close()  # type: ignore[attr-defined]


def test_the_readme_agent_runs_its_tool(tmp_path: Path) -> None:
    from chatctx.testing import LLAMA31_TOOLS_TEMPLATE, write_tiny_llama3

    model = write_tiny_llama3(tmp_path / "tiny-llama31.gguf", chat_template=LLAMA31_TOOLS_TEMPLATE)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    agent = next(s for s in re.findall(r"```python\n(.*?)```", readme, re.S) if "run_tools" in s)
    db = f"sqlite:///{tmp_path / 'bot.db'}"
    # A random-weight model calls only when it must: the first reply is held to a call, its
    # string argument bounded (a random model never closes an open-ended string).
    code = (
        agent.replace('"model.gguf"', repr(str(model)))
        .replace('"sqlite:///bot.db"', repr(db))
        .replace("tools=[LOOKUP])", 'tools=[LOOKUP], tool_choice="required")')
        .replace('{"type": "string"}', '{"type": "string", "maxLength": 8}')
    )
    assert code.count("maxLength") == 1 and code.count('tool_choice="required"') == 1
    scope: dict[str, object] = {"print": lambda *args: None}
    exec(compile(code, "README.md", "exec"), scope)  # defines and runs it
    scope["engine"].close()  # type: ignore[attr-defined]
    from chatctx.store import Store

    with Store(db) as store:
        history = store.messages("cust-7")
    roles = [m.role for m in history]
    assert roles[:3] == ["user", "assistant", "tool"] and roles[-1] == "assistant"
    call = history[1].tool_calls[0]  # type: ignore[index]
    assert call["function"]["name"] == "lookup_order"
    # The result stored is what the function returns for the model's arguments.
    arguments = json.loads(call["function"]["arguments"])
    if "order_id" in arguments:  # the schema does not require it: a random model may omit it
        orders = {"A-1": {"status": "shipped", "eta": "Tuesday"}}
        expected = orders.get(arguments["order_id"], {"error": "no such order"})
        assert json.loads(history[2].content) == expected
    else:
        assert history[2].content.startswith("error: TypeError")
