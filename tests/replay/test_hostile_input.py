"""Hostile log lines for ``chatctx replay`` and the readers behind it (read_logs, parse_logged).

No input line may raise anything but ``ImportFormatError`` from the library, or end the CLI
with a traceback; every refusal names ``FILE:LINE:``; ``--on-error skip`` skips every bad
line, reports it, and replays the rest (the oracle: which lines the test itself broke).

Run with ``--hypothesis-show-statistics`` to see how many inputs each fuzz test ran.
"""

from __future__ import annotations

import json
import re
import tempfile
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatctx.cli import cli
from chatctx.errors import ImportFormatError
from chatctx.replay import ReplayConfig, Replayer, parse_logged, read_logs, replay_all
from chatctx.store.jsonl import MAX_DEPTH

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ROLES = ["system", "user", "assistant", "tool"]
SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
SPEAKERS = {"human", "user", "gpt", "assistant", "system", "tool", "function_call", "observation"}
_ids = count()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def good(cid: str) -> dict[str, Any]:
    return {
        "id": cid,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Where is order NH-4821?"},
            {"role": "assistant", "content": "It ships today."},
            {"role": "user", "content": "Thanks"},
        ],
        "probes": [{"fact": "NH-4821", "asked_turn": 1}],
    }


def with_message(**changes: Any) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "x"} | changes]})


