"""Plain, immutable records the store hands out (no live ORM objects leak out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class Message:
    """One stored chat message."""

    id: int
    conversation_id: str
    position: int
    role: str
    content: str
    status: str = "complete"
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    created_at: datetime | None = None
    pinned: bool = False

    def to_openai(self) -> dict[str, Any]:
        """The message in OpenAI chat format (only the fields that are set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        return out


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation's own settings; its messages come from ``Store.messages``."""

    id: str
    title: str | None
    system_prompt: str | None
    settings: dict[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None
    message_count: int = 0
    metadata: dict[str, str] | None = None  # OpenAI's (the Conversations API)


@dataclass(frozen=True, slots=True)
class Turn:
    """Token and timing figures of one generated reply."""

    id: int
    conversation_id: str
    user_message_id: int | None
    assistant_message_id: int | None
    model: str | None
    seq_id: int
    n_ctx: int
    prompt_tokens: int
    reused_tokens: int
    evaluated_tokens: int
    generated_tokens: int
    prefill_ms: float
    ttft_ms: float | None
    decode_tokens_per_s: float | None
    total_ms: float
    stop_reason: str
    plan: dict[str, Any] | None
    created_at: datetime | None
    new_tokens: int | None = None
    evicted_tokens: int | None = None
    shifted_tokens: int | None = None
    shift_count: int | None = None
    eviction_policy: str | None = None
    kv_fallback: str | None = None
    cells_used: dict[str, int] | None = None
    summary_tokens: int | None = None
    summary_ms: float | None = None
    build_ms: float | None = None  # context building, summary included (in line: in queue_ms)
    store_ms: float | None = None  # database writes before generation
    engine_ttft_ms: float | None = None  # from the engine's first step
    recall_tokens: int | None = None
    recall_ms: float | None = None
    rss_bytes: int | None = None
    gpu_used_bytes: int | None = None
    gpu_free_bytes: int | None = None
    slot: int | None = None  # the pool slot the turn ran in
    queue_ms: float | None = None  # request to lease: in line for a slot (a swap-in excluded)
    swap_in: str | None = None  # "ram" | "disk": the KV state was restored from a swap
    swap_in_ms: float | None = None
    swap_in_bytes: int | None = None
    reprefill_reason: str | None = None  # why a swapped state was refused (prefilled again)
    batch_max: int | None = None  # most sequences decoded together in one step
    backend: str | None = None  # the backend that ran the turn, where a router spreads them
    tool_calls: int | None = None  # calls the reply made (an agent's turn)
    tool_result_tokens: int | None = None  # tool results' tokens in the prompt, whole
    tool_cleared_tokens: int | None = None  # tokens of old tool results cleared to stubs
    tool_warning: str | None = None  # output that looked like a call, kept as text: why


@dataclass(frozen=True, slots=True)
class Summary:
    """One version of a conversation's running summary."""

    id: int
    conversation_id: str
    content: str
    covered_message_ids: list[int]  # the messages this version folded in
    token_count: int | None
    tokenizer: str | None
    created_at: datetime | None
    # (first character, message position it follows) of each part in the append layout
    blocks: tuple[tuple[int, int], ...] = ()
    # (message id, items it says, start, end, ...) of each evicted message the abridge
    # layout sends, cut to those spans of its content
    abridged: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class StoredContextState:
    """The context builder's persisted state for one conversation."""

    window_start: int = 0
    summary: Summary | None = None
    pending_ids: tuple[int, ...] = ()
    version: int = 0  # saves so far: what ``save_context_state(expected_version=...)`` checks
    cleared_ids: tuple[int, ...] = ()  # tool results in the window sent as a stub


@dataclass(frozen=True, slots=True)
class ContextInputs:
    """What a turn's context is built from, read together (``Store.context_inputs``)."""

    conversation: Conversation
    state: StoredContextState
    history: list[Message]  # the messages from the state's window start on, in order
    pinned: list[Message]
