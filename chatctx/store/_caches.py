"""Writes that race safely: get-or-create and upsert in one statement; the store's caches.

``insert_if_missing`` and ``upsert`` are single ``INSERT ... ON CONFLICT`` statements on SQLite
and PostgreSQL, so writers racing on one key never fail with a duplicate key. ``CacheMixin``
holds what the store keeps for other layers: the context builder's token counts and recall's
sentence vectors, per fingerprint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.dialects import postgresql as postgresql_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from chatctx.store._connect import _retry_busy
from chatctx.store._models import Base, MessageEmbeddingRow, MessageRow, MessageTokensRow


def insert_if_missing(
    session: Session, table: type[Base], values: dict[str, Any], *, key: list[str]
) -> bool:
    """Insert a row unless one with the same ``key`` exists; True when this call inserted it.

    SQLite and PostgreSQL do it in one statement (``ON CONFLICT DO NOTHING``), so two
    writers racing on one key cannot fail; other databases try in a savepoint.
    """
    dialect = session.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        module = sqlite_dialect if dialect == "sqlite" else postgresql_dialect
        statement = module.insert(table).values(**values).on_conflict_do_nothing(index_elements=key)
        # RETURNING, not rowcount: psycopg reports -1 for an ORM session's INSERT.
        columns = table.__table__.c
        return session.execute(statement.returning(columns[key[0]])).first() is not None
    try:
        with session.begin_nested():
            session.execute(insert(table).values(**values))
    except IntegrityError:
        return False
    return True


def upsert(
    session: Session,
    table: type[Base],
    rows: Sequence[dict[str, Any]],
    *,
    key: list[str],
    update: list[str],
) -> None:
    """Insert rows, or set ``update`` columns of those whose ``key`` exists already.

    One ``INSERT ... ON CONFLICT DO UPDATE`` on SQLite and PostgreSQL, so writers racing on a
    key cannot fail with a duplicate; elsewhere a delete and an insert.
    """
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        module = sqlite_dialect if dialect == "sqlite" else postgresql_dialect
        statement = module.insert(table)
        statement = statement.on_conflict_do_update(
            index_elements=key, set_={name: statement.excluded[name] for name in update}
        )
        session.execute(statement, list(rows))
        return
    columns = table.__table__.c
    for row in rows:
        session.execute(delete(table).where(*[columns[k] == row[k] for k in key]))
    session.execute(insert(table), list(rows))


class CacheMixin:
    """The token-count and vector caches of ``Store`` (which provides ``_session``)."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    # token counts (the context builder's cache) --------------------------------------------

    def get_token_counts(self, fingerprint: str, ids: Sequence[int]) -> dict[int, int]:
        found: dict[int, int] = {}
        with self._session() as session:
            for start in range(0, len(ids), 500):
                chunk = list(ids[start : start + 500])
                rows = session.execute(
                    select(MessageTokensRow.message_id, MessageTokensRow.tokens).where(
                        MessageTokensRow.tokenizer == fingerprint,
                        MessageTokensRow.message_id.in_(chunk),
                    )
                )
                found.update({mid: n for mid, n in rows})
        return found

    @_retry_busy
    def put_token_counts(self, fingerprint: str, counts: Mapping[int, int]) -> None:
        """Cache token counts; a count stored already (by any process) is replaced."""
        rows = [{"message_id": i, "tokenizer": fingerprint, "tokens": n} for i, n in counts.items()]
        with self._session(write=True) as session:
            for start in range(0, len(rows), 500):
                upsert(
                    session,
                    MessageTokensRow,
                    rows[start : start + 500],
                    key=["message_id", "tokenizer"],
                    update=["tokens"],
                )

    # sentence vectors (recall by meaning) ----------------------------------------------------

    def get_embeddings(
        self, embedder: str, ids: Sequence[int]
    ) -> dict[int, tuple[str, int, bytes]]:
        """Stored vectors of these messages by ``embedder`` (a fingerprint):
        ``{message_id: (text_sha256, dim, float32 bytes)}``; messages without any are left out."""
        found: dict[int, tuple[str, int, bytes]] = {}
        with self._session() as session:
            for start in range(0, len(ids), 500):
                chunk = list(ids[start : start + 500])
                rows = session.execute(
                    select(
                        MessageEmbeddingRow.message_id,
                        MessageEmbeddingRow.text_sha256,
                        MessageEmbeddingRow.dim,
                        MessageEmbeddingRow.vectors,
                    ).where(
                        MessageEmbeddingRow.embedder == embedder,
                        MessageEmbeddingRow.message_id.in_(chunk),
                    )
                )
                found.update({mid: (sha, dim, bytes(data)) for mid, sha, dim, data in rows})
        return found

    @_retry_busy
    def put_embeddings(self, embedder: str, vectors: Mapping[int, tuple[str, int, bytes]]) -> None:
        """Store vectors as ``get_embeddings`` returns them; existing ones are replaced.

        A message deleted meanwhile is skipped (its vectors would go with it anyway)."""
        rows = [
            {"message_id": i, "embedder": embedder, "text_sha256": sha, "dim": dim, "vectors": data}
            for i, (sha, dim, data) in vectors.items()
        ]
        ids = list(vectors)
        with self._session(write=True) as session:
            alive: set[int] = set()
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                alive.update(session.scalars(select(MessageRow.id).where(MessageRow.id.in_(chunk))))
            rows = [row for row in rows if row["message_id"] in alive]
            for start in range(0, len(rows), 500):
                upsert(
                    session,
                    MessageEmbeddingRow,
                    rows[start : start + 500],
                    key=["message_id", "embedder"],
                    update=["text_sha256", "dim", "vectors"],
                )
