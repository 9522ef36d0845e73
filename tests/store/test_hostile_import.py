"""Hostile JSON Lines for ``chatctx conversations import`` and the library behind it.

Every refusal must be an ``ImportFormatError`` naming ``FILE:LINE:``, the CLI must exit 0 or 1
without a traceback, and a refused import must leave the database as it was (rows counted with
sqlite3 directly, not through the store). Valid conversations must export to what was imported
(the generated input is the oracle).

Run with ``--hypothesis-show-statistics`` to see how many inputs each fuzz test ran.
"""

from __future__ import annotations

import json
import re
import sqlite3
import tempfile
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatctx.cli import cli
from chatctx.errors import ChatctxError, ConfigError, ImportFormatError
from chatctx.session._session import _context_settings, _settings
from chatctx.store import Store, export_conversation, import_records, parse_line, read_jsonl
from chatctx.store.jsonl import MAX_DEPTH, MAX_LINE_BYTES

ROLES = ["system", "user", "assistant", "tool"]
GOOD = {"id": "good-1", "messages": [{"role": "user", "content": "hello"}]}
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_ids = count()


def rows(path: Path) -> tuple[int, int]:
    """(conversations, messages) counted by sqlite3 itself."""
    with sqlite3.connect(path) as db:
        conversations = db.execute("SELECT count(*) FROM conversations").fetchone()[0]
        messages = db.execute("SELECT count(*) FROM messages").fetchone()[0]
    return conversations, messages


@pytest.fixture(scope="module")
def db_file() -> Iterator[Path]:
    # One database for all examples of a module: row counts are compared per example.
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hostile.db"
        with Store(f"sqlite:///{path}"):
            pass
        yield path


@pytest.fixture(scope="module")
def store(db_file: Path) -> Iterator[Store]:
    with Store(db_url(db_file)) as opened:
        yield opened


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def line_with(**changes: Any) -> str:
    return json.dumps(GOOD | changes)


def message_with(**changes: Any) -> str:
    return json.dumps({"id": "m", "messages": [{"role": "user", "content": "x"} | changes]})


