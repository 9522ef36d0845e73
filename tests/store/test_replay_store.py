"""The store replays run on: what ChatSession reads back each turn comes from memory."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from chatctx.errors import ConversationNotFound
from chatctx.store import ReplayStore, Store


def _plain(value: Any) -> Any:
    """A record without its timestamps (they differ by when each store wrote it)."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        names = {"created_at", "updated_at"} & set(value.__dataclass_fields__)
        value = replace(value, **dict.fromkeys(names))
        if getattr(value, "summary", None) is not None:
            value = replace(value, summary=_plain(value.summary))
    return value


def _exercise(store: Store) -> dict[str, Any]:
    store.create_conversation("c", system_prompt="Be kind.", settings={"x": 1})
    user = store.add_message("c", "user", "my router NH-1 blinks red")
    replies = store.add_messages(
        "c",
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f"}}],
            },
            {"role": "tool", "content": "status: red", "tool_call_id": "t1"},
            {"role": "assistant", "content": "Unplug the router for ten seconds."},
        ],
    )
    store.add_message("c", "user", "the router blinks again")
    pinned = store.set_pinned(user.id)
    state = store.save_context_state(
        "c", window_start=2, pending_ids=[1], new_summary=("summary", [1], 3, "fp")
    )
    store.put_token_counts("fp", {user.id: 7})
    turn = store.add_turn(
        "c",
        user_message_id=user.id,
        assistant_message_id=replies[-1].id,
        model="m",
        seq_id=0,
        n_ctx=512,
        prompt_tokens=10,
        reused_tokens=2,
        evaluated_tokens=8,
        generated_tokens=0,
        prefill_ms=0.0,
        ttft_ms=None,
        decode_tokens_per_s=None,
        total_ms=0.0,
        stop_reason="length",
        plan={"evicted": False},
        slot=0,
    )
    return {
        "added": _plain([user, *replies, pinned]),
        "conversation": _plain(store.get_conversation("c")),
        "messages": _plain(store.messages("c")),
        "read_back": _plain(Store.messages(store, "c")),  # from the database itself
        "window": _plain(store.messages("c", from_position=2)),
        "pinned": _plain(store.pinned_messages("c")),
        "state": _plain([state, store.context_state("c")]),
        "counts": store.get_token_counts("fp", [user.id, 999]),
        "search": [
            (m.id, round(score, 6))
            for m, score in store.search_messages("c", "router blinks", replies=True)
        ],
        "turn": _plain([turn, *store.turns("c")]),
    }


def test_replay_store_answers_as_the_store_does() -> None:
    with Store("sqlite://") as store, ReplayStore() as fast:
        expected = _exercise(store)
        assert _exercise(fast) == expected
        assert expected["messages"] == expected["read_back"]
        assert len(expected["search"]) >= 2
        for call in (lambda: fast.messages("nope"), lambda: fast.add_message("nope", "user", "x")):
            with pytest.raises(ConversationNotFound):
                call()
