"""Tool calls: OpenAI-shaped function tools checked, and a model's output parsed into calls.

Each model family writes its calls its own way (the formats llama.cpp's ``common/chat.cpp``
handles, read there; this is chatctx's own code):

- ``llama3``: Llama 3.1/3.2/3.3 answer a call with a JSON object and nothing else,
  ``{"name": ..., "parameters": {...}}`` (``"type": "function"`` may come first; some write
  ``"arguments"``), after ``<|python_tag|>`` at times. Several objects, one after another or
  separated by ``;``, are parallel calls.
- ``hermes``: Hermes, Qwen 2.5 and other ChatML models wrap each call in ``<tool_call>`` …
  ``</tool_call>``; the text around the blocks is the reply's content.
- ``generic``: a template with no tool support (the embedded SmolLM2's) is told in its system
  turn to answer in JSON: ``{"tool_call": {"name", "arguments"}}``, ``{"tool_calls": [...]}``
  (parallel, each with an ``id``) or ``{"response": "..."}``.

A call that does not parse, names a function the request did not offer, or whose arguments
are not a JSON object is never raised: the output goes back as text, with a warning that the
turn record keeps.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from chatctx.errors import ConfigError

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "FORMATS",
    "GENERIC_INSTRUCTIONS",
    "CallGrammar",
    "ParsedReply",
    "ReplyFilter",
    "ToolCall",
    "ToolChoice",
    "ToolFormat",
    "arguments_value",
    "call_grammar",
    "call_schema",
    "check_tool_choice",
    "check_tools",
    "generic_messages",
    "parse_tool_calls",
    "tool_format",
]

ToolFormat = Literal["llama3", "hermes", "generic"]
FORMATS: tuple[ToolFormat, ...] = ("llama3", "hermes", "generic")

# What OpenAI accepts as a function name.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PYTHON_TAG = "<|python_tag|>"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: its id (``call_…``, made here where the model gives none), the function's
    name and its arguments as JSON text (as OpenAI sends them)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A reply as text and calls. ``warning`` says why output that looked like a call was
    kept as text (then ``calls`` is empty and ``content`` is the whole output)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    warning: str | None = None

    def first_call_only(self) -> ParsedReply:
        """The reply with its first call only (``parallel_tool_calls`` false), saying so."""
        if len(self.calls) <= 1:
            return self
        return ParsedReply(
            self.content,
            self.calls[:1],
            f"parallel_tool_calls is false: the first of {len(self.calls)} calls was kept",
        )


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def check_tools(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The request's function tools by name, or ``ConfigError`` naming the bad field
    (``tools[i].function.name`` …): OpenAI's shape, ``{"type": "function", "function":
    {"name", "description"?, "parameters"?}}``, names unique."""
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise ConfigError("tools must be a list of function tools", field="tools")
    by_name: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ConfigError(f"{where} must be an object", field=where)
        if tool.get("type") != "function":
            raise ConfigError(
                f"{where}.type must be 'function', not {tool.get('type')!r}", field=f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ConfigError(f"{where}.function must be an object", field=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-', not {name!r}",
                field=f"{where}.function.name",
            )
        if name in by_name:
            raise ConfigError(
                f"{where}.function.name {name!r} is offered twice", field=f"{where}.function.name"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ConfigError(
                f"{where}.function.description must be a string",
                field=f"{where}.function.description",
            )
        parameters = function.get("parameters")
        if parameters is not None and (
            not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object"
        ):
            raise ConfigError(
                f"{where}.function.parameters must be a JSON schema of an object",
                field=f"{where}.function.parameters",
            )
        by_name[name] = function
    return by_name


def tool_format(template: str | None) -> ToolFormat:
    """The call format a chat template was trained with, read from its source: Hermes-style
    ``<tool_call>`` blocks, Llama 3.x JSON calls (its templates speak of ``ipython`` and
    ``<|python_tag|>``), else the generic JSON answer."""
    source = template or ""
    if _HERMES_OPEN in source:
        return "hermes"
    if "<|start_header_id|>" in source and (
        "ipython" in source or _PYTHON_TAG in source or "tools" in source
    ):
        return "llama3"
    return "generic"


def parse_tool_calls(
    text: str,
    fmt: ToolFormat,
    tools: Mapping[str, Any],
    *,
    ids: Callable[[], str] = new_call_id,
) -> ParsedReply:
    """``text`` (the model's whole output) as content and calls in format ``fmt``; ``tools``
    are the functions offered (by name, as ``check_tools`` returns them)."""
    if fmt == "hermes":
        return _hermes(text, tools, ids)
    if fmt == "llama3":
        return _llama3(text, tools, ids)
    if fmt == "generic":
        return _generic(text, tools, ids)
    raise ConfigError(f"unknown tool call format {fmt!r}; one of {', '.join(FORMATS)}")


def _call(
    raw: Any, tools: Mapping[str, Any], ids: Callable[[], str], *, keys: Sequence[str]
) -> ToolCall | str:
    """One call object as a ``ToolCall``, or why it is not one."""
    if not isinstance(raw, Mapping):
        return "a call is not a JSON object"
    name = raw.get("name")
    if not isinstance(name, str):
        return "a call has no function name"
    if name not in tools:
        return f"the model called {name!r}, which was not offered"
    arguments: Any = {}
    for key in keys:
        if key in raw:
            arguments = raw[key]
            break
    if isinstance(arguments, str):  # some models send the arguments already as JSON text
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            return f"the arguments of {name!r} are not JSON"
    if not isinstance(arguments, Mapping):
        return f"the arguments of {name!r} are not a JSON object"
    given = raw.get("id")
    call_id = given if isinstance(given, str) and given.strip() else ids()
    return ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False))