# (line, what the refusal must say)
HOSTILE: list[tuple[str | bytes, str]] = [
    # the three crashes of the issue
    ('{"messages": [{"role": "user", "content": ' + nested(100_000) + "}]}", "nested more than"),
    ('{"id": "s", "messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    (message_with(content=[{"type": "text", "text": 5}]), "content must be a string"),
    # nesting just over the limit (parsed, then refused), and a surrogate in a key
    ('{"messages": [{"role": "user", "content": ' + nested(MAX_DEPTH) + "}]}", "nested more"),
    ('{"id": "s", "messages": [], "\\udc00": 1}', "lone surrogate"),
    (b'{"id": "\xff\xfe", "messages": []}', "invalid UTF-8"),
    (b'{"id": "\xed\xa0\x80", "messages": []}', "invalid UTF-8"),  # an encoded surrogate
    # not strict JSON
    (message_with(content="x").replace('"x"', "NaN"), "NaN is not valid JSON"),
    (message_with(content="x").replace('"x"', "-Infinity"), "-Infinity is not valid JSON"),
    (message_with(content="x").replace('"x"', "1e400"), "number out of range"),
    (message_with(content="x").replace('"x"', "9" * 5000), "not valid JSON"),
    ('{"id": "a", "id": "b", "messages": []}', "duplicate key 'id'"),
    ("{oops", "not valid JSON"),
    # wrong shapes and types
    ("[1, 2]", "expected a JSON object, got a list"),
    ('"text"', "expected a JSON object, got a string"),
    ("null", "expected a JSON object, got null"),
    (line_with(messages={"role": "user"}), 'non-empty "messages"'),
    (line_with(messages=[]), 'non-empty "messages"'),
    (line_with(messages=["hi"]), "message 1: expected an object, got a string"),
    (message_with(role="robot"), "unknown role 'robot'"),
    (message_with(role=["user"]), "unknown role a list"),
    (message_with(content=None), "content must be a string, got null"),
    (message_with(content={"text": "x"}), "content must be a string, got an object"),
    (message_with(name=7), '"name" must be a string'),
    (message_with(tool_call_id=["x"]), '"tool_call_id" must be a string'),
    (message_with(tool_calls="call"), '"tool_calls" must be a list'),
    (message_with(tool_calls=[1]), "tool call 1: expected an object"),
    (message_with(tool_calls=[{"function": {"name": 3}}]), 'a string "name"'),
    (message_with(status="done"), "unknown status 'done'"),
    (message_with(status=1), "unknown status 1"),
    (message_with(extra=1), "unknown keys 'extra'"),
    (message_with(name="n" * 201), '"name" longer than 200'),
    (line_with(id=["x"]), '"id" must be a string, got a list'),
    (line_with(id=True), '"id" must be a string, got a boolean'),
    (line_with(id=1.5), '"id" must be a string, got a number'),
    (line_with(id=" "), '"id" must not be empty'),
    (line_with(id="i" * 201), '"id" longer than 200'),
    (line_with(title=3), '"title" must be a string'),
    # settings the session would refuse at the next turn
    (line_with(settings="fast"), '"settings" must be an object'),
    (line_with(settings={"speed": 1}), "unknown keys 'speed'"),
    (line_with(settings={"generation": []}), '"settings.generation" must be an object'),
    (line_with(settings={"generation": {"max_tokens": 0}}), "max_tokens"),
    (line_with(settings={"generation": {"top_k": "many"}}), "top_k"),
    (line_with(settings={"context": {"policy": "random"}}), "policy"),
    (line_with(settings={"context": {"low": 0.9, "high": 0.5}}), "low watermark"),
    (line_with(settings={"context": {"budget": 1, "nope": 2}}), "budget"),
]


@pytest.mark.parametrize(("bad", "reason"), HOSTILE)
def test_hostile_line_is_refused_with_its_line_and_nothing_is_stored(
    db_file: Path, tmp_path: Path, bad: str | bytes, reason: str
) -> None:
    # Bug caught: a RecursionError/TypeError/UnicodeEncodeError traceback, a refusal without
    # its line, or a partial import of the good line before it.
    data = bad if isinstance(bad, bytes) else bad.encode("utf-8", "surrogatepass")
    path = tmp_path / "in.jsonl"
    path.write_bytes(json.dumps(GOOD | {"id": f"g{next(_ids)}"}).encode() + b"\n\n" + data + b"\n")
    before = rows(db_file)
    with (
        Store(db_url(db_file)) as store,
        path.open("rb") as f,
        pytest.raises(ImportFormatError, match=re.escape(reason)) as info,
    ):
        import_records(store, read_jsonl(f, source="in.jsonl"))
    assert info.value.line == 3 and str(info.value).startswith("in.jsonl:3: ")
    assert rows(db_file) == before
    result = CliRunner().invoke(
        cli, ["conversations", "import", str(path), "--db", db_url(db_file)]
    )
    assert result.exit_code == 1 and result.exception is not None
    assert isinstance(result.exception, SystemExit), result.exception
    assert f"{path}:3: " in result.output and reason in result.output
    assert "Traceback" not in result.output
    assert rows(db_file) == before


def db_url(path: Path) -> str:
    return f"sqlite:///{path}"


def test_invalid_settings_would_break_the_session_later() -> None:
    # The oracle for the settings cases: the session's own readers refuse them too, so storing
    # them would have broken the conversation at its next turn.
    for settings_value in (
        {"generation": {"max_tokens": 0}},
        {"context": {"policy": "random"}},
        {"context": {"low": 0.9, "high": 0.5}},
    ):
        with pytest.raises(ConfigError):
            _settings(settings_value.get("generation") or {})
            _context_settings(settings_value.get("context") or {})


def test_line_over_the_size_limit_is_refused_without_reading_it_whole(
    db_file: Path, tmp_path: Path
) -> None:
    # 17 MiB of content on line 2, then a good line 3: the size refusal names line 2.
    path = tmp_path / "huge.jsonl"
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (17 << 20) + b'"}]}'
    path.write_bytes(json.dumps(GOOD | {"id": "h0"}).encode() + b"\n" + big + b"\n")
    before = rows(db_file)
    result = CliRunner().invoke(
        cli, ["conversations", "import", str(path), "--db", db_url(db_file)]
    )
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert f"{path}:2: line longer than 16 MiB" in result.output
    assert rows(db_file) == before
    # exactly at the limit passes the size check (then is judged as JSON); one byte more not
    at_limit = b'{"x": "' + b"a" * (MAX_LINE_BYTES - 9) + b'"}'
    assert len(at_limit) == MAX_LINE_BYTES
    over = at_limit[:-2] + b'a"}'
    for line, reason in ((at_limit, 'non-empty "messages"'), (over, "line longer than")):
        path.write_bytes(line + b"\n" + json.dumps(GOOD).encode() + b"\n")
        with path.open("rb") as f, pytest.raises(ImportFormatError, match=reason) as info:
            list(read_jsonl(f))
        assert info.value.line == 1
        with pytest.raises(ImportFormatError, match=reason):
            parse_line(line.decode(), line=1)  # the str API measures in UTF-8 bytes too


def test_duplicate_and_existing_ids_name_their_line(db_file: Path, tmp_path: Path) -> None:
    cid = f"dup{next(_ids)}"
    lines = [json.dumps(GOOD | {"id": cid}), json.dumps(GOOD | {"id": cid})]
    before = rows(db_file)
    with Store(db_url(db_file)) as store:
        with pytest.raises(ImportFormatError, match=r"^f.jsonl:2: duplicate id .*first on line 1"):
            import_records(store, read_jsonl(lines, source="f.jsonl"))
        assert rows(db_file) == before
        import_records(store, read_jsonl(lines[:1], source="f.jsonl"))
        with pytest.raises(ImportFormatError, match=r"^g.jsonl:2: conversation .* already exists"):
            import_records(store, read_jsonl(["", lines[0]], source="g.jsonl"))
    assert rows(db_file) == (before[0] + 1, before[1] + 1)


def test_stdin_import_is_read_the_same_way(db_file: Path) -> None:
    cid = f"stdin{next(_ids)}"
    bad = json.dumps(GOOD | {"id": cid}).encode() + b"\n" + b'{"messages": "\xff"}\n'
    args = ["conversations", "import", "-", "--db", db_url(db_file)]
    before = rows(db_file)
    result = CliRunner().invoke(cli, args, input=bad)
    assert result.exit_code == 1 and "Error: <stdin>:2: invalid UTF-8 (byte 14)" in result.output
    assert rows(db_file) == before
    result = CliRunner().invoke(cli, args, input=bad.splitlines()[0])
    assert result.exit_code == 0 and cid in result.output
    assert rows(db_file) == (before[0] + 1, before[1] + 1)


def test_nesting_limit_is_exact() -> None:
    # tool call arguments may be any object: nesting up to MAX_DEPTH levels is kept
    def line(depth: int) -> str:
        # top object, messages list, message, tool_calls list, call, function, arguments
        arguments = '{"a": ' + nested(depth - 7) + "}"
        call = '{"id": "c", "type": "function", "function": {"name": "f", "arguments": %s}}'
        return '{"messages": [{"role": "assistant", "content": null, "tool_calls": [%s]}]}' % (
            call % arguments
        )

    record = parse_line(line(MAX_DEPTH), line=1)
    assert record.messages[0]["content"] == ""
    with pytest.raises(ImportFormatError, match=f"nested more than {MAX_DEPTH} levels"):
        parse_line(line(MAX_DEPTH + 1), line=1)


def test_a_lone_surrogate_given_as_text_is_refused_too() -> None:
    # Lines handed over as str may hold the surrogate itself rather than its escape.
    line = '{"messages": [{"role": "user", "content": "a\ud83db"}]}'
    with pytest.raises(ImportFormatError, match=r"lone surrogate '\\ud83d' in messages\[0\]"):
        list(read_jsonl([line]))
    # a correct escaped pair is one character, and is kept
    record = parse_line('{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', line=1)
    assert record.messages[0]["content"] == "\U0001f600"


# --- fuzzing ------------------------------------------------------------------------------

TEXT = st.text(max_size=24)  # any Unicode scalar value, NUL included; no surrogates
HOSTILE_TEXT = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=12)
SHORT = st.text(min_size=1, max_size=12).filter(str.strip)
JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | HOSTILE_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(HOSTILE_TEXT, inner, max_size=4),
    max_leaves=12,
)
TOOL_CALL = st.fixed_dictionaries(
    {
        "id": SHORT,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": SHORT, "arguments": TEXT}),
    }
)


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(ROLES))
    message: dict[str, Any] = {"role": role, "content": draw(TEXT)}
    if draw(st.booleans()):
        message["name"] = draw(SHORT)
    if role == "tool" and draw(st.booleans()):
        message["tool_call_id"] = draw(SHORT)
    if role == "assistant" and draw(st.booleans()):
        message["tool_calls"] = draw(st.lists(TOOL_CALL, min_size=1, max_size=2))
    if draw(st.booleans()):
        message["status"] = draw(st.sampled_from(["complete", "partial"]))
    return message