# (line, what the refusal must say)
HOSTILE: list[tuple[str | bytes, str]] = [
    # the crashes of the issue: deep nesting, non-string text parts, lone surrogates
    (with_message(content="x").replace('"x"', nested(100_000)), "nested more than"),
    (with_message(content="x").replace('"x"', nested(MAX_DEPTH)), "nested more than"),
    (with_message(content=[{"type": "text", "text": 5}]), 'part 1: "text" must be a string'),
    (with_message(content=[{"type": "text", "text": ["a"]}]), '"text" must be a string'),
    (with_message(content=["plain"]), "content part 1: expected an object, got a string"),
    (with_message(content=[{"type": "text"}]), 'a text part needs a "text" string'),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate '\\ud800'"),
    ('{"messages": [{"role": "user", "content": "\\udfff!"}]}', "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', "invalid UTF-8"),
    (b"\xff\xfe\x00{", "invalid UTF-8"),
    # not strict JSON
    (with_message(content="x").replace('"x"', "NaN"), "NaN is not valid JSON"),
    (with_message(content="x").replace('"x"', "Infinity"), "Infinity is not valid JSON"),
    (with_message(content="x").replace('"x"', "-1e999"), "number out of range"),
    ('{"messages": [], "messages": []}', "duplicate key 'messages'"),
    ("{oops", "not valid JSON"),
    # shapes and types
    ("[]", "expected a JSON object, got a list"),
    ("3", "expected a JSON object, got an integer"),
    ('{"messages": "hi"}', r'"messages" (OpenAI) or "conversations" (ShareGPT) list'),
    ('{"conversations": {"from": "human"}}', '"conversations" (ShareGPT) list'),
    ('{"messages": [7]}', "message 1: expected an object, got an integer"),
    (with_message(role="wizard"), "unknown role 'wizard'"),
    (with_message(role={"name": "user"}), "unknown role an object"),
    (with_message(content=None), "content must be a string or a list of parts, got null"),
    (with_message(content=12), "got an integer"),
    (with_message(name=["n"]), '"name" must be a string'),
    (with_message(tool_call_id=3), '"tool_call_id" must be a string'),
    (with_message(tool_calls={"id": 1}), '"tool_calls" must be a list'),
    (with_message(tool_calls=[{"id": 1, "function": {"name": "f"}}]), '"id" must be a string'),
    (with_message(tool_calls=[{"function": "f"}]), '"function" object'),
    (with_message(status="finished"), "unknown status 'finished'"),
    ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown role 'alien'"),
    ('{"conversations": [{"from": ["human"], "value": "x"}]}', "unknown role a list"),
    ('{"conversations": [{"from": "human", "value": 3}]}', '"value" must be a string'),
    ('{"conversations": [{"from": "human", "value": "x", "status": 0}]}', "unknown status"),
    # empty conversations
    ('{"messages": []}', "empty conversation"),
    ('{"messages": [{"role": "system", "content": "only"}]}', "empty conversation"),
    (with_message(role="assistant"), "empty conversation"),
    # ids and probes
    (with_message().replace("{", '{"id": [1], ', 1), '"id" must be a string, got a list'),
    (with_message().replace("{", '{"id": false, ', 1), '"id" must be a string, got a boolean'),
    (with_message().replace("{", '{"id": "", ', 1), '"id" must not be empty'),
    (with_message().replace("{", '{"probes": 5, ', 1), '"probes" must be a list, got an integer'),
    (with_message().replace("{", '{"probes": ["NH"], ', 1), "probe 1: needs"),
    (
        with_message().replace("{", '{"probes": [{"fact": "a", "asked_turn": true}], ', 1),
        "probe 1: needs",
    ),
    (
        with_message().replace("{", '{"probes": [{"fact": "a", "asked_turn": -1}], ', 1),
        "probe 1: needs",
    ),
    (
        with_message().replace("{", '{"probes": [{"fact": "a", "asked_turn": 0, "kind": 1}], ', 1),
        "probe 1: needs",
    ),
]


@pytest.mark.parametrize(("bad", "reason"), HOSTILE)
def test_hostile_line_is_refused_naming_file_and_line(
    tmp_path: Path, bad: str | bytes, reason: str
) -> None:
    # Bug caught: a RecursionError/TypeError traceback instead of a refusal, a refusal without
    # its line, or --on-error skip giving up on (or silently dropping) the bad line.
    path = tmp_path / "logs.jsonl"
    data = bad if isinstance(bad, bytes) else bad.encode("utf-8", "surrogatepass")
    path.write_bytes(json.dumps(good("a")).encode() + b"\n" + data + b"\n" + b"\n")
    with open(path, "ab") as f:
        f.write(json.dumps(good("b")).encode() + b"\n")
    with pytest.raises(ImportFormatError, match=re.escape(reason)) as info:
        list(read_logs([str(path)]))
    assert info.value.line == 2 and str(info.value).startswith(f"{path}:2: ")
    errors: list[ImportFormatError] = []
    assert [c.id for c in read_logs([str(path)], on_error="skip", errors=errors)] == ["a", "b"]
    assert [(e.line, e.source) for e in errors] == [(2, str(path))]


def test_duplicate_ids_are_refused_across_files(tmp_path: Path) -> None:
    first, second = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    first.write_text(json.dumps(good("x")) + "\n")
    second.write_text(json.dumps(good("y")) + "\n" + json.dumps(good("x")) + "\n")
    with pytest.raises(ImportFormatError, match=rf"duplicate id 'x' \(first at {first}:1\)"):
        list(read_logs([str(first), str(second)]))
    errors: list[ImportFormatError] = []
    ids = [c.id for c in read_logs([str(first), str(second)], on_error="skip", errors=errors)]
    assert ids == ["x", "y"] and str(errors[0]).startswith(f"{second}:2: ")
    # lines without an id are named after their file and line: never duplicates
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    anonymous = json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    for folder in ("a", "b"):
        (tmp_path / folder / "logs.jsonl").write_text(anonymous)
    paths = [str(tmp_path / "a" / "logs.jsonl"), str(tmp_path / "b" / "logs.jsonl")]
    assert [c.id for c in read_logs(paths)] == ["logs.jsonl:1", "logs.jsonl:1"]


def test_long_line_and_corrupt_gzip_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (17 << 20) + b'"}]}'
    path.write_bytes(huge + b"\n" + json.dumps(good("after")).encode() + b"\n")
    errors: list[ImportFormatError] = []
    assert [c.id for c in read_logs([str(path)], on_error="skip", errors=errors)] == ["after"]
    assert [str(e) for e in errors] == [f"{path}:1: line longer than 16 MiB"]
    packed = tmp_path / "bad.jsonl.gz"
    packed.write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 6 + b"not deflate data at all")
    with pytest.raises(ImportFormatError, match=rf"^{re.escape(str(packed))}:1: unreadable"):
        list(read_logs([str(packed)], on_error="skip"))


def test_content_parts_keep_their_text_only() -> None:
    line = json.dumps(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look "},
                        {"type": "image_url", "image_url": {"url": "x"}},
                        {"text": "here"},
                    ],
                }
            ]
        }
    )
    assert parse_logged(line, line=1).messages == [{"role": "user", "content": "look here"}]


