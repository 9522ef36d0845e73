"""Full-text recall search: ranking, stemming, hostile queries, and an index that stays right
across migrations, streamed-reply updates, imports and deletes; on SQLite (FTS5) and
PostgreSQL (a generated ``tsvector`` column)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import datetime

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.engine import make_url

from chatctx.store import Store, create_db_engine, import_records, read_jsonl, upgrade
from chatctx.store._migrate import _config
from chatctx.store._models import Base
from chatctx.store.search import fts_query, include_name, query_terms
from chatctx.testing import create_database, drop_database

CHAT = [
    ("user", "Hi, my wifi keeps dropping in the evening."),
    ("assistant", "Sorry to hear that. Which router do you have?"),
    ("user", "Oh and I'm allergic to shellfish, so no seafood at the party."),
    ("assistant", "Noted: no shellfish for you."),
    ("user", "I parked on level four of the garage."),
    ("assistant", "Level four, got it."),
    ("user", "The wifi drops again, the router light is orange."),
    ("assistant", "An orange light means the router lost its uplink."),
]


def fill(store: Store, cid: str = "c", chat: list[tuple[str, str]] = CHAT) -> list[int]:
    store.create_conversation(cid)
    added = store.add_messages(cid, [{"role": r, "content": c} for r, c in chat])
    return [m.id for m in added]


def fts_rowids(store: Store, word: str) -> list[int]:
    """What the full-text index itself returns (SQLite: not joined to messages, so stale
    entries show; PostgreSQL: the stored tsvector column, as the GIN index has it)."""
    with store.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            rows = conn.execute(
                text(
                    "SELECT id FROM messages WHERE content_tsv @@ to_tsquery('english', :q) "
                    "ORDER BY id"
                ),
                {"q": word},
            )
        else:
            rows = conn.execute(
                text("SELECT rowid FROM messages_fts WHERE messages_fts MATCH :q ORDER BY rowid"),
                {"q": f'"{word}"'},
            )
        return [r[0] for r in rows]


def integrity_ok(store: Store) -> None:
    with store.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            stale = conn.execute(
                text(
                    "SELECT count(*) FROM messages "
                    "WHERE content_tsv IS DISTINCT FROM to_tsvector('english', content)"
                )
            ).scalar()
            assert stale == 0
            return
        # Raises "database disk image is malformed" when the index and the table disagree.
        conn.execute(
            text("INSERT INTO messages_fts(messages_fts, rank) VALUES ('integrity-check', 1)")
        )


def index_names(store: Store) -> set[str]:
    """The full-text index's tables (SQLite) or column and index (PostgreSQL)."""
    with store.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            sql = (
                "SELECT column_name FROM information_schema.columns WHERE table_name = "
                "'messages' AND column_name = 'content_tsv' UNION SELECT indexname FROM "
                "pg_indexes WHERE indexname = 'ix_messages_content_tsv'"
            )
        else:
            sql = "SELECT name FROM sqlite_master WHERE name LIKE 'messages_fts%'"
        return {r[0] for r in conn.execute(text(sql))}


def test_rare_shared_word_ranks_first(db_url: str) -> None:
    with Store(db_url) as store:
        ids = fill(store)
        found = store.search_messages("c", "what was that seafood thing, shellfish?", limit=3)
    # Hand-computed: only the allergy message and its reply contain "shellfish"; the user's
    # message also has "seafood", so it scores highest.
    assert [m.id for m, _ in found][:2] == [ids[2], ids[3]]
    scores = [s for _, s in found]
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[1] > 0


def test_stemming_matches_other_forms(db_url: str) -> None:
    with Store(db_url) as store:
        ids = fill(store)
        parking = store.search_messages("c", "where is my parking spot", limit=1)
        allergy = store.search_messages("c", "any allergy I should know of", limit=1)
    assert [m.id for m, _ in parking] == [ids[4]]  # "parked" (porter stem "park")
    assert [m.id for m, _ in allergy] == [ids[2]]  # "allergic" (shared prefix "aller")