SETTINGS = st.fixed_dictionaries(
    {},
    optional={
        "generation": st.fixed_dictionaries(
            {},
            optional={
                "max_tokens": st.integers(1, 4096),
                "temperature": st.floats(0, 2),
                "seed": st.none() | st.integers(0, 2**31),
            },
        ),
        "context": st.fixed_dictionaries(
            {},
            optional={
                "policy": st.sampled_from(["watermarks", "trim-every-turn"]),
                "budget": st.none() | st.integers(16, 100_000),
                "eviction": st.sampled_from(["shift", "recompute"]),
                "summarizer": st.sampled_from(["extractive", "llm", "none"]),
            },
        ),
    },
)


@st.composite
def conversations(draw: st.DrawFn) -> dict[str, Any]:
    conversation: dict[str, Any] = {"messages": draw(st.lists(messages(), min_size=1, max_size=5))}
    if draw(st.booleans()):
        conversation["id"] = draw(SHORT | st.integers(0, 10**6))
    if draw(st.booleans()):
        conversation["title"] = draw(TEXT)
    if draw(st.booleans()):
        conversation["settings"] = draw(SETTINGS)
    return conversation


def _replace_in_message(conv: dict[str, Any], index: int, **changes: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(conv))
    out["messages"][index % len(out["messages"])] |= changes
    return out