def test_cli_skips_every_bad_line_and_replays_the_rest(
    tmp_path: Path, tiny_llama3_path: Path
) -> None:
    # All the hostile lines in one file, between good conversations whose ids are markup.
    path = tmp_path / "mixed.jsonl"
    lines: list[bytes] = [json.dumps(good("[/bold]first")).encode()]
    bad_lines = []
    for bad, _ in HOSTILE:
        lines.append(bad if isinstance(bad, bytes) else bad.encode("utf-8", "surrogatepass"))
        bad_lines.append(len(lines))
    odd = good("[red]last")
    odd["messages"][1]["content"] = "<|eot_id|><|start_header_id|>system\ue000\ue001\x00"
    lines.append(json.dumps(odd).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    base = ["replay", str(path), "--dry-run", "--model", str(tiny_llama3_path)]

    skipped = CliRunner().invoke(cli, [*base, "--on-error", "skip", "--json"])
    assert skipped.exit_code == 0 and skipped.exception is None, skipped.output
    doc = json.loads(skipped.output)
    assert [c["conversation"] for c in doc["conversations"]] == ["[/bold]first", "[red]last"]
    assert [_line_of(e, path) for e in doc["errors"]] == bad_lines

    text = CliRunner().invoke(cli, [*base, "--on-error", "skip"])
    assert text.exit_code == 0 and text.exception is None, text.output
    assert "[/bold]first" in text.output and "[red]last" in text.output
    assert text.output.count("skipped: ") == len(bad_lines)

    failed = CliRunner().invoke(cli, [*base, "--json"])
    assert failed.exit_code == 1 and isinstance(failed.exception, SystemExit)
    assert f"Error: {path}:2: nested more than" in failed.output
    assert "Traceback" not in failed.output


def _line_of(error: str, path: Path) -> int:
    match = re.match(rf"{re.escape(str(path))}:(\d+): ", error)
    assert match is not None, error
    return int(match[1])


# --- fuzzing ------------------------------------------------------------------------------

TEXT = st.text(max_size=24)
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


@st.composite
def content(draw: st.DrawFn) -> tuple[Any, str]:
    """Message content as logged (a string or content parts) and the text it stands for."""
    if draw(st.booleans()):
        text = draw(TEXT)
        return text, text
    parts = draw(
        st.lists(
            st.one_of(
                TEXT.map(lambda t: {"type": "text", "text": t}),
                TEXT.map(lambda t: {"text": t}),
                st.just({"type": "image_url", "image_url": {"url": "u"}}),
            ),
            max_size=3,
        )
    )
    return parts, "".join(p.get("text", "") for p in parts)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
    """A valid log line, the messages replay must read from it, and its system prompt."""
    sharegpt = draw(st.booleans())
    roles = draw(st.lists(st.sampled_from(ROLES), max_size=4))
    roles.insert(draw(st.integers(0, len(roles))), "user")
    if draw(st.booleans()):
        roles.insert(0, "system")
    logged, expected = [], []
    for role in roles:
        if sharegpt:
            text = draw(TEXT)
            logged.append({"from": SHAREGPT[role], "value": text})
            expected.append({"role": role, "content": text})
            continue
        raw, text = draw(content())
        message: dict[str, Any] = {"role": role, "content": raw}
        if draw(st.booleans()):
            message["name"] = draw(SHORT)
            expected.append({"role": role, "content": text, "name": message["name"]})
        else:
            expected.append({"role": role, "content": text})
        if draw(st.booleans()):
            message["status"] = draw(st.sampled_from(["complete", "partial"]))
        logged.append(message)
    system = None
    if expected[0]["role"] == "system":
        system = expected.pop(0)["content"]
    line: dict[str, Any] = {"conversations" if sharegpt else "messages": logged}
    line["id"] = f"c{next(_ids)}-{draw(SHORT)}"
    if draw(st.booleans()):
        line["probes"] = [{"fact": draw(SHORT), "asked_turn": draw(st.integers(0, 5))}]
    return line, expected, system


def _mutate_message(line: dict[str, Any], index: int, **changes: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(line))
    key = "conversations" if "conversations" in out else "messages"
    out[key][index % len(out[key])] |= changes
    return out


@st.composite
def broken(draw: st.DrawFn, line: dict[str, Any]) -> tuple[Any, str]:
    """A valid line with one thing made invalid (a JSON value or JSON text) and the reason."""
    at = draw(st.integers(0, 10))
    sharegpt = "conversations" in line
    choice = draw(st.integers(0, 11))
    if choice == 0:
        junk = st.text(max_size=8).filter(lambda r: r not in ROLES and r not in SPEAKERS)
        role = draw(junk | st.integers() | st.none() | st.lists(st.integers(), max_size=1))
        key = "from" if sharegpt else "role"
        return _mutate_message(line, at, **{key: role}), "unknown role"
    if choice == 1:
        value = draw(
            st.integers()
            | st.booleans()
            | st.just({"text": "x"})
            | st.lists(st.integers() | st.text(max_size=3) | st.none(), min_size=1, max_size=2)
            | st.just([{"type": "text", "text": 1}])
            | st.just([{"type": "text", "text": None}])
        )
        key = "value" if sharegpt else "content"
        return _mutate_message(line, at, **{key: value}), "must be a string|content part"
    if choice == 2:
        text = draw(TEXT) + draw(st.characters(categories=["Cs"])) + draw(TEXT)
        key = "value" if sharegpt else "content"
        return _mutate_message(line, at, **{key: text}), "lone surrogate|invalid UTF-8"
    if choice == 3:
        # the line nests depth + 1 levels (the top object holds the probes)
        depth = draw(st.integers(MAX_DEPTH, 3000) | st.just(60_000))
        marker = "\u2603deep\u2603"
        text = json.dumps(line | {"probes": marker}).replace(json.dumps(marker), nested(depth))
        return text, "nested more than"
    if choice == 4:
        value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308 * 10]))
        return line | {"extra": [value]}, "is not valid JSON|out of range"
    if choice == 5:
        key = "conversations" if sharegpt else "messages"
        value = draw(st.none() | st.integers() | st.text(max_size=3) | st.just({}))
        return line | {key: value}, "list"
    if choice == 6:
        key = "conversations" if sharegpt else "messages"
        value = draw(st.none() | st.integers() | st.text(max_size=3) | st.lists(st.none()))
        return line | {key: [*line[key], value]}, "expected an object"
    if choice == 7:
        status = draw(st.text(max_size=8).filter(lambda s: s not in ("complete", "partial")))
        return _mutate_message(line, at, status=status), "unknown status"
    if choice == 8:
        value = draw(
            st.sampled_from([3, "p", [1], [{"fact": 1, "asked_turn": 0}], [{"fact": "f"}]])
        )
        return line | {"probes": value}, "probe"
    if choice == 9:
        value = draw(st.sampled_from([[1], {"a": 1}, 2.5, True, "", " "]))
        return line | {"id": value}, '"id" must'
    if choice == 10:
        key = "conversations" if sharegpt else "messages"
        keep = [m for m in line[key] if "system" in (m.get("role"), m.get("from"))]
        return line | {key: keep}, "empty conversation"
    value = draw(JSONISH.filter(lambda v: not isinstance(v, dict)))
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))  # "" must not become blank
    return text, "expected a JSON object|lone surrogate|invalid UTF-8|not valid JSON|out of range"


