"""Migration 0006 and the slot pool's per-turn figures."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import inspect, text

from chatctx.errors import StoreError
from chatctx.store import Store, create_db_engine, current_revision, upgrade
from chatctx.store._migrate import _config

TURN = {
    "n_ctx": 1024,
    "prompt_tokens": 40,
    "reused_tokens": 0,
    "evaluated_tokens": 40,
    "generated_tokens": 5,
    "prefill_ms": 12.5,
    "total_ms": 30.0,
    "stop_reason": "stop",
}
POOL_COLUMNS = ["slot", "swap_in", "swap_in_ms", "swap_in_bytes", "reprefill_reason", "batch_max"]


def test_upgrade_from_0005_keeps_rows_and_adds_nullable_columns(db_url: str) -> None:
    engine = create_db_engine(db_url)
    upgrade(engine, "0005")
    assert current_revision(engine) == "0005"
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO conversations (id, title, settings, created_at, updated_at) "
                "VALUES ('old', 'before 0006', '{}', '2026-11-30 10:00:00', "
                "'2026-11-30 10:00:00')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO messages (conversation_id, position, role, content, status, "
                "pinned, created_at) VALUES ('old', 0, 'user', 'my parking permit expired', "
                "'complete', false, '2026-11-30 10:00:00')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO turns (conversation_id, seq_id, n_ctx, prompt_tokens, "
                "reused_tokens, evaluated_tokens, generated_tokens, prefill_ms, total_ms, "
                "stop_reason, rss_bytes, created_at) VALUES ('old', 3, 512, 17, 4, 13, 6, "
                "8.25, 40.5, 'length', 123456789, '2026-11-30 10:00:01')"
            )
        )
    assert not set(POOL_COLUMNS) & {c["name"] for c in inspect(engine).get_columns("turns")}
    upgrade(engine, "0006")
    assert current_revision(engine) == "0006"
    columns = {c["name"]: c for c in inspect(engine).get_columns("turns")}
    assert all(columns[name]["nullable"] for name in POOL_COLUMNS)
    engine.dispose()

    with Store(db_url) as store:
        [turn] = store.turns("old")
        # The FTS index (0005) still follows the messages table.
        [(hit, _)] = store.search_messages("old", "parked")
    assert (turn.seq_id, turn.n_ctx, turn.prompt_tokens, turn.reused_tokens) == (3, 512, 17, 4)
    assert (turn.evaluated_tokens, turn.generated_tokens, turn.stop_reason) == (13, 6, "length")
    assert (turn.prefill_ms, turn.total_ms, turn.rss_bytes) == (8.25, 40.5, 123456789)
    assert [getattr(turn, name) for name in POOL_COLUMNS] == [None] * 6
    assert hit.content == "my parking permit expired"


def test_downgrade_to_0005_drops_only_the_new_columns(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        store.add_turn("c", slot=1, swap_in="ram", **TURN)
    engine = create_db_engine(db_url)
    with engine.begin() as conn:
        command.downgrade(_config(conn), "0005")
    names = {c["name"] for c in inspect(engine).get_columns("turns")}
    with engine.connect() as conn:
        kept = conn.execute(text("SELECT prompt_tokens, total_ms FROM turns")).all()
    engine.dispose()
    assert not set(POOL_COLUMNS) & names and "gpu_free_bytes" in names
    assert kept == [(40, 30.0)]


def test_add_turn_round_trips_the_pool_figures(db_url: str) -> None:
    reason = "fingerprint mismatch: n_ctx 1024 != 2048"
    with Store(db_url) as store:
        store.create_conversation("c")
        made = [
            store.add_turn(
                "c",
                slot=2,
                swap_in="disk",
                swap_in_ms=7.75,
                swap_in_bytes=3 * 2**31,
                batch_max=4,
                **TURN,
            ),
            store.add_turn("c", slot=0, reprefill_reason=reason, batch_max=1, **TURN),
            store.add_turn("c", **TURN),
        ]
    with Store(db_url) as store:
        stored = store.turns("c")
    assert stored == made
    expected = [
        [2, "disk", 7.75, 6442450944, None, 4],
        [0, None, None, None, reason, 1],
        [None] * 6,
    ]
    assert [[getattr(t, name) for name in POOL_COLUMNS] for t in stored] == expected


def test_add_turn_refuses_an_unknown_swap_source(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c")
        with pytest.raises(StoreError, match="swap_in must be 'ram', 'disk' or None, not 'gpu'"):
            store.add_turn("c", swap_in="gpu", **TURN)
        assert store.turns("c") == []