def test_before_position_exclusions_and_replies(db_url: str) -> None:
    with Store(db_url) as store:
        ids = fill(store)
        # Only positions < 4 are searched: the garage message (position 4) is not.
        assert store.search_messages("c", "garage level four", before_position=4) == []
        found = store.search_messages("c", "shellfish", exclude_ids=[ids[3]], limit=5)
        assert [m.id for m, _ in found] == [ids[2]]
        # With replies, the matched user message comes with the answer right after it.
        exchange = store.search_messages("c", "garage", limit=1, replies=True)
        assert [(m.id, m.role) for m, _ in exchange] == [(ids[4], "user"), (ids[5], "assistant")]
        assert exchange[0][1] == exchange[1][1]
        # ... unless that answer is at or past before_position.
        cut = store.search_messages("c", "garage", before_position=5, replies=True)
        assert [m.id for m, _ in cut] == [ids[4]]
        # Other conversations never leak in.
        fill(store, "other")
        assert {m.conversation_id for m, _ in store.search_messages("c", "wifi router")} == {"c"}


HOSTILE = [
    '"',
    '""',
    "AND OR NOT",
    "NEAR(wifi router, 2)",
    "wifi*",
    "content:wifi",
    "^wifi",
    "(wifi",
    "-wifi",
    "wifi + router",
    "{content}: wifi",
    "'; DROP TABLE messages; --",
    "\x00wifi",
    "🙂 wifi 🙂",
    "",
    "   ",
    "the and of to",
]


@pytest.mark.parametrize("query", HOSTILE)
def test_fts_syntax_in_user_text_never_raises(db_url: str, query: str) -> None:
    with Store(db_url) as store:
        ids = fill(store)
        found = store.search_messages("c", query, limit=5)
    assert {m.id for m, _ in found} <= set(ids)
    if "wifi" in query:  # the word itself is still searched
        assert ids[0] in {m.id for m, _ in found}


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path_factory.mktemp('fts') / 'q.db'}") as store:
        fill(store)
        yield store


@pytest.fixture(scope="module")
def shared_pg_store(pg_server: str) -> Iterator[Store]:
    url = create_database(pg_server)
    with Store(url) as store:
        fill(store)
        yield store
    drop_database(pg_server, str(make_url(url).database))


@settings(max_examples=300, deadline=None)
@given(query=st.text(max_size=80))
def test_any_text_is_a_valid_query(shared_store: Store, query: str) -> None:
    found = shared_store.search_messages("c", query, limit=5)
    assert all(message.conversation_id == "c" for message, _ in found)
    if not query_terms(query):  # nothing searchable: nothing found, and no error
        assert found == []


@settings(max_examples=200, deadline=None)
@given(query=st.text(max_size=80))
def test_any_text_is_a_valid_query_on_postgresql(shared_pg_store: Store, query: str) -> None:
    found = shared_pg_store.search_messages("c", query, limit=5, replies=True)
    assert all(message.conversation_id == "c" for message, _ in found)
    if not query_terms(query):
        assert found == []


def test_query_building_quotes_every_term() -> None:
    assert query_terms('What "is" my NEAR(order) number? #42') == ["near", "order", "number", "42"]
    assert fts_query(["order", "allergic"]) == '"order" OR "allergic" OR "aller"*'


def test_upgrade_from_0003_indexes_existing_messages(db_url: str) -> None:
    engine = create_db_engine(db_url)
    upgrade(engine, "0003")
    now = datetime(2026, 1, 1)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO conversations (id, settings, created_at, updated_at) "
                "VALUES ('old', '{}', :now, :now)"
            ),
            {"now": now},
        )
        for position, (role, content) in enumerate(CHAT):
            conn.execute(
                text(
                    "INSERT INTO messages (conversation_id, position, role, content, status, "
                    "pinned, created_at) VALUES ('old', :p, :r, :c, 'complete', :f, :now)"
                ),
                {"p": position, "r": role, "c": content, "now": now, "f": False},
            )
    engine.dispose()
    with Store(db_url) as store:  # opening upgrades to head: 0005's backfill, 0007's column
        found = store.search_messages("old", "shellfish allergy", limit=1)
        assert [m.content for m, _ in found] == [CHAT[2][1]]
        # Messages written after the upgrade are indexed by the triggers.
        store.add_message("old", "user", "my cat is called Pixel")
        assert [m.content for m, _ in store.search_messages("old", "pixel")] == [
            "my cat is called Pixel"
        ]
        integrity_ok(store)