def encode(value: Any, ascii_only: bool) -> bytes:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=ascii_only)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def log_files(draw: st.DrawFn, max_lines: int) -> tuple[list[bytes], list[Any], dict[int, str]]:
    """Lines of a log file: valid conversations, broken ones and blank lines.

    Returns the lines, what each valid line must parse to (None for the others) and the
    reason expected for each broken line (1-based).
    """
    lines: list[bytes] = []
    expected: list[Any] = []
    reasons: dict[int, str] = {}
    for _ in range(draw(st.integers(1, max_lines))):
        line, messages, system = draw(conversations())
        kind = draw(st.sampled_from(["valid", "broken", "blank"]))
        ascii_only = draw(st.booleans())
        if kind == "blank":
            lines.append(draw(st.sampled_from([b"", b"  ", b"\t", b"\r"])))
            expected.append(None)
        elif kind == "valid":
            lines.append(encode(line, ascii_only))
            expected.append((line["id"], messages, system))
        else:
            value, reason = draw(broken(line))
            lines.append(encode(value, ascii_only))
            expected.append(None)
            reasons[len(lines)] = reason
    return lines, expected, reasons


@settings(FUZZ, max_examples=250)
@given(
    value=st.one_of(
        JSONISH.map(lambda v: encode(v, True)),
        JSONISH.map(lambda v: encode(v, False)),
        st.dictionaries(
            st.sampled_from(["id", "messages", "conversations", "probes"]), JSONISH
        ).map(lambda v: encode(v, True)),
        st.binary(max_size=40),
    ),
    as_text=st.booleans(),
)
def test_fuzz_parse_logged_random_json_and_bytes(value: bytes, as_text: bool) -> None:
    # Only ImportFormatError may come out; what is accepted is well-formed for the replayer.
    line: str | bytes = value.decode("utf-8", "surrogateescape") if as_text else value
    try:
        conversation = parse_logged(line, line=7, source="f.jsonl")
    except ImportFormatError as exc:
        assert exc.line == 7 and str(exc).startswith("f.jsonl:7: ")
        return
    assert any(m["role"] == "user" for m in conversation.messages)
    for message in conversation.messages:
        assert message["role"] in ROLES and isinstance(message["content"], str)
        message["content"].encode("utf-8")  # never a lone surrogate
    assert conversation.turns()


