"""The seam between a conversation and whatever runs the model.

``ChatSession`` needs a codec, a slot per turn, generation, side completions for summaries
and the room a slot holds, nothing more. ``Engine`` (llama.cpp in this process) is one
backend; replay's dry run is another that loads no weights; an HTTP backend for
llama-server would be a third.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from chatctx.config import GenerationSettings
from chatctx.engine._codec import PromptCodec
from chatctx.engine._results import GenerationResult, ModelInfo
from chatctx.engine._slots import Lease

__all__ = ["Backend", "Lease", "Stream"]


class Stream(Protocol):
    """A generation in progress: iterate for text; ``result`` once it ended."""

    result: GenerationResult | None
    text: str

    def __iter__(self) -> Iterator[str]: ...

    def __next__(self) -> str: ...

    def close(self) -> None: ...

    def wait(self, *, first_token_only: bool = False) -> GenerationResult: ...


@runtime_checkable
class Backend(Protocol):
    """What a conversation needs from the model runtime."""

    @property
    def n_ctx(self) -> int:
        """Tokens one slot holds: the conversation's prompt and reply together."""
        ...

    @property
    def side_room(self) -> int:
        """Tokens a side completion (a summary) may use; 0 when there is no side sequence."""
        ...

    @property
    def model_name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def info(self) -> ModelInfo: ...

    def codec(self) -> PromptCodec: ...

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...

    def lease(self, conversation: str, *, timeout: float | None = None) -> Lease: ...

    def release(self, lease: Lease) -> None: ...

    def pin(self, conversation: str, seq_id: int) -> None: ...

    def unpin(self, conversation: str) -> None: ...

    def generate(
        self,
        prompt: Sequence[int],
        *,
        seq_id: int = 0,
        settings: GenerationSettings | None = None,
        eviction: str = "shift",
        history_start: int | None = None,
    ) -> Stream: ...

    def side_generate(
        self,
        prompt: Sequence[int],
        *,
        settings: GenerationSettings,
        background: bool = False,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> str: ...

    def cancel_side(self, cancel: threading.Event) -> None: ...

    def kv_usage(self) -> dict[int, int]: ...

    def close(self) -> None: ...
