"""Chat templates: the GGUF's own Jinja template, rendered the way Hugging Face renders it.

llama.cpp falls back to a "llama-2" format when a model has no template; chatctx never does:
without a template, a built-in format must be named explicitly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatctx.errors import ModelError

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


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """A compiled chat template with the model's special token strings."""

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "gguf"
    ) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ModelError(f"the chat template ({name}) does not compile: {exc}") from exc
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` (dicts in OpenAI chat format)."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ModelError(f"the chat template ({self.name}) failed: {exc}") from exc