@settings(FUZZ, max_examples=80)
@given(files=st.lists(log_files(max_lines=5), min_size=1, max_size=2))
def test_fuzz_read_logs_skip_keeps_exactly_the_valid_lines(
    files: list[tuple[list[bytes], list[Any], dict[int, str]]],
) -> None:
    # The oracle is the generator: which lines it broke, and what the valid ones hold.
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for number, (lines, _, _) in enumerate(files):
            path = Path(folder) / f"f{number}.jsonl"
            path.write_bytes(b"\n".join(lines) + b"\n")
            paths.append(str(path))
        errors: list[ImportFormatError] = []
        got = list(read_logs(paths, on_error="skip", errors=errors))
        first_bad = next(
            ((p, min(r)) for p, (_, _, r) in zip(paths, files, strict=True) if r), None
        )
        if first_bad is None:
            assert len(list(read_logs(paths))) == len(got)
        else:
            with pytest.raises(ImportFormatError) as info:
                list(read_logs(paths))
            assert (info.value.source, info.value.line) == first_bad
    want = [e for _, expected, _ in files for e in expected if e is not None]
    assert [(c.id, c.messages, c.system_prompt) for c in got] == want
    bad = [(p, n) for p, (_, _, r) in zip(paths, files, strict=True) for n in sorted(r)]
    assert [(e.source, e.line) for e in errors] == bad
    for error in errors:
        reason = dict(zip(paths, files, strict=True))[error.source][2][error.line]
        assert str(error).startswith(f"{error.source}:{error.line}: ")
        assert re.search(reason, str(error)), (reason, str(error))


@pytest.fixture(scope="module")
def dry_replayer(tiny_llama3_path: Path) -> Replayer:
    return Replayer(ReplayConfig(mode="dry", budget=64, reserve=8), model=tiny_llama3_path)


@settings(FUZZ, max_examples=20)
@given(data=log_files(max_lines=4))
def test_fuzz_replay_all_skips_and_reports(
    dry_replayer: Replayer, data: tuple[list[bytes], list[Any], dict[int, str]]
) -> None:
    # Parsed conversations through the dry replayer at a tight budget: a conversation that
    # cannot be replayed is reported with its line, never raised past skip.
    lines, expected, reasons = data
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        input_errors: list[ImportFormatError] = []
        errors: list[str] = []
        reports = replay_all(
            dry_replayer,
            read_logs([str(path)], on_error="skip", errors=input_errors),
            errors=errors,
            on_error="skip",
        )
    assert sorted(e.line for e in input_errors) == sorted(reasons)
    line_of = {e[0]: number for number, e in enumerate(expected, start=1) if e is not None}
    replayed = [line_of[r.conversation] for r in reports]
    failed = [_line_of(e, path) for e in errors]
    assert sorted(replayed + failed) == sorted(line_of.values())
    assert not [e for e in errors if "internal error" in e]  # a bug, not a bad conversation


ERROR_LINE = re.compile(r"^Error: (?P<file>.+?):(?P<line>\d+): ", re.MULTILINE)


@settings(FUZZ, max_examples=3)
@given(data=log_files(max_lines=8), skip=st.booleans())
def test_fuzz_replay_cli(
    tiny_llama3_path: Path, data: tuple[list[bytes], list[Any], dict[int, str]], skip: bool
) -> None:
    # Each run loads the tokenizer (about 3 s), so few runs with many lines each.
    lines, _, reasons = data
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cli.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        args = ["replay", str(path), "--dry-run", "--model", str(tiny_llama3_path), "--json"]
        args += ["--budget", "64", "--reserve", "8"]
        result = CliRunner().invoke(cli, [*args, "--on-error", "skip" if skip else "fail"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 1), result.output
    if skip:
        assert result.exit_code == 0, result.output
        doc = json.loads(result.output)
        lines_reported = {_line_of(e, path) for e in doc["errors"]}
        assert set(reasons) <= lines_reported
        assert not [e for e in doc["errors"] if "internal error" in e]
    elif result.exit_code == 1:
        match = ERROR_LINE.search(result.output)
        assert match is not None and match["file"] == str(path), result.output
    else:
        assert not reasons
