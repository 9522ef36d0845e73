"""Chat templates: the GGUF's own Jinja template, rendered the way Hugging Face renders it.

llama.cpp falls back to a "llama-2" format when a model has no template; chatctx never does:
without a template, a built-in format must be named explicitly.

A rendered prompt remembers which characters came from message content
(``RenderedPrompt.content_spans``), so the codec can tokenize that text as text: a user who
types ``<|im_end|>`` gets the characters, never the control token (template-token injection).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatctx.errors import ModelError
from chatctx.model.tools import ToolFormat, arguments_value, generic_messages, tool_format

logger = logging.getLogger("chatctx.template")

# Content is rendered as a marker first, to learn where the template puts it. The marker is
# private-use text no template emits; the padding is whitespace that a template's ``trim``
# removes, which tells whether the template trims content.
_OPEN, _CLOSE, _PAD = "\ue000", "\ue001", "\u3000"


# Meta's Llama 3 Instruct template, as shipped in the Llama 3 GGUFs.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n'"
    " + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BUILTIN_FORMATS = {"llama-3": LLAMA3_TEMPLATE, "chatml": CHATML_TEMPLATE}


class RenderedPrompt(str):
    """Prompt text plus the (start, end) spans of message content in it, in order.

    A codec tokenizes content as text and only the rest (the template's markup) may become
    control tokens, so a user who types ``<|eot_id|>`` gets the characters, never a forged
    turn. ``content_spans`` is None when the template transformed content beyond trimming,
    so its place could not be found; the codec then neutralizes special-token text that
    occurs in any content. A plain ``str`` carries no such knowledge: codecs refuse it.
    """

    content_spans: tuple[tuple[int, int], ...] | None
    contents: tuple[str, ...]

    def __new__(
        cls,
        text: str,
        spans: Sequence[tuple[int, int]] | None,
        contents: Sequence[str] = (),
    ) -> RenderedPrompt:
        obj = super().__new__(cls, text)
        obj.content_spans = None if spans is None else tuple(spans)
        obj.contents = tuple(contents)
        return obj


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _arguments_as_objects(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message whose calls' arguments (JSON text, as OpenAI sends them) are objects: the
    templates of models trained on calls write ``arguments | tojson``, which then gives the
    JSON the model wrote rather than a quoted string (llama.cpp does the same)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if isinstance(function, Mapping) and isinstance(arguments, str):
            value = arguments_value(arguments)
            if isinstance(value, dict):
                call = {**call, "function": {**function, "arguments": value}}
        out.append(call)
    return {**message, "tool_calls": out}


def escape_specials(text: str, specials: re.Pattern[str] | None) -> str:
    """JSON text with no special-token text in it: the first character of each occurrence is
    written as a ``\\u`` escape. Special-token text can only be inside a JSON string, where
    the escape means the same character, so the value is unchanged and a tool's schema or a
    call's arguments can never become a control token."""
    if specials is None:
        return text
    return specials.sub(lambda m: f"\\u{ord(m.group()[0]):04x}{m.group()[1:]}", text)


class ChatTemplate:
    """A compiled chat template with the model's special token strings."""

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "gguf"
    ) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = self._tojson
        self._specials: re.Pattern[str] | None = None
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ModelError(f"the chat template ({name}) does not compile: {exc}") from exc
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._tool_format = tool_format(source)  # read once: asked on every agent turn

    def protect(self, specials: Iterable[str]) -> None:
        """The model's special-token texts: JSON the template writes (tool schemas, calls'
        arguments) never contains them as such (``escape_specials``)."""
        texts = sorted(set(specials), key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, texts))) if texts else None

    def _tojson(self, value: Any, indent: int | None = None) -> str:
        return escape_specials(_tojson(value, indent), self._specials)

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
    ) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **variables,
            )
        except TemplateError as exc:
            raise ModelError(f"the chat template ({self.name}) failed: {exc}") from exc

    @property
    def tool_format(self) -> ToolFormat:
        """How this template's model writes tool calls (``chatctx.model.tools``)."""
        return self._tool_format

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> RenderedPrompt:
        """The prompt text for ``messages`` (dicts in OpenAI chat format), with content spans.

        ``tools`` (OpenAI function tools, checked by ``check_tools``) go to a template that
        takes them (Llama 3.1+, Hermes/Qwen); for any other the system turn lists them and
        asks for the generic JSON answer, and earlier calls and results are written in it.
        """
        variables: dict[str, Any] = {}
        if self.tool_format == "generic":
            messages = generic_messages(messages, tools, escape=self._tojson)
        else:
            messages = [_arguments_as_objects(m) for m in messages]
            if tools:
                variables = {"tools": [dict(t) for t in tools], "tools_in_user_message": False}
        plain = [dict(m) for m in messages]
        marked: list[dict[str, Any]] = []
        contents: list[tuple[str, str]] = []  # (marker, content)
        for i, message in enumerate(plain):
            content = message.get("content")
            if isinstance(content, str) and content:
                key = f"{_OPEN}{i}{_CLOSE}"
                contents.append((key, content))
                marked.append(message | {"content": _PAD + key + _PAD})
            else:
                marked.append(message)
        if not contents:
            return RenderedPrompt(self._render(plain, add_generation_prompt, variables), ())
        skeleton = self._render(marked, add_generation_prompt, variables)
        found = self._substitute(skeleton, contents)
        if found is not None:
            return found
        # The template changed the content (not only trimmed it): fall back to the real
        # rendering; the codec then treats special-token text in any content as text.
        logger.debug("template %s transforms content; content spans unknown", self.name)
        text = self._render(plain, add_generation_prompt, variables)
        return RenderedPrompt(text, None, [c for _, c in contents])

    @staticmethod
    def _substitute(skeleton: str, contents: list[tuple[str, str]]) -> RenderedPrompt | None:
        """Put each content where its marker is; None if a marker is not there exactly once."""
        located = []
        for key, content in contents:
            at = skeleton.find(key)
            if at < 0 or skeleton.find(key, at + 1) >= 0:
                return None
            located.append((at, key, content))
        located.sort()
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = length = 0
        pad = len(_PAD)
        for at, key, content in located:
            start, end = at, at + len(key)
            if skeleton[start - pad : start] == _PAD:
                start -= pad
            else:
                content = content.lstrip()
            if skeleton[end : end + pad] == _PAD:
                end += pad
            else:
                content = content.rstrip()
            if start < pos:
                return None
            out.append(skeleton[pos:start])
            length += start - pos
            spans.append((length, length + len(content)))
            out.append(content)
            length += len(content)
            pos = end
        out.append(skeleton[pos:])
        text = "".join(out)
        if _OPEN in skeleton[pos:] or any(_OPEN in part for part in out[::2]):
            return None  # a marker survived somewhere else: the template copied content
        return RenderedPrompt(text, [(a, b) for a, b in spans if b > a])


