"""U+0000 in text and titles: SQLite keeps it, PostgreSQL (whose text cannot hold it) gets
U+FFFD, and a turn whose reply holds one is stored on both instead of failing ("reply not
stored").

Oracles: the hand-written expected strings, and the rows read back through a new store.
"""

from __future__ import annotations

from pathlib import Path

from chatctx.backends.engine import Engine
from chatctx.session import ChatSession
from chatctx.store import Store


def _expected(text: str, db_url: str) -> str:
    return text.replace("\x00", "\ufffd") if db_url.startswith("postgresql") else text


def test_nul_in_a_prompt_a_message_and_a_summary_is_stored(db_url: str) -> None:
    with Store(db_url) as store:
        cid = store.create_conversation(system_prompt="be\x00nice", title="order\x00 42").id
        user = store.add_message(cid, "user", "my code is 12\x0034")
        store.save_context_state(
            cid, window_start=1, new_summary=("User: code 12\x0034", [user.id], 9, "t")
        )
    with Store(db_url) as store:
        assert store.get_conversation(cid).system_prompt == _expected("be\x00nice", db_url)
        assert store.get_conversation(cid).title == _expected("order\x00 42", db_url)
        store.update_conversation(cid, title="renamed\x00")
        assert store.get_conversation(cid).title == _expected("renamed\x00", db_url)
        assert store.messages(cid)[0].content == _expected("my code is 12\x0034", db_url)
        summary = store.context_state(cid).summary
        assert summary is not None and summary.content == _expected("User: code 12\x0034", db_url)


def test_a_reply_holding_nul_is_stored_with_its_turn(db_url: str, tiny_llama3_path: Path) -> None:
    with (
        Engine.load(tiny_llama3_path, n_ctx=512) as engine,
        ChatSession.open(db_url, conversation_id="c", model=engine) as chat,
    ):
        reply = chat.record_turn("hello\x00there", "a\x00b")
    assert reply.message_id is not None
    with Store(db_url) as store:
        user, assistant = store.messages("c")
        assert user.content == _expected("hello\x00there", db_url)
        assert assistant.content == _expected("a\x00b", db_url)
        assert assistant.status == "complete"
        assert [t.assistant_message_id for t in store.turns("c")] == [assistant.id]
