import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

from chatctx.errors import ConversationNotFound, StoreError
from chatctx.store import Store

ROOT = Path(__file__).resolve().parents[2]


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


def test_sqlite_is_opened_with_wal_foreign_keys_and_busy_timeout(sqlite_url: str) -> None:
    with Store(sqlite_url) as store, store.engine.connect() as conn:
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


def test_conversations_page_in_code_point_order(db_url: str) -> None:
    page_through(db_url)


def test_conversations_page_ignores_the_database_locale(pg_server: str) -> None:
    # A database whose collation sorts "a_2" before "a-2" and "b" before "B".
    name = f"chatctx_icu_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(
            text(
                f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu "
                "ICU_LOCALE 'en-US' LOCALE 'C'"
            )
        )
    try:
        page_through(make_url(pg_server).set(database=name).render_as_string(False))
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))


def page_through(db_url: str) -> None:
    # Ids a locale collation or a LIKE pattern would get wrong: case, punctuation, wildcards.
    ids = ["acme:b", "acme:B", "acme:a-2", "acme:a_2", "acme:a%", "acme:é", "acme:Z9",
           "acmeX:1", "acm:1", "stateless-1", "acme:stateless-2"]  # fmt: skip
    with Store(db_url) as store:
        for cid in ids:
            store.create_conversation(cid)
        for _ in range(3):
            store.add_message("acme:B", "user", "hi")
        mine = sorted(i for i in ids if i.startswith("acme:"))  # the oracle: Python's order
        pages, after = [], None
        while True:
            page = store.conversations_page(prefix="acme:", after=after, limit=3)
            pages.append([c.id for c in page])
            if len(page) < 3:
                break
            after = page[-1].id
        assert [i for p in pages for i in p] == mine
        assert all(len(p) == 3 for p in pages[:-1])
        counts = {c.id: c.message_count for c in store.conversations_page(prefix="acme:")}
        assert counts["acme:B"] == 3 and counts["acme:b"] == 0
        everyone = store.conversations_page(limit=100)
        assert [c.id for c in everyone] == sorted(ids)
        assert store.conversations_page(prefix="acme:a_") == [  # "_" is not a wildcard
            c for c in store.conversations_page(prefix="acme:") if c.id == "acme:a_2"
        ]


def test_bad_url_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        Store("not a url")


def test_a_postgresql_url_without_a_driver_name_uses_psycopg(db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        return  # the SQLite run of this test has nothing to check
    plain = db_url.replace("postgresql+psycopg://", "postgresql://")
    with Store(plain) as store:
        assert store.engine.dialect.driver == "psycopg"
        store.create_conversation("c")
        assert store.has_conversation("c")


def test_a_missing_postgresql_driver_is_a_clear_error(tmp_path: Path) -> None:
    # psycopg hidden from a child interpreter: what a user without the extra sees.
    (tmp_path / "psycopg.py").write_text("raise ImportError('No module named psycopg')\n")
    code = (
        "from chatctx.store import Store\n"
        "try:\n"
        "    Store('postgresql+psycopg://u@127.0.0.1:1/x')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
    ).stdout
    assert out.strip() == "StoreError PostgreSQL needs psycopg: pip install 'chatctx[postgres]'"


def test_an_unreachable_server_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="cannot upgrade database"):
        Store("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2")


def test_token_counts_are_replaced_not_duplicated(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        a, b = store.add_messages(
            "c", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )
        store.put_token_counts("tok", {a.id: 3, b.id: 4})
        store.put_token_counts("tok", {a.id: 5})
        store.put_token_counts("other", {a.id: 9})
        assert store.get_token_counts("tok", [a.id, b.id]) == {a.id: 5, b.id: 4}
        assert store.get_token_counts("other", [a.id, b.id]) == {a.id: 9}
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM message_tokens")).scalar() == 3


def test_context_state_round_trips_with_summaries(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        ids = [m.id for m in store.add_messages("c", [{"role": "user", "content": "x"}] * 4)]
        assert store.context_state("c").summary is None
        store.save_context_state(
            "c", window_start=2, pending_ids=[ids[1]], new_summary=("s1", ids[:1], 7, "tok")
        )
        store.save_context_state("c", window_start=3, new_summary=("s2", ids[1:2], 9, "tok"))
    with Store(db_url) as store:
        state = store.context_state("c")
        assert (state.window_start, state.pending_ids, state.version) == (3, (), 2)
        assert state.summary is not None and state.summary.content == "s2"
        assert [s.covered_message_ids for s in store.summaries("c")] == [ids[:1], ids[1:2]]


def test_get_or_create_says_whether_it_created(db_url: str) -> None:
    # On PostgreSQL psycopg reports rowcount -1 for the ORM's INSERT: "created" was always
    # False there.
    with Store(db_url) as store:
        first, created = store.get_or_create_conversation("g", system_prompt="one")
        again, created_again = store.get_or_create_conversation("g", system_prompt="two")
    assert (created, created_again) == (True, False)
    assert first.system_prompt == again.system_prompt == "one"


def test_appended_messages_are_returned_as_stored(db_url: str) -> None:
    # The oracle: what a fresh store reads back. An append is plain statements, no ORM row
    # to fill in its id or defaults: each returned message must still be the stored one.
    with Store(db_url) as store:
        store.create_conversation("c")
        store.add_message("c", "user", "first")
        added = store.add_messages(
            "c",
            [
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1"}]},
                {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "lookup"},
            ],
            settings={"b": 2},
        )
        reply, _ = store.record_reply(
            "c", {"role": "assistant", "content": "done", "status": "partial"}, **TURN
        )
        before = store.get_conversation("c").updated_at
    with Store(db_url) as store:
        stored = store.messages("c")
        assert stored[1:] == [*added, reply]
        assert [m.position for m in stored] == [0, 1, 2, 3]
        conversation = store.get_conversation("c")
        assert conversation.settings == {"b": 2} and conversation.updated_at == before
        with pytest.raises(ConversationNotFound):
            store.record_reply("nope", {"role": "assistant", "content": "x"}, **TURN)
        assert len(store.messages("c")) == 4 and len(store.turns("c")) == 1


def test_context_inputs_are_read_from_the_window_start(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c", system_prompt="sys")
        ids = [m.id for m in store.add_messages("c", [{"role": "user", "content": "x"}] * 5)]
        store.set_pinned(ids[0])
        store.save_context_state("c", window_start=3, new_summary=("s", ids[:3], 4, "tok"))
        inputs = store.context_inputs("c")
        assert inputs.conversation.system_prompt == "sys"
        assert inputs.state.window_start == 3 and inputs.state.summary is not None
        assert [m.position for m in inputs.history] == [3, 4]  # the window, by hand
        assert [m.id for m in inputs.pinned] == [ids[0]]  # pinned, though evicted
        with pytest.raises(ConversationNotFound):
            store.context_inputs("nope")


TURN = {
    "n_ctx": 512,
    "prompt_tokens": 10,
    "reused_tokens": 0,
    "evaluated_tokens": 10,
    "generated_tokens": 2,
    "prefill_ms": 1.0,
    "total_ms": 2.0,
    "stop_reason": "eog",
}