@st.composite
def broken(draw: st.DrawFn, conv: dict[str, Any]) -> tuple[Any, str]:
    """A valid conversation with one thing made invalid, and the reason to expect.

    The value is a JSON value, or JSON text already written (too deep for json.dumps).
    """
    at = draw(st.integers(0, 10))
    junk_role = st.text(max_size=8).filter(lambda r: r not in ROLES) | st.integers() | st.none()
    choice = draw(st.integers(0, 12))
    if choice == 0:
        return _replace_in_message(conv, at, role=draw(junk_role)), "unknown role"
    if choice == 1:
        content = draw(st.integers() | st.booleans() | st.lists(st.integers(), max_size=3))
        return _replace_in_message(conv, at, content=content), "content must be a string"
    if choice == 2:
        text = draw(TEXT) + draw(st.characters(categories=["Cs"])) + draw(TEXT)
        return _replace_in_message(conv, at, content=text), "lone surrogate|invalid UTF-8"
    if choice == 3:
        # content nested `depth` deep inside messages[i]: the line nests depth + 3 levels
        depth = draw(st.integers(MAX_DEPTH - 2, 3000) | st.just(50_000))
        marker = "\u2603deep\u2603"
        value = _replace_in_message(conv, at, content=marker)
        return json.dumps(value).replace(json.dumps(marker), nested(depth)), "nested more than"
    if choice == 4:
        value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
        return _replace_in_message(conv, at, content=value), "is not valid JSON"
    if choice == 5:
        value = draw(st.none() | st.integers() | st.text(max_size=3) | st.just([]))
        return conv | {"messages": value}, '"messages" list'
    if choice == 6:
        value = draw(st.none() | st.integers() | st.text(max_size=3) | st.lists(st.none()))
        return conv | {"messages": [*conv["messages"], value]}, "expected an object"
    if choice == 7:
        status = draw(st.text(max_size=8).filter(lambda s: s not in ("complete", "partial")))
        return _replace_in_message(conv, at, status=status), "unknown status"
    if choice == 8:
        value = draw(
            st.sampled_from(
                [
                    "x",
                    {"bogus": {}},
                    {"generation": {"max_tokens": -1}},
                    {"context": {"eviction": "drop"}},
                    {"generation": {"temperature": "hot"}},
                ]
            )
        )
        return conv | {"settings": value}, "settings"
    if choice == 9:
        value = draw(st.sampled_from([[1], {"a": 1}, 2.5, True, "", " "]))
        return conv | {"id": value}, '"id" must'
    if choice == 10:
        value = draw(st.integers() | st.lists(st.integers(), max_size=2) | st.just({}))
        return _replace_in_message(conv, at, name=value), '"name" must be a string'
    if choice == 11:
        value = draw(st.integers() | st.just("call") | st.just([1]) | st.just([{"x": 1}]))
        return _replace_in_message(conv, at, tool_calls=value), "tool_calls|tool call"
    value = draw(JSONISH.filter(lambda v: not isinstance(v, dict)))
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))  # "" must not become blank
    return text, "expected a JSON object|lone surrogate|invalid UTF-8|not valid JSON|out of range"


