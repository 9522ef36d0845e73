"""Turn claims: one turn of a conversation at a time, across processes and machines.

``chatctx serve`` takes a conversation's turns one at a time within a process (a lock per
conversation). Several serve processes on one database claim the turn here too: a turn
claims the conversation's row before it stores anything, renews the claim while it runs and
releases it at the end. A claim another owner holds and has not let expire is refused; one
that expired (its process died) is taken over. Both are one compare-and-set statement, so
two processes racing for one conversation never both win.

Expiry is by the database's clock on PostgreSQL, so bot machines whose clocks disagree still
agree on when a claim runs out; a SQLite file lives on one machine, whose clock its processes
share.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import DateTime, delete, func, or_, select, update
from sqlalchemy.orm import Session

from chatctx.store._caches import insert_if_missing
from chatctx.store._connect import _retry_busy
from chatctx.store._models import TurnClaimRow, utcnow


class TurnClaimStore:
    """``Store``'s turn-claim methods (mixed in; ``_session`` is the store's transaction)."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    @_retry_busy
    def claim_turn(self, conversation_id: str, owner: str, ttl_s: float) -> bool:
        """Claim the conversation's turn for ``owner`` for ``ttl_s`` seconds from now, or
        renew ``owner``'s claim; False while another owner holds an unexpired claim."""
        with self._session(write=True) as session:
            now = _now(session)
            until = now + timedelta(seconds=ttl_s)
            values = {"conversation_id": conversation_id, "owner": owner, "expires_at": until}
            if insert_if_missing(session, TurnClaimRow, values, key=["conversation_id"]):
                return True
            taken = session.execute(
                update(TurnClaimRow)
                .where(
                    TurnClaimRow.conversation_id == conversation_id,
                    or_(TurnClaimRow.owner == owner, TurnClaimRow.expires_at < now),
                )
                .values(owner=owner, expires_at=until)
                .returning(TurnClaimRow.conversation_id)
            ).first()
            return taken is not None

    @_retry_busy
    def renew_turn(self, conversation_id: str, owner: str, ttl_s: float) -> bool:
        """Extend ``owner``'s claim to ``ttl_s`` seconds from now; False when ``owner`` no
        longer holds it. Never claims anew: a renewal that lands after the turn let its
        claim go leaves the conversation free."""
        with self._session(write=True) as session:
            until = _now(session) + timedelta(seconds=ttl_s)
            renewed = session.execute(
                update(TurnClaimRow)
                .where(
                    TurnClaimRow.conversation_id == conversation_id,
                    TurnClaimRow.owner == owner,
                )
                .values(expires_at=until)
                .returning(TurnClaimRow.conversation_id)
            ).first()
            return renewed is not None

    @_retry_busy
    def take_over_turn(
        self, conversation_id: str, owner: str, from_owner: str, ttl_s: float
    ) -> bool:
        """Give ``from_owner``'s claim to ``owner`` for ``ttl_s`` seconds, expired or not (its
        process is known to be gone); False when ``from_owner`` no longer holds it."""
        with self._session(write=True) as session:
            until = _now(session) + timedelta(seconds=ttl_s)
            taken = session.execute(
                update(TurnClaimRow)
                .where(
                    TurnClaimRow.conversation_id == conversation_id,
                    TurnClaimRow.owner == from_owner,
                )
                .values(owner=owner, expires_at=until)
                .returning(TurnClaimRow.conversation_id)
            ).first()
            return taken is not None

    @_retry_busy
    def release_turn(self, conversation_id: str, owner: str) -> None:
        """Let the conversation's turn go, if ``owner`` still holds it."""
        with self._session(write=True) as session:
            session.execute(
                delete(TurnClaimRow).where(
                    TurnClaimRow.conversation_id == conversation_id, TurnClaimRow.owner == owner
                )
            )

    def turn_claim(self, conversation_id: str) -> tuple[str, datetime] | None:
        """(owner, expires at) of the conversation's claim, expired or not; None when none."""
        with self._session() as session:
            row = session.execute(
                select(TurnClaimRow.owner, TurnClaimRow.expires_at).where(
                    TurnClaimRow.conversation_id == conversation_id
                )
            ).first()
            return None if row is None else (row[0], row[1])


def _now(session: Session) -> Any:
    """Now, as the database's clock says where several machines share it (PostgreSQL: an
    expression in the statement, UTC like the stored times), else this process's."""
    if session.get_bind().dialect.name == "postgresql":
        return func.timezone("UTC", func.clock_timestamp(), type_=DateTime)
    return utcnow()
