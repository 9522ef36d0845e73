"""``/v1/responses`` answers kept as ranges of their conversation's messages, and branches.

A response is the messages ``[start, end)`` of one conversation: its input from ``start``,
its output from ``output_start``. A response that continues one which is not its
conversation's last forks the history: ``fork_conversation`` makes a conversation of the
first messages (up to the earlier response's ``end``), fitted, summarized and recalled on
its own from then on.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from chatctx.errors import ConversationNotFound, StoreError
from chatctx.store._caches import insert_if_missing
from chatctx.store._connect import _retry_busy
from chatctx.store._models import ConversationRow, MessageRow, ResponseRow, utcnow


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response: where it lies in its conversation, and the object answered."""

    id: str
    conversation_id: str
    previous_response_id: str | None
    start: int
    output_start: int
    end: int
    status: str
    body: dict[str, Any]
    created_at: datetime | None = None


def _response(row: ResponseRow) -> StoredResponse:
    return StoredResponse(
        row.id,
        row.conversation_id,
        row.previous_response_id,
        row.start,
        row.output_start,
        row.end,
        row.status,
        dict(row.body),
        row.created_at,
    )


class ResponseStore:
    """``Store``'s response methods (mixed in; ``_session`` is the store's transaction)."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    @_retry_busy
    def add_response(self, response: StoredResponse) -> None:
        with self._session(write=True) as session:
            if session.get(ConversationRow, response.conversation_id) is None:
                raise ConversationNotFound(response.conversation_id)
            session.add(
                ResponseRow(
                    id=response.id,
                    conversation_id=response.conversation_id,
                    previous_response_id=response.previous_response_id,
                    start=response.start,
                    output_start=response.output_start,
                    end=response.end,
                    status=response.status,
                    body=response.body,
                    created_at=response.created_at or utcnow(),
                )
            )

    def get_response(self, response_id: str) -> StoredResponse | None:
        with self._session() as session:
            row = session.get(ResponseRow, response_id)
            return None if row is None else _response(row)

    @_retry_busy
    def delete_response(self, response_id: str) -> bool:
        """Forget the response (its messages stay in the conversation); False when unknown."""
        with self._session(write=True) as session:
            gone = session.execute(
                delete(ResponseRow).where(ResponseRow.id == response_id).returning(ResponseRow.id)
            ).first()
            return gone is not None

    @_retry_busy
    def fork_conversation(self, source: str, new_id: str, *, upto: int) -> None:
        """A new conversation ``new_id``: ``source``'s system prompt, settings and messages
        at positions below ``upto``, copied in one transaction."""
        with self._session(write=True) as session:
            row = session.get(ConversationRow, source)
            if row is None:
                raise ConversationNotFound(source)
            now = utcnow()
            created = insert_if_missing(
                session,
                ConversationRow,
                {
                    "id": new_id,
                    "title": row.title,
                    "system_prompt": row.system_prompt,
                    "settings": dict(row.settings or {}),
                    "created_at": now,
                    "updated_at": now,
                },
                key=["id"],
            )
            if not created:
                raise StoreError(f"conversation {new_id!r} already exists")
            copied = session.scalars(
                select(MessageRow)
                .where(MessageRow.conversation_id == source, MessageRow.position < upto)
                .order_by(MessageRow.position)
            ).all()
            session.add_all(
                MessageRow(
                    conversation_id=new_id,
                    position=m.position,
                    role=m.role,
                    content=m.content,
                    name=m.name,
                    tool_call_id=m.tool_call_id,
                    tool_calls=m.tool_calls,
                    status=m.status,
                    pinned=m.pinned,
                    created_at=m.created_at,
                )
                for m in copied
            )