def encode(value: Any, ascii_only: bool) -> bytes:
    """JSON as a careless writer would produce it: NaN literals, raw or escaped surrogates."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=ascii_only)
    return text.encode("utf-8", "surrogatepass")


def expected_export(conv: dict[str, Any]) -> list[dict[str, Any]]:
    """What export must give back: the input, with "complete" as the unwritten default."""
    out = []
    for message in conv["messages"]:
        item = {k: v for k, v in message.items() if not (k == "status" and v == "complete")}
        out.append(item)
    return out


def fresh_ids(conv: dict[str, Any]) -> dict[str, Any]:
    # Ids must be new to the shared database; the generated id stays part of the new one.
    if "id" in conv:
        return conv | {"id": f"{next(_ids)}-{conv['id']}"}
    return conv


@settings(FUZZ, max_examples=150)
@given(
    valid=st.lists(conversations(), min_size=0, max_size=3),
    data=st.data(),
    ascii_only=st.booleans(),
    as_text=st.booleans(),
)
def test_fuzz_import_library(
    db_file: Path,
    store: Store,
    valid: list[dict[str, Any]],
    data: st.DataObject,
    ascii_only: bool,
    as_text: bool,
) -> None:
    # Bug caught: any exception other than ImportFormatError, a refusal at the wrong line, a
    # partial import, or an import that does not export back to its input.
    valid = [fresh_ids(c) for c in valid]
    lines: list[bytes] = [encode(c, ascii_only) for c in valid]
    bad_line, reason = None, ""
    if data.draw(st.booleans(), label="break one"):
        base = data.draw(conversations(), label="base")
        value, reason = data.draw(broken(fresh_ids(base)), label="broken")
        position = data.draw(st.integers(0, len(lines)), label="position")
        lines.insert(position, encode(value, ascii_only))
        bad_line = position + 1
    before = rows(db_file)
    stream: list[str] | list[bytes] = lines
    if as_text:  # the str API: invalid UTF-8 shows up as lone surrogates instead
        stream = [line.decode("utf-8", "surrogateescape") for line in lines]
    try:
        ids = import_records(store, read_jsonl(stream, source="fz.jsonl"))
    except ImportFormatError as exc:
        assert bad_line is not None, f"a valid file was refused: {exc}"
        assert exc.line == bad_line and str(exc).startswith(f"fz.jsonl:{bad_line}: ")
        assert re.search(reason, str(exc)), (reason, str(exc))
        assert rows(db_file) == before
        return
    assert bad_line is None, f"line {bad_line} ({reason}) was accepted"
    assert len(ids) == len(valid)
    for cid, conv in zip(ids, valid, strict=True):
        exported = export_conversation(store, cid)
        assert exported["messages"] == expected_export(conv)
        if "id" in conv:
            assert cid == str(conv["id"])
        assert exported.get("title") == conv.get("title")
        assert exported.get("settings", {}) == conv.get("settings", {})
    conversations_added = rows(db_file)[0] - before[0]
    assert conversations_added == len(valid)


@settings(FUZZ, max_examples=250)
@given(
    lines=st.lists(
        st.one_of(
            JSONISH.map(lambda v: encode(v, True)),
            JSONISH.map(lambda v: encode(v, False)),
            st.dictionaries(st.sampled_from(["id", "messages", "title", "settings"]), JSONISH).map(
                lambda v: encode(v, True)
            ),
            st.binary(max_size=40),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_fuzz_import_library_random_json_and_bytes(
    db_file: Path, store: Store, lines: list[bytes]
) -> None:
    # Random JSON-ish values and bytes: only ImportFormatError may come out, and a refused
    # file stores nothing.
    lines = [line.replace(b"\n", b" ").replace(b"\r", b" ") for line in lines]
    before = rows(db_file)
    try:
        import_records(store, read_jsonl(lines, source="rnd.jsonl"))
    except ImportFormatError as exc:
        assert 1 <= exc.line <= len(lines)
        assert str(exc).startswith(f"rnd.jsonl:{exc.line}: ")
        assert rows(db_file) == before
    except ChatctxError as exc:
        pytest.fail(f"{type(exc).__name__} without a line: {exc}")


ERROR_LINE = re.compile(r"^Error: (?P<file>.+?):(?P<line>\d+): ", re.MULTILINE)


@settings(FUZZ, max_examples=60)
@given(
    valid=st.lists(conversations(), min_size=0, max_size=2),
    junk=st.lists(
        st.one_of(JSONISH.map(lambda v: encode(v, True)), st.binary(max_size=30)), max_size=2
    ),
    data=st.data(),
)
def test_fuzz_import_cli(
    db_file: Path,
    valid: list[dict[str, Any]],
    junk: list[bytes],
    data: st.DataObject,
) -> None:
    # The command line: exit 0 or 1, never a traceback; an error names FILE:LINE; a refused
    # file changes no row.
    lines = [encode(fresh_ids(c), data.draw(st.booleans())) for c in valid]
    for item in junk:
        lines.insert(data.draw(st.integers(0, len(lines))), item.replace(b"\n", b" "))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cli.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        before = rows(db_file)
        result = CliRunner().invoke(
            cli, ["conversations", "import", str(path), "--db", db_url(db_file)]
        )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code in (0, 1), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 1:
        match = ERROR_LINE.search(result.output)
        assert match is not None, result.output
        assert match["file"] == str(path) and 1 <= int(match["line"]) <= len(lines)
        assert rows(db_file) == before
    else:
        assert rows(db_file)[0] - before[0] == len(lines) - sum(not x.strip() for x in lines)
