"""What an agent's turn sends: a user message or the results of the open turn's tool calls,
with the tools offered (``Ask``), and the open turn read back from the store.

A reply that calls tools leaves its turn open: the assistant's calls are stored as a
message of the turn, and the turn goes on when the caller sends every call's result
(``ChatSession.submit_tool_results``), in this session or, after a restart, in another.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from chatctx.errors import ConfigError
from chatctx.model.tools import ToolChoice, check_tool_choice, check_tools
from chatctx.store import Message


class ToolOptions(TypedDict, total=False):
    """The tool arguments every way of sending a turn takes (``ChatSession.send`` ...)."""

    tools: Sequence[Mapping[str, Any]] | None  # OpenAI function tools
    tool_choice: Any  # "auto", "none", "required" or {"type": "function", "function": {...}}
    parallel_tool_calls: bool  # one reply may make several calls (default True)


@dataclass(frozen=True, slots=True)
class Ask:
    """A user message (``text``) or tool results (``results``: call id, output), with the
    function tools offered (OpenAI's shape), ``choice`` (``check_tool_choice``) and whether
    one reply may make several calls."""

    text: str | None
    results: tuple[tuple[str, str], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    by_name: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    choice: ToolChoice = "none"
    parallel: bool = True

    @property
    def reads_calls(self) -> bool:
        """The reply is read for calls (tools offered, ``tool_choice`` not "none")."""
        return bool(self.by_name) and self.choice != "none"

    def result_messages(self) -> list[dict[str, Any]]:
        return [
            {"role": "tool", "tool_call_id": call_id, "content": output}
            for call_id, output in self.results
        ]


def ask_for(
    text: str | None,
    *,
    results: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
) -> Ask:
    """An ``Ask`` from the caller's arguments, or ``ConfigError`` naming the bad one."""
    by_name = check_tools(tools) if tools else {}
    choice = check_tool_choice(tool_choice, by_name)
    outputs: list[tuple[str, str]] = []
    if results is not None:
        if not isinstance(results, Mapping) or not results:
            raise ConfigError("tool results must be a non-empty mapping of call id to output")
        for call_id, output in results.items():
            if not isinstance(call_id, str):
                raise ConfigError(f"tool result keys are call ids (str), not {call_id!r}")
            outputs.append((call_id, _output(call_id, output)))
    return Ask(
        text=text,
        results=tuple(outputs),
        tools=tuple(dict(t) for t in tools or ()),
        by_name=by_name,
        choice=choice,
        parallel=bool(parallel_tool_calls),
    )


def _output(call_id: str, output: Any) -> str:
    """A result as the text the model reads: strings as they are, other values as JSON."""
    if isinstance(output, str):
        return output
    try:
        return json.dumps(output, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the result of {call_id!r} is neither text nor JSON: {exc}") from exc


@dataclass(frozen=True, slots=True)
class OpenTurn:
    """A turn whose last reply called tools: its user message, what followed it (the calls
    and any results already stored) and the calls still waiting for a result."""

    user: Message
    rest: list[Message]
    waiting: list[dict[str, Any]]  # OpenAI-shaped calls, in the order the model made them

    @property
    def waiting_ids(self) -> list[str]:
        return [call["id"] for call in self.waiting]


def check_results(
    waiting: Sequence[str] | None,
    answered: Sequence[str],
    *,
    where: Callable[[int], str | None] = lambda i: None,
    whole: str | None = None,
) -> None:
    """Every call ``waiting`` (None: no turn is open) answered once by ``answered`` (call
    ids), nothing else; or ``ConfigError`` naming the field: ``where(i)`` names the message
    of the ``i``-th answer (a request's ``messages[3]``), ``whole`` the answers together."""

    def field(i: int, name: str | None = None) -> str | None:
        at = where(i)
        return at if name is None else (f"{at}.{name}" if at else name)

    if waiting is None:
        raise ConfigError(
            "no tool calls are waiting for results in this conversation", field=field(0)
        )
    seen: set[str] = set()
    for i, call_id in enumerate(answered):
        if call_id not in waiting:
            raise ConfigError(
                f"tool_call_id {call_id!r} is not a call waiting for its result "
                f"(waiting: {', '.join(waiting)})",
                field=field(i, "tool_call_id"),
            )
        if call_id in seen:
            raise ConfigError(
                f"tool_call_id {call_id!r} has two results", field=field(i, "tool_call_id")
            )
        seen.add(call_id)
    missing = [call_id for call_id in waiting if call_id not in seen]
    if missing:
        raise ConfigError(f"no result for tool call(s) {', '.join(missing)}", field=whole)


def open_turn(last_turn: Sequence[Message]) -> OpenTurn | None:
    """The newest turn (``Store.last_turn``) when its last reply's calls wait for results."""
    if not last_turn or last_turn[-1].role not in ("assistant", "tool"):
        return None
    calling = max(
        (i for i, m in enumerate(last_turn) if m.role == "assistant" and m.tool_calls),
        default=None,
    )
    if calling is None or any(m.role == "assistant" for m in last_turn[calling + 1 :]):
        return None
    answered = {m.tool_call_id for m in last_turn[calling + 1 :] if m.role == "tool"}
    calls = last_turn[calling].tool_calls or []
    waiting = [dict(c) for c in calls if c.get("id") not in answered]
    if not waiting:
        return None
    return OpenTurn(user=last_turn[0], rest=list(last_turn[1:]), waiting=waiting)
