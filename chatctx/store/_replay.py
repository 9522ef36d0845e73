"""The in-memory store a replay runs on: ``Store``, with the per-turn paths made cheap.

A replayed turn goes through ``ChatSession``, which reads the conversation, its context state,
its window of messages and its pinned ones back from the store on every turn, and writes the
user message, the reply and the turn record. Through the ORM that costs more than the rest of
a dry turn (tokenizing and planning), and budget sweeps replay thousands of turns. This
store has one writer (the replay), so it answers those reads from what it wrote, and writes
messages and turns with plain INSERTs, held back until the database is next read (a recall
search, say) and then sent in one transaction: the rows, ids and full-text index are the same
as ``Store``'s. Writes it does not mirror (pinning, editing a message) go through ``Store``
and refresh the mirror. Not mirrored: the conversation's ``updated_at``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from chatctx.errors import StoreError
from chatctx.store._db import Store
from chatctx.store._models import MessageRow, TurnRow, utcnow
from chatctx.store._records import (
    ROLES,
    ContextInputs,
    Conversation,
    Message,
    StoredContextState,
    Turn,
)

_TURN_FIELDS = tuple(name for name in Turn.__dataclass_fields__ if name not in ("id", "created_at"))


class ReplayStore(Store):
    """An in-memory SQLite ``Store`` for one process's replay; close it when done."""

    def __init__(self) -> None:
        super().__init__("sqlite://")
        self._conversations: dict[str, Conversation] = {}
        self._history: dict[str, list[Message]] = {}
        self._states: dict[str, StoredContextState] = {}
        self._token_counts: dict[tuple[str, int], int] = {}
        self._last_ids: dict[str, int] = {}
        self._pending_messages: list[dict[str, Any]] = []
        self._pending_turns: list[dict[str, Any]] = []

    @contextmanager
    def _session(self, *, write: bool = False) -> Iterator[Session]:
        # Every read and write of Store's goes through here: the held-back rows go first.
        self.flush()
        with super()._session(write=write) as session:
            yield session

    def flush(self) -> None:
        """Write the messages and turns held back, in one transaction."""
        with self._lock:
            if not (self._pending_messages or self._pending_turns):
                return
            with self.engine.begin() as connection:
                if self._pending_messages:
                    connection.execute(insert(MessageRow), self._pending_messages)
                if self._pending_turns:
                    connection.execute(insert(TurnRow), self._pending_turns)
            self._pending_messages.clear()
            self._pending_turns.clear()

    def close(self) -> None:
        self._pending_messages.clear()  # an in-memory database: nothing outlives it
        self._pending_turns.clear()
        super().close()

    # conversations ------------------------------------------------------------------------

    def create_conversation(
        self,
        conversation_id: str | None = None,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Conversation:
        conversation = super().create_conversation(
            conversation_id,
            title=title,
            system_prompt=system_prompt,
            settings=settings,
            metadata=metadata,
        )
        with self._lock:
            self._conversations[conversation.id] = conversation
            self._history[conversation.id] = []
        return conversation

    def get_or_create_conversation(
        self,
        conversation_id: str,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> tuple[Conversation, bool]:
        conversation, created = super().get_or_create_conversation(
            conversation_id, title=title, system_prompt=system_prompt, settings=settings
        )
        with self._lock:
            self._conversations[conversation.id] = conversation
            if created:
                self._history[conversation.id] = []
        return conversation, created

    def update_conversation(
        self,
        conversation_id: str,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        clear_system_prompt: bool = False,
    ) -> Conversation:
        conversation = super().update_conversation(
            conversation_id,
            title=title,
            system_prompt=system_prompt,
            settings=settings,
            metadata=metadata,
            clear_system_prompt=clear_system_prompt,
        )
        with self._lock:
            self._conversations[conversation_id] = conversation
        return conversation

    def get_conversation(self, conversation_id: str) -> Conversation:
        with self._lock:
            cached = self._conversations.get(conversation_id)
            if cached is None:
                cached = self._conversations[conversation_id] = super().get_conversation(
                    conversation_id
                )
            return replace(cached, message_count=len(self._messages_of(conversation_id)))

    def delete_conversation(self, conversation_id: str) -> None:
        super().delete_conversation(conversation_id)
        with self._lock:
            self._conversations.pop(conversation_id, None)
            self._history.pop(conversation_id, None)
            self._states.pop(conversation_id, None)

    # messages -----------------------------------------------------------------------------

    def _messages_of(self, conversation_id: str) -> list[Message]:
        history = self._history.get(conversation_id)
        if history is None:
            history = self._history[conversation_id] = super().messages(conversation_id)
        return history

    def add_messages(
        self,
        conversation_id: str,
        messages: Sequence[dict[str, Any]],
        *,
        settings: dict[str, Any] | None = None,
    ) -> list[Message]:
        if settings is not None:
            self.update_conversation(conversation_id, settings=settings)
        for message in messages:
            if message["role"] not in ROLES:
                raise StoreError(f"unknown role {message['role']!r}")
            if not isinstance(message.get("content"), str):  # refused now, not at the flush
                raise StoreError(f"message content must be text, not {message.get('content')!r}")
        with self._lock:
            self.get_conversation(conversation_id)  # ConversationNotFound
            history = self._messages_of(conversation_id)
            now = utcnow()
            rows = [
                {
                    "conversation_id": conversation_id,
                    "position": len(history) + n,
                    "role": m["role"],
                    "content": m["content"],
                    "status": m.get("status") or "complete",
                    "name": m.get("name"),
                    "tool_call_id": m.get("tool_call_id"),
                    "tool_calls": m.get("tool_calls"),
                    "pinned": False,
                    "created_at": now,
                }
                for n, m in enumerate(messages)
            ]
            if not rows:
                return []
            first = self._next_ids(MessageRow, len(rows))
            for n, row in enumerate(rows):
                row["id"] = first + n
            self._pending_messages.extend(rows)
            added = [Message(**row) for row in rows]
            history.extend(added)
            return added

    def messages(self, conversation_id: str, *, from_position: int = 0) -> list[Message]:
        with self._lock:
            self.get_conversation(conversation_id)  # ConversationNotFound
            return [m for m in self._messages_of(conversation_id) if m.position >= from_position]

    def context_inputs(self, conversation_id: str) -> ContextInputs:
        # From what it mirrors (the one writer's view is consistent by itself).
        with self._lock:
            conversation = self.get_conversation(conversation_id)
            state = self.context_state(conversation_id)
            return ContextInputs(
                conversation,
                state,
                self.messages(conversation_id, from_position=state.window_start),
                self.pinned_messages(conversation_id),
            )

    def last_turn(self, conversation_id: str) -> list[Message]:
        history = self.messages(conversation_id)
        start = max((i for i, m in enumerate(history) if m.role == "user"), default=None)
        return [] if start is None else history[start:]

    def pinned_messages(self, conversation_id: str) -> list[Message]:
        with self._lock:
            if conversation_id not in self._conversations:
                return super().pinned_messages(conversation_id)
            return [m for m in self._messages_of(conversation_id) if m.pinned]

    def _reload(self, message: Message) -> Message:
        with self._lock:
            self._history.pop(message.conversation_id, None)
        return message

    def set_pinned(self, message_id: int, pinned: bool = True) -> Message:
        return self._reload(super().set_pinned(message_id, pinned))

    def update_message(self, message_id: int, *, content: str, status: str) -> Message:
        return self._reload(super().update_message(message_id, content=content, status=status))

    # the context builder's token counts, context state --------------------------------------

    def get_token_counts(self, fingerprint: str, ids: Sequence[int]) -> dict[int, int]:
        counts = self._token_counts
        return {i: counts[fingerprint, i] for i in ids if (fingerprint, i) in counts}

    def put_token_counts(self, fingerprint: str, counts: Mapping[int, int]) -> None:
        # Kept in memory only: the store lives as long as the replay.
        self._token_counts.update({(fingerprint, i): n for i, n in counts.items()})

    def context_state(self, conversation_id: str) -> StoredContextState:
        with self._lock:
            state = self._states.get(conversation_id)
            if state is None:
                state = self._states[conversation_id] = super().context_state(conversation_id)
            return state

    def save_context_state(
        self,
        conversation_id: str,
        *,
        window_start: int,
        pending_ids: Sequence[int] = (),
        new_summary: tuple[str, Sequence[int], int, str] | None = None,
        expected_version: int | None = None,
        summary_blocks: Sequence[tuple[int, int]] = (),
        abridged: Sequence[Sequence[int]] = (),
        cleared_ids: Sequence[int] = (),
    ) -> StoredContextState:
        state = super().save_context_state(
            conversation_id,
            window_start=window_start,
            pending_ids=pending_ids,
            new_summary=new_summary,
            expected_version=expected_version,
            summary_blocks=summary_blocks,
            abridged=abridged,
            cleared_ids=cleared_ids,
        )
        with self._lock:
            self._states[conversation_id] = state
        return state

    # turns --------------------------------------------------------------------------------

    def add_turn(self, conversation_id: str, **figures: Any) -> Turn:
        if figures.get("swap_in") not in (None, "ram", "disk"):
            raise StoreError(f"swap_in must be 'ram', 'disk' or None, not {figures['swap_in']!r}")
        unknown = set(figures) - set(_TURN_FIELDS) - {"conversation_id"}
        if unknown:
            raise StoreError(f"unknown turn fields: {sorted(unknown)}")
        values: dict[str, Any] = {name: figures.get(name) for name in _TURN_FIELDS}
        values |= {"conversation_id": conversation_id, "created_at": utcnow()}
        if values["seq_id"] is None:
            values["seq_id"] = 0
        with self._lock:
            self.get_conversation(conversation_id)  # ConversationNotFound
            values["id"] = self._next_ids(TurnRow, 1)
            self._pending_turns.append(values)
        return Turn(**values)

    def record_reply(
        self, conversation_id: str, reply: Mapping[str, Any] | None, **figures: Any
    ) -> tuple[Message | None, Turn]:
        # Both rows are held back and sent in the same transaction at the next flush.
        with self._lock:
            message = self.add_messages(conversation_id, [dict(reply)])[0] if reply else None
            figures["assistant_message_id"] = message.id if message is not None else None
            return message, self.add_turn(conversation_id, **figures)

    def _next_ids(self, table: type[MessageRow] | type[TurnRow], count: int) -> int:
        """The first of ``count`` new ids for ``table``'s rows.

        Ids are given, not returned: an INSERT without RETURNING costs about half as much.
        This store is the table's only writer, so the next id follows the last one.
        """
        last = self._last_ids.get(table.__tablename__)
        if last is None:
            self.flush()
            with self.engine.connect() as connection:
                last = connection.scalar(select(func.max(table.id))) or 0
        self._last_ids[table.__tablename__] = last + count
        return last + 1