def _all_calls(
    text: str,
    items: Sequence[Any],
    tools: Mapping[str, Any],
    ids: Callable[[], str],
    *,
    keys: Sequence[str],
) -> ParsedReply:
    """A reply of calls only, or ``text`` kept as text when any item is not a good call."""
    calls: list[ToolCall] = []
    for item in items:
        call = _call(item, tools, ids, keys=keys)
        if isinstance(call, str):
            return _as_text(text, call)
        if any(c.id == call.id for c in calls):  # results are matched to calls by id
            call = ToolCall(ids(), call.name, call.arguments)
        calls.append(call)
    return ParsedReply(content="", calls=tuple(calls))


def _as_text(text: str, why: str) -> ParsedReply:
    return ParsedReply(content=text, warning=f"tool call not understood, kept as text: {why}")


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in ``text``, one after another (whitespace or ``;`` between), or None
    when anything else is there (a truncated value included)."""
    # Lenient about control characters inside strings: models write raw newlines and tabs
    # in an argument's text, which the arguments re-written by ``json.dumps`` escape.
    decoder = json.JSONDecoder(strict=False)
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _llama3(text: str, tools: Mapping[str, Any], ids: Callable[[], str]) -> ParsedReply:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    if not body.startswith(("{", "[")):
        return ParsedReply(content=text)  # a plain reply: calls come alone, first
    values = _json_values(body)
    if values is None:
        return _as_text(text, "the JSON of the call is cut off or malformed")
    items = [v for value in values for v in (value if isinstance(value, list) else [value])]
    if not all(isinstance(v, Mapping) and "name" in v for v in items):
        return ParsedReply(content=text)  # JSON the model wrote as its answer, not a call
    return _all_calls(text, items, tools, ids, keys=("parameters", "arguments"))


def _hermes(text: str, tools: Mapping[str, Any], ids: Callable[[], str]) -> ParsedReply:
    if _HERMES_OPEN not in text:
        return ParsedReply(content=text)
    content, calls, at = [], [], 0
    while (start := text.find(_HERMES_OPEN, at)) >= 0:
        content.append(text[at:start])
        end = text.find(_HERMES_CLOSE, start)
        if end < 0:
            return _as_text(text, f"{_HERMES_OPEN} without {_HERMES_CLOSE}")
        inner = text[start + len(_HERMES_OPEN) : end]
        values = _json_values(inner)
        if values is None or len(values) != 1:
            return _as_text(text, "the JSON of the call is cut off or malformed")
        call = _call(values[0], tools, ids, keys=("arguments", "parameters"))
        if isinstance(call, str):
            return _as_text(text, call)
        calls.append(call)
        at = end + len(_HERMES_CLOSE)
    content.append(text[at:])
    return ParsedReply(content="".join(content).strip(), calls=tuple(calls))


def _generic(text: str, tools: Mapping[str, Any], ids: Callable[[], str]) -> ParsedReply:
    body = text.strip()
    if not body.startswith("{"):
        return ParsedReply(content=text)  # the model answered in prose after all
    values = _json_values(body)
    if values is None or len(values) != 1 or not isinstance(values[0], Mapping):
        return _as_text(text, "the JSON answer is cut off or malformed")
    answer = values[0]
    if "tool_calls" in answer or "tool_call" in answer:
        raw = answer.get("tool_calls", [answer.get("tool_call")])
        if not isinstance(raw, list) or not raw:
            return _as_text(text, "tool_calls is not a list of calls")
        return _all_calls(text, raw, tools, ids, keys=("arguments", "parameters"))
    if "response" in answer:
        response = answer["response"]
        return ParsedReply(
            content=response if isinstance(response, str) else json.dumps(response, indent=2)
        )
    return ParsedReply(content=text)


GENERIC_INSTRUCTIONS = (
    "You can call the tools listed below. Answer with one JSON object and nothing else: "
    '{"tool_call": {"name": "<tool>", "arguments": {...}}} to call a tool, '
    '{"tool_calls": [{"id": "<id>", "name": "<tool>", "arguments": {...}}, ...]} to call '
    'several at once, or {"response": "<your reply>"} to answer the user. A tool\'s result '
    'comes back as {"tool_response": ...}.'
)


def generic_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    escape: Callable[..., str] = json.dumps,
) -> list[dict[str, Any]]:
    """``messages`` for a template with no tool support: the tools and how to call them in
    the system turn, earlier calls as the JSON answer that made them, results as user turns
    holding ``{"tool_response": ...}``, and with tools offered, earlier answers as the
    ``{"response": ...}`` the model wrote them as. Unchanged when nothing in them is about tools.
    ``escape`` writes JSON (the template's, so special-token text never appears)."""
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return [dict(m) for m in messages]
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            # In the order of the keys a grammar-held call is written in (``call_schema``).
            calls = [
                {
                    "name": call.get("function", {}).get("name"),
                    "arguments": arguments_value(call.get("function", {}).get("arguments")),
                    "id": call.get("id"),
                }
                for call in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": escape({"tool_calls": calls})})
        elif role == "assistant" and tools and isinstance(message.get("content"), str):
            # An answer, as the grammar of ``tool_choice`` auto has the model write it.
            out.append({"role": "assistant", "content": escape({"response": message["content"]})})
        elif role == "tool":
            response = {
                "tool_call_id": message.get("tool_call_id"),
                "content": message.get("content"),
            }
            out.append({"role": "user", "content": escape({"tool_response": response})})
        else:
            out.append(dict(message))
    if tools:
        listing = escape([dict(tool.get("function", {})) for tool in tools], indent=2)
        text = f"{GENERIC_INSTRUCTIONS}\n\n{listing}"
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".lstrip()
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def arguments_value(arguments: Any) -> Any:
    """A call's arguments as a value (OpenAI sends them as JSON text; text that is not JSON
    stays as it is)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments, strict=False)
        except ValueError:
            return arguments
    return arguments


def call_schema(
    tools: Mapping[str, Mapping[str, Any]],
    fmt: ToolFormat,
    *,
    parallel: bool = False,
    name: str | None = None,
) -> dict[str, Any]:
    """The JSON schema a whole reply must meet when a call is required (``tool_choice``
    ``"required"``, or the function ``name``): a grammar made from it (llama.cpp's JSON schema
    converter) makes every sampled reply a call ``parse_tool_calls`` reads in format ``fmt``.
    Hermes-style calls are a JSON object inside the ``<tool_call>`` tags, which a grammar
    adds around this schema (``CALL_OPEN``/``CALL_CLOSE``)."""
    if name is not None and name not in tools:
        raise ConfigError(f"tool_choice names {name!r}, which is not in tools")
    names = [name] if name is not None else list(tools)
    key = "parameters" if fmt == "llama3" else "arguments"
    one = []
    for function_name in names:
        parameters = tools[function_name].get("parameters") or {"type": "object"}
        properties: dict[str, Any] = {"name": {"const": function_name}, key: dict(parameters)}
        required = ["name", key]
        if fmt == "generic":
            properties["id"] = {"type": "string", "pattern": "^call_[0-9a-z]{4,8}$"}
            required.append("id")
        one.append(
            {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            }
        )
    call = one[0] if len(one) == 1 else {"anyOf": one}
    if fmt == "generic":  # always the list: earlier calls are written back in this form
        calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        return {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
    return call


CALL_OPEN, CALL_CLOSE = _HERMES_OPEN, _HERMES_CLOSE


# -- what the caller asks for: tool_choice, and the grammar that enforces it -------------------

# "auto": the model decides; "none": it answers in text (its output is not read as calls);
# "required": it calls one of the tools; any other string: it calls that function.
ToolChoice = str


def check_tool_choice(choice: Any, tools: Mapping[str, Any]) -> ToolChoice:
    """``tool_choice`` as OpenAI takes it (``"auto"``, ``"none"``, ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``) as one string: the three modes, or
    the name of the function that must be called. ``ConfigError`` names what is wrong."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ConfigError(
                f"tool_choice must be 'auto', 'none', 'required' or a function, not {choice!r}",
                field="tool_choice",
            )
        if choice == "required" and not tools:
            raise ConfigError("tool_choice 'required' needs tools", field="tool_choice")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise ConfigError(
                "tool_choice.function.name must be a string", field="tool_choice.function.name"
            )
        if name not in tools:
            raise ConfigError(
                f"tool_choice.function.name {name!r} is not in tools",
                field="tool_choice.function.name",
            )
        return name
    raise ConfigError(
        "tool_choice must be a string or {'type': 'function', 'function': {...}}",
        field="tool_choice",
    )


@dataclass(frozen=True, slots=True)
class CallGrammar:
    """What a whole reply must be when a call is required: a JSON value meeting ``schema``,
    written between ``open`` and ``close`` (Hermes' tags) when they are set, once or, with
    ``repeat``, several times (parallel calls). A backend turns it into a llama.cpp grammar."""

    schema: dict[str, Any]
    open: str = ""
    close: str = ""
    repeat: bool = False


def call_grammar(
    tools: Mapping[str, Mapping[str, Any]],
    fmt: ToolFormat,
    choice: ToolChoice,
    *,
    parallel: bool = True,
) -> CallGrammar | None:
    """The grammar that makes every sampled reply a valid call when ``choice`` requires one
    (``"required"`` or a function's name); None when the model is free to answer in text.
    In the generic format (a template with no tool support) ``"auto"`` holds the reply to
    the JSON answer too, calls or ``{"response": ...}``, as llama.cpp does: a model never
    trained on calls writes them valid, or says why it does not call."""
    if choice == "auto" and fmt == "generic" and tools:
        calls = call_schema(tools, fmt, parallel=parallel)
        answer = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
        return CallGrammar({"anyOf": [calls, answer]})
    if choice in ("auto", "none") or not tools:
        return None
    name = None if choice == "required" else choice
    if fmt == "hermes":
        schema = call_schema(tools, fmt, name=name)
        return CallGrammar(schema, f"{CALL_OPEN}\n", f"\n{CALL_CLOSE}", repeat=parallel)
    return CallGrammar(call_schema(tools, fmt, parallel=parallel and fmt == "generic", name=name))


# -- streaming a reply that may be a call ---------------------------------------------------------


class ReplyFilter:
    """What of a reply being generated can be shown as text while it streams.

    A call must not reach the reader as text, so output that may be one is held back: a
    Llama 3 reply that opens with JSON (or ``<|python_tag|>``), everything from a Hermes
    ``<tool_call>`` on, and a generic JSON answer until it is known to be a ``response``,
    whose string is then shown as it comes, decoded. ``feed`` returns the text to show now,
    ``finish`` the parsed reply and the rest of its content. What was shown is always the
    start of the parsed reply's content.
    """

    def __init__(
        self,
        fmt: ToolFormat,
        tools: Mapping[str, Any],
        *,
        reading: bool = True,
        ids: Callable[[], str] = new_call_id,
    ) -> None:
        """``reading`` False (no tools, or ``tool_choice`` "none"): the output is all text."""
        self.fmt = fmt
        self.tools = tools
        self.reading = reading and bool(tools)
        self._ids = ids
        self._text = ""
        self._shown = 0  # characters of _text shown
        self._plain = not self.reading  # known to be text to its end
        self._held = False  # known to be a call (or past its shown part) to its end
        # A generic answer's response string: where its undecoded rest begins in _text, and
        # what of it was shown, decoded. None: not (yet) known to be one.
        self._raw: int | None = None
        self._decoded = ""

    def feed(self, chunk: str) -> str:
        """The text to show now. Each step looks at what ``chunk`` added, not at all of the
        reply again: long replies stream at the same cost per token."""
        self._text += chunk
        if self._plain:
            return self._show(len(self._text))
        if self._raw is not None:
            return self._more_response()
        if self._held:
            return ""
        if self.fmt == "hermes":
            at = self._text.find(_HERMES_OPEN, max(0, self._shown - len(_HERMES_OPEN)))
            if at >= 0:
                self._held = True
                return self._show(at)
            # Hold back what may be the start of an opening tag.
            keep = next(
                (
                    n
                    for n in range(min(len(_HERMES_OPEN) - 1, len(self._text)), 0, -1)
                    if _HERMES_OPEN.startswith(self._text[-n:])
                ),
                0,
            )
            return self._show(len(self._text) - keep)
        body = self._text.lstrip()  # short: only until the reply's kind is known
        if not body:
            return ""
        if self.fmt == "llama3":
            if body.startswith(("{", "[", _PYTHON_TAG)):
                self._held = True
                return ""
            if _PYTHON_TAG.startswith(body):
                return ""
        elif body.startswith("{"):  # generic: a JSON answer, a response or calls
            key = _FIRST_KEY.match(self._text)
            if key is None:
                return ""
            if key.group(1) != "response" or not (start := _RESPONSE_START.match(self._text)):
                self._held = key.group(1) != "response"
                return ""
            self._raw = start.end()
            return self._more_response()
        self._plain = True  # prose
        return self._show(len(self._text))

    def _show(self, upto: int) -> str:
        if upto <= self._shown:
            return ""
        out, self._shown = self._text[self._shown : upto], upto
        return out

    def _more_response(self) -> str:
        """The response string's characters written since the last step, decoded (an escape
        or a surrogate pair is never shown half; nothing after the closing quote)."""
        text, at = self._text, self._raw
        assert at is not None
        end, closed = at, False
        while end < len(text):
            char = text[end]
            if char == '"':
                closed = True
                break
            if char == "\\":
                size = 6 if text[end + 1 : end + 2] == "u" else 2
                if end + size > len(text):
                    break
                end += size
                continue
            end += 1
        if not closed and _HIGH_SURROGATE.search(text, at, end):
            end -= 6  # wait for the pair's second half
        try:
            new: str = json.loads(f'"{text[at:end]}"', strict=False)
        except ValueError:  # not JSON after all: the parse at the end says so
            self._raw, self._held = None, True
            return ""
        self._raw = None if closed else end
        self._held = closed
        self._decoded += new
        return new

    def finish(self) -> tuple[ParsedReply, str]:
        """The whole output parsed, and the content not yet shown."""
        if not self.reading:
            return ParsedReply(content=self._text), self._show(len(self._text))
        parsed = parse_tool_calls(self._text, self.fmt, self.tools, ids=self._ids)
        shown = self._decoded if self._decoded else self._text[: self._shown]
        for start in (shown, shown.strip()):  # Hermes' content is stripped of spaces
            if parsed.content.startswith(start):
                return parsed, parsed.content[len(start) :]
        return parsed, ""


_RESPONSE_START = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_FIRST_KEY = re.compile(r'\s*\{\s*"([^"\\]*)"')
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")
