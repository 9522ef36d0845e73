"""Hypothesis strategies for chat histories: roles, tool calls, sizes from 1 to thousands."""

from __future__ import annotations

from hypothesis import strategies as st

from chatctx.store import Message

WORDS = (
    "order",
    "router",
    "wifi",
    "refund",
    "NH-48213",
    "please",
    "the",
    "is",
    "3000",
    "restart",
    "ticket",
    "42",
    "café",
    "한국",
    "🎉",
    "delivery",
    "model",
    "AX3000",
)

sizes = st.one_of(st.integers(1, 12), st.integers(12, 200), st.integers(200, 2500))


def text(n: int, salt: int) -> str:
    return " ".join(WORDS[(salt * 7 + i * 3) % len(WORDS)] for i in range(n))


@st.composite
def histories(draw: st.DrawFn, max_turns: int = 10) -> list[Message]:
    messages: list[Message] = []

    def add(role: str, content: str, **extra: object) -> None:
        n = len(messages)
        messages.append(
            Message(id=n + 1, conversation_id="c", position=n, role=role, content=content, **extra)
        )  # type: ignore[arg-type]

    if draw(st.booleans()) and draw(st.booleans()):
        add("assistant", "Hello! How can I help you today?")  # a greeting before any user turn
    for turn in range(draw(st.integers(0, max_turns))):
        add("user", text(draw(sizes), turn))
        kind = draw(st.sampled_from(["reply", "reply", "tools", "unanswered"]))
        if kind == "reply":
            add("assistant", text(draw(sizes), turn + 100))
        elif kind == "tools":
            calls = draw(st.integers(1, 2))
            add(
                "assistant",
                "",
                tool_calls=[
                    {
                        "id": f"call_{turn}_{i}",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": "{}"},
                    }
                    for i in range(calls)
                ],
            )
            for i in range(calls):
                add(
                    "tool",
                    text(draw(sizes), turn + i),
                    tool_call_id=f"call_{turn}_{i}",
                    name="lookup",
                )
            add("assistant", text(draw(st.integers(1, 60)), turn + 200))
    return messages
