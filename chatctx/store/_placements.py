"""Where a router placed each conversation: one row per conversation, shared by every process.

A router asks ``claim_placement`` for the backend it would choose; the first claim wins
(``INSERT ... ON CONFLICT DO NOTHING``) and every later one, in any process on any machine,
reads the winner. ``move_placement`` is a compare-and-set on the current backend, so two
routers failing the same conversation over at once move it once.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from chatctx.store._caches import insert_if_missing
from chatctx.store._connect import _retry_busy
from chatctx.store._models import PlacementRow, utcnow


@dataclass(frozen=True, slots=True)
class Placement:
    """The backend holding a conversation, and why it last moved."""

    conversation_id: str
    backend: str
    placed_at: datetime | None
    moves: int = 0
    moved_from: str | None = None
    move_reason: str | None = None


def _placement(row: PlacementRow) -> Placement:
    return Placement(
        row.conversation_id,
        row.backend,
        row.placed_at,
        row.moves or 0,
        row.moved_from,
        row.move_reason,
    )


class PlacementStore:
    """``Store``'s placement methods (mixed in; ``_session`` is the store's transaction)."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def get_placement(self, conversation_id: str) -> Placement | None:
        with self._session() as session:
            row = session.get(PlacementRow, conversation_id)
            return None if row is None else _placement(row)

    @_retry_busy
    def claim_placement(self, conversation_id: str, backend: str) -> Placement:
        """Place the conversation on ``backend`` unless it is placed already; the placement
        that holds (this one, or the one another process claimed first)."""
        with self._session(write=True) as session:
            insert_if_missing(
                session,
                PlacementRow,
                {
                    "conversation_id": conversation_id,
                    "backend": backend,
                    "placed_at": utcnow(),
                    "moves": 0,
                },
                key=["conversation_id"],
            )
            row = session.get(PlacementRow, conversation_id, populate_existing=True)
            assert row is not None
            return _placement(row)

    @_retry_busy
    def move_placement(
        self, conversation_id: str, *, from_backend: str, to_backend: str, reason: str
    ) -> Placement | None:
        """Move the conversation off ``from_backend`` (only if it is still there); the
        placement now, or None when the conversation is not placed."""
        with self._session(write=True) as session:
            session.execute(
                update(PlacementRow)
                .where(
                    PlacementRow.conversation_id == conversation_id,
                    PlacementRow.backend == from_backend,
                )
                .values(
                    backend=to_backend,
                    placed_at=utcnow(),
                    moves=PlacementRow.moves + 1,
                    moved_from=from_backend,
                    move_reason=reason,
                )
            )
            row = session.get(PlacementRow, conversation_id, populate_existing=True)
            return None if row is None else _placement(row)

    def placements(self, backend: str | None = None) -> list[Placement]:
        """Every placement (on ``backend`` only, when given), by conversation id."""
        query = select(PlacementRow).order_by(PlacementRow.conversation_id)
        if backend is not None:
            query = query.where(PlacementRow.backend == backend)
        with self._session() as session:
            return [_placement(row) for row in session.scalars(query)]

    def placement_counts(self) -> dict[str, int]:
        """Conversations placed on each backend."""
        query = select(PlacementRow.backend, func.count()).group_by(PlacementRow.backend)
        with self._session() as session:
            return {backend: int(n) for backend, n in session.execute(query)}

    @_retry_busy
    def forget_placement(self, conversation_id: str) -> None:
        with self._session(write=True) as session:
            session.execute(
                delete(PlacementRow).where(PlacementRow.conversation_id == conversation_id)
            )