def test_downgrade_drops_index_and_search_falls_back(db_url: str) -> None:
    with Store(db_url) as store:
        ids = fill(store)
        fts_top = [m.id for m, _ in store.search_messages("c", "shellfish party", limit=1)]
        assert index_names(store)
        with store.engine.begin() as conn:
            command.downgrade(_config(conn), "0004")
        assert index_names(store) == set()
        # The portable query (LIKE over the terms) still finds the same best message.
        portable = store.search_messages("c", "shellfish party", limit=3, replies=True)
        assert [m.id for m, _ in portable][:1] == fts_top == [ids[2]]
        assert [m.id for m, _ in portable][1] == ids[3]  # its reply follows it
        with store.engine.begin() as conn:
            command.upgrade(_config(conn), "head")
        assert fts_rowids(store, "shellfish") == [ids[2], ids[3]]  # backfilled again


def test_streamed_reply_update_reindexes(db_url: str) -> None:
    with Store(db_url) as store:
        fill(store)
        partial = store.add_message("c", "assistant", "Let me check the warranty", status="partial")
        store.update_message(
            partial.id, content="Your replacement ships Tuesday", status="complete"
        )
        assert fts_rowids(store, "warranty") == []
        assert fts_rowids(store, "tuesday") == [partial.id]
        integrity_ok(store)


def test_deleting_a_conversation_removes_its_messages_from_the_index(db_url: str) -> None:
    with Store(db_url) as store:
        ids = fill(store, "gone")
        kept = fill(store, "kept")
        store.delete_conversation("gone")  # ON DELETE CASCADE: the delete trigger must fire
        assert fts_rowids(store, "shellfish") == [kept[2], kept[3]]
        assert not set(fts_rowids(store, "wifi")) & set(ids)
        integrity_ok(store)


def test_imported_conversations_are_searchable(db_url: str) -> None:
    line = json.dumps(
        {
            "id": "imported",
            "messages": [
                {"role": "user", "content": "My daughter Ines starts school in September."},
                {"role": "assistant", "content": "Exciting! Good luck to Ines."},
            ],
        }
    )
    with Store(db_url) as store:
        import_records(store, read_jsonl(io.StringIO(line + "\n")))
        found = store.search_messages("imported", "when does my daughter start school?")
        assert [m.role for m, _ in found][:1] == ["user"]
        assert "Ines" in found[0][0].content
        integrity_ok(store)


def test_orm_metadata_matches_apart_from_the_fts_tables(db_url: str) -> None:
    with Store(db_url) as store, store.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_name": include_name})
        assert compare_metadata(context, Base.metadata) == []
        unfiltered = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    # Without the filter, only the FTS table and its shadow tables differ (SQLite), or the
    # tsvector column and its index (PostgreSQL).
    assert unfiltered
    for diff in unfiltered:
        if diff[0] == "remove_table":
            assert diff[1].name.startswith("messages_fts")
        elif diff[0] == "remove_index":
            assert diff[1].name == "ix_messages_content_tsv"
        else:
            assert diff[0] == "remove_column" and diff[3].name == "content_tsv", diff