def template_for(
    meta: Mapping[str, Any],
    *,
    chat_template: str | None,
    chat_format: str | None,
    path: str,
) -> ChatTemplate:
    """The one rule for a model's template: an override, else the GGUF's own, else a named
    built-in format; without any of them a ``ModelError`` (chatctx never guesses one)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []  # a header read without arrays

    def text(key: str) -> str:
        value = meta.get(key)
        return tokens[value] if isinstance(value, int) and 0 <= value < len(tokens) else ""

    bos, eos = text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id")
    if chat_template:
        return ChatTemplate(chat_template, bos_token=bos, eos_token=eos, name="override")
    source = meta.get("tokenizer.chat_template")
    if isinstance(source, str) and source.strip():
        return ChatTemplate(source, bos_token=bos, eos_token=eos, name="gguf")
    if chat_format:
        if chat_format not in BUILTIN_FORMATS:
            raise ModelError(f"unknown chat format {chat_format!r}", path=path)
        return ChatTemplate(
            BUILTIN_FORMATS[chat_format], bos_token=bos, eos_token=eos, name=chat_format
        )
    raise ModelError(
        f"{path} has no chat template; pass chat_format='llama-3' or 'chatml' "
        "(--chat-format) or a chat_template, chatctx never guesses one",
        path=path,
    )
