from pathlib import Path

import pytest
from sqlalchemy import text

from chatctx.errors import ConversationNotFound, StoreError
from chatctx.store import Store


def test_messages_are_appended_in_order_and_persist(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c1", system_prompt="be kind", settings={"a": 1})
        store.add_message("c1", "user", "hi")
        store.add_message("c1", "assistant", "hello", status="partial")
        store.add_message("c1", "tool", "42", tool_call_id="call_1", name="lookup")
    with Store(db_url) as store:
        messages = store.messages("c1")
        conversation = store.get_conversation("c1")
    assert [(m.position, m.role, m.content, m.status) for m in messages] == [
        (0, "user", "hi", "complete"),
        (1, "assistant", "hello", "partial"),
        (2, "tool", "42", "complete"),
    ]
    assert messages[2].tool_call_id == "call_1" and messages[2].name == "lookup"
    assert conversation.system_prompt == "be kind"
    assert conversation.settings == {"a": 1}
    assert conversation.message_count == 3
    assert messages[0].created_at is not None and messages[0].created_at.tzinfo is not None


def test_sqlite_is_opened_with_wal_foreign_keys_and_busy_timeout(db_url: str) -> None:
    with Store(db_url) as store, store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 10_000


def test_in_memory_url_works() -> None:
    with Store("sqlite://") as store:
        store.create_conversation("m")
        store.add_message("m", "user", "x")
        assert [m.content for m in store.messages("m")] == ["x"]


def test_unknown_conversation_is_a_clear_error(db_url: str) -> None:
    with Store(db_url) as store:
        with pytest.raises(ConversationNotFound, match="nope"):
            store.messages("nope")
        with pytest.raises(ConversationNotFound):
            store.add_message("nope", "user", "x")


def test_bad_role_changes_nothing(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        with pytest.raises(StoreError, match="unknown role"):
            store.add_messages(
                "c", [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]
            )
        assert store.messages("c") == []


def test_duplicate_conversation_id_is_refused(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        with pytest.raises(StoreError, match="already exists"):
            store.create_conversation("c")


def test_delete_cascades(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        store.add_message("c", "user", "x")
        store.delete_conversation("c")
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM messages")).scalar() == 0


def test_bad_url_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        Store("not a url")