def test_searches_of_a_conversation_of_21_messages(db_url: str) -> None:
    # PostgreSQL used to fail here with "integer out of range" (an unbounded search bound
    # 2**62 against the 32-bit position column).
    chat = [
        ("user" if i % 2 == 0 else "assistant", f"note {i}: locker {1000 + i}") for i in range(21)
    ]
    chat[7] = ("assistant", "the spare key is under the blue flowerpot")
    with Store(db_url) as store:
        ids = fill(store, chat=chat)
        for _ in range(12):  # past psycopg's prepare threshold too
            found = store.search_messages("c", "where is the spare key?", limit=2)
            assert [m.id for m, _ in found][:1] == [ids[7]]
        everything = store.search_messages("c", "note locker", limit=30)
        assert {m.id for m, _ in everything} == set(ids) - {ids[7]}
        integrity_ok(store)


def test_a_rare_word_outranks_two_common_ones(db_url: str) -> None:
    chat = [("user", "the printer and the scanner are fine today") for _ in range(6)]
    chat.append(("user", "my passport expires in march"))
    with Store(db_url) as store:
        ids = fill(store, chat=chat)
        found = store.search_messages("c", "printer scanner passport", limit=7)
    # "passport" is in 1 of 7 messages, "printer" and "scanner" in 6: rarity wins.
    assert found[0][0].id == ids[6]
    assert len(found) == 7


# Support chats in scripts without word spaces, or with endings joined to their words: the
# stored form and the asked form differ ("환불이" stored, "환불은" asked; "返金手続き" stored,
# "返金は" asked), and only the character pairs they share find them.
UNSPACED = {
    "korean": (
        [
            ("user", "주문한 신발이 아직 안 왔어요."),
            ("assistant", "확인해 보겠습니다. 주문번호를 알려주세요."),
            ("user", "환불이 가능한지 궁금해요. 주문번호는 KR-5521이에요."),
            ("assistant", "환불 요청을 접수했습니다. 3일 안에 처리됩니다."),
            ("user", "배송 주소는 서울 마포구예요."),
            ("assistant", "주소를 확인했습니다."),
        ],
        "그런데 환불은 언제 되나요?",
        3,
    ),
    "japanese": (
        [
            ("user", "注文した靴がまだ届きません。"),
            ("assistant", "確認します。注文番号を教えてください。"),
            ("user", "住所は大阪市北区です。"),
            ("assistant", "返金手続きが完了しました。五日以内に戻ります。"),
            ("user", "ありがとうございます。"),
        ],
        "返金はいつ戻りますか？",
        3,
    ),
    "chinese": (
        [
            ("user", "我的订单还没有到。"),
            ("assistant", "请告诉我您的订单号。"),
            ("user", "订单号是CN-8830，地址在上海。"),
            ("assistant", "好的，已经为您申请退款。"),
            ("user", "谢谢。"),
        ],
        "退款什么时候到账？",
        3,
    ),
}


@pytest.mark.parametrize("language", sorted(UNSPACED))
def test_unspaced_scripts_are_searched_by_the_pairs_their_words_share(
    db_url: str, language: str
) -> None:
    chat, question, wanted = UNSPACED[language]
    with Store(db_url) as store:
        ids = fill(store, chat=chat)
        found = store.search_messages("c", question, limit=1)
    # Hand-picked: the message sharing the question's rarest pairs (on a tie, as with words,
    # the later one: the reply saying what was done).
    assert [m.id for m, _ in found] == [ids[wanted]]


def test_an_identifier_inside_an_unspaced_run_is_its_own_term(db_url: str) -> None:
    chat = UNSPACED["chinese"][0]
    with Store(db_url) as store:
        ids = fill(store, chat=chat)
        found = store.search_messages("c", "我的订单号CN-8830在哪里", limit=1)
    assert query_terms("订单号是CN-8830") == ["订单", "单号", "号是", "cn", "8830"]
    assert [m.id for m, _ in found] == [ids[2]]


def test_pairs_common_to_most_messages_weigh_nothing() -> None:
    terms = query_terms("환불은 언제 되나요?")
    assert terms == ["환불", "불은", "언제", "되나", "나요"]
    assert query_terms("返金はいつ") == ["返金", "金は", "はい", "いつ"]
    assert query_terms("order 77 in 東京") == ["order", "77", "東京"]
