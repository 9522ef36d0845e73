"""OpenAI's chat completion shapes, as far as chatctx serves them.

Requests are validated strictly: an unknown field is a 400 (``unknown_parameter``), a known
OpenAI field chatctx cannot honour (logprobs, ``n`` > 1 ...) a 400
(``unsupported_parameter``), unless it is given its no-op value.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Conversation ids as clients give them: no whitespace, no "/" (they live in URL paths).
CONVERSATION_ID = r"^[A-Za-z0-9_.:@+=-]{1,128}$"
MAX_SEED = 2**32 - 1
MAX_STOP_CHARS = 256  # a stop string is held back from every chunk: bounded work per chunk

# Fields OpenAI defines that chatctx does not honour, with the values that change nothing.
_NO_OP: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "web_search_options": (None,),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """A text part of a message's content (other part types are unsupported)."""

    type: Literal["text"]
    text: str


def _check_storable(text: str, what: str) -> None:
    """Text every store keeps as it is: PostgreSQL refuses U+0000, and a lone surrogate
    (valid in JSON) is no UTF-8 at all."""
    if "\x00" in text:
        raise PydanticCustomError(
            "invalid_text", "{what} may not contain the NUL character (U+0000)", {"what": what}
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError(
            "invalid_text", "{what} is not valid Unicode (a lone surrogate)", {"what": what}
        ) from None


class FunctionCall(_Strict):
    name: str = Field(max_length=64)
    arguments: str


class ToolCallIn(_Strict):
    """A call an earlier assistant message made (OpenAI's shape)."""

    id: str = Field(min_length=1, max_length=200)
    type: Literal["function"] = "function"
    function: FunctionCall
    # A streamed call's position, which clients assembling deltas keep: accepted, not stored.
    index: int | None = Field(None, ge=0)


class ChatMessage(_Strict):
    """One message of a request (``developer`` is taken as ``system``); ``tool`` messages
    carry the result of the call ``tool_call_id`` names."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=200)

    def stored(self) -> dict[str, Any]:
        """The message as the store keeps it."""
        out: dict[str, Any] = {"role": self.stored_role, "content": self.text(), "name": self.name}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump(exclude={"index"}) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise PydanticCustomError(
                        "unsupported_content",
                        "content parts of type {kind} are not supported (text only)",
                        {"kind": str(kind)},
                    )
        return value

    @field_validator("content")
    @classmethod
    def _storable(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        texts = [value] if isinstance(value, str) else [p.text for p in value or ()]
        for text in texts:
            _check_storable(text, "message text")
        return value

    @field_validator("name")
    @classmethod
    def _storable_name(cls, value: str | None) -> str | None:
        if value is not None:
            _check_storable(value, "a message's name")
        return value

    @property
    def stored_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    """``POST /v1/chat/completions``; ``conversation`` (chatctx's own) makes it stateful."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"additionalProperties": False})

    model: str | None = Field(None, max_length=256, description="Any name: one model is served.")
    messages: list[ChatMessage] = Field(min_length=1)
    conversation: str | None = Field(
        None,
        pattern=CONVERSATION_ID,
        description="Stored conversation to continue (created on first use): send only the "
        "new messages (earlier ones the conversation already ends with are not stored again). "
        "Without it the request is stateless.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: str | None = Field(None, max_length=256)
    # Known OpenAI fields without support: accepted only with their no-op value.
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        for name, allowed in _NO_OP.items():
            if getattr(self, name) not in allowed:
                raise PydanticCustomError(
                    "unsupported_parameter",
                    "{name} is not supported by chatctx serve",
                    {"name": name},
                )
        stops = self.stop_list()
        if len(stops) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise PydanticCustomError(
                "invalid_stop",
                f"stop takes up to 4 non-empty strings of at most {MAX_STOP_CHARS} characters",
                {"name": "stop"},
            )
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "invalid_stream_options",
                "stream_options is only allowed with stream: true",
                {"name": "stream_options"},
            )
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def reply_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def generation_overrides(self) -> dict[str, Any]:
        """The request's sampling fields as ``GenerationSettings`` fields."""
        values = {
            "max_tokens": self.reply_limit(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        return {k: v for k, v in values.items() if v is not None}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer: ``{"error": {...}}``."""

    error: ErrorDetail


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion(
    *,
    id: str,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict[str, Any] | None,
    chatctx: dict[str, Any],
    created: int | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` object (``chatctx``: what the server did, an extension); a
    reply that calls tools has ``tool_calls`` (and no content unless the model wrote some)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return {
        "id": id,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
        "chatctx": chatctx,
    }


def completion_chunk(
    *,
    id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
    chatctx: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``; with ``delta`` None it carries no choice (the usage)."""
    out: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage is not None:
        out["usage"] = usage
    if chatctx is not None:
        out["chatctx"] = chatctx
    return out
