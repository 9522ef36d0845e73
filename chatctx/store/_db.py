"""The conversation store: any SQLAlchemy URL, SQLite tuned for several processes."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from sqlalchemy import ColumnElement, delete, func, insert, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from chatctx._resource import Closeable
from chatctx.errors import ContextStateConflict, ConversationNotFound, StoreError
from chatctx.store import _migrate
from chatctx.store._caches import CacheMixin, insert_if_missing
from chatctx.store._claims import TurnClaimStore
from chatctx.store._connect import _retry_busy, create_db_engine
from chatctx.store._models import (
    ContextStateRow,
    ConversationRow,
    MessageRow,
    PlacementRow,
    SummaryRow,
    TurnRow,
    utcnow,
)
from chatctx.store._placements import PlacementStore
from chatctx.store._records import (
    ROLES,
    ContextInputs,
    Conversation,
    Message,
    StoredContextState,
    Summary,
    Turn,
)
from chatctx.store._responses import ResponseStore

logger = logging.getLogger("chatctx.store")


def _message(row: MessageRow) -> Message:
    return Message(
        id=row.id,
        conversation_id=row.conversation_id,
        position=row.position,
        role=row.role,
        content=row.content,
        status=row.status,
        name=row.name,
        tool_call_id=row.tool_call_id,
        tool_calls=row.tool_calls,
        created_at=row.created_at,
        pinned=row.pinned,
    )


def _summary(row: SummaryRow) -> Summary:
    return Summary(
        id=row.id,
        conversation_id=row.conversation_id,
        content=row.content,
        covered_message_ids=list(row.covered_message_ids or []),
        token_count=row.token_count,
        tokenizer=row.tokenizer,
        created_at=row.created_at,
        blocks=tuple((int(start), int(after)) for start, after in row.blocks or ()),
        abridged=tuple(tuple(int(x) for x in cut) for cut in row.abridged or ()),
    )


def _conversation(row: ConversationRow, count: int = 0) -> Conversation:
    return Conversation(
        id=row.id,
        title=row.title,
        system_prompt=row.system_prompt,
        settings=dict(row.settings or {}),
        created_at=row.created_at,
        updated_at=row.updated_at,
        message_count=count,
        metadata=None if row.meta is None else dict(row.meta),
    )


def _turn(row: TurnRow) -> Turn:
    return Turn(**{name: getattr(row, name) for name in Turn.__dataclass_fields__})


def _read_conversation(session: Session, conversation_id: str) -> Conversation:
    row = session.get(ConversationRow, conversation_id)
    if row is None:
        raise ConversationNotFound(conversation_id)
    count = session.scalar(
        select(func.count()).where(MessageRow.conversation_id == conversation_id)
    )
    return _conversation(row, count or 0)


def _read_messages(session: Session, conversation_id: str, from_position: int) -> list[Message]:
    rows = session.scalars(
        select(MessageRow)
        .where(
            MessageRow.conversation_id == conversation_id,
            MessageRow.position >= from_position,
        )
        .order_by(MessageRow.position)
    )
    return [_message(row) for row in rows]


def _read_pinned(session: Session, conversation_id: str) -> list[Message]:
    rows = session.scalars(
        select(MessageRow)
        .where(MessageRow.conversation_id == conversation_id, MessageRow.pinned)
        .order_by(MessageRow.position)
    )
    return [_message(row) for row in rows]


def _read_state(session: Session, conversation_id: str) -> StoredContextState:
    row = session.get(ContextStateRow, conversation_id)
    if row is None:
        return StoredContextState()
    summary = session.get(SummaryRow, row.summary_id) if row.summary_id else None
    return StoredContextState(
        window_start=row.window_start,
        summary=_summary(summary) if summary else None,
        pending_ids=tuple(row.pending_ids or ()),
        version=row.version,
        cleared_ids=tuple(row.cleared_ids or ()),
    )


def _append(
    session: Session,
    conversation_id: str,
    messages: Sequence[Mapping[str, Any]],
    settings: dict[str, Any] | None = None,
) -> list[Message]:
    """Append messages at the conversation's next positions (inside a write transaction);
    ``settings`` replace the conversation's.

    Plain statements on the tables, no rows loaded into the session: a turn appends twice,
    and the ORM's loading and flushing cost more than the statements.
    """
    for message in messages:
        if message["role"] not in ROLES:
            raise StoreError(f"unknown role {message['role']!r}")
    # On the session's connection: Core statements, never the ORM's unit of work.
    connection = session.connection()
    # The write lock (SQLite) or the row lock this UPDATE takes (other databases) serializes
    # appends to one conversation, so the next position is read by one writer at a time.
    now = utcnow()
    values: dict[str, Any] = {"updated_at": now}
    if settings is not None:
        values["settings"] = settings
    touch = update(ConversationRow).where(ConversationRow.id == conversation_id).values(**values)
    if connection.dialect.update_returning:  # SQLite, PostgreSQL
        found = connection.execute(touch.returning(ConversationRow.id)).first() is not None
    else:
        found = connection.execute(touch).rowcount > 0
    if not found:
        raise ConversationNotFound(conversation_id)
    last = connection.scalar(
        select(func.max(MessageRow.position)).where(MessageRow.conversation_id == conversation_id)
    )
    position = -1 if last is None else last
    added = []
    for message in messages:
        position += 1
        row = {
            "conversation_id": conversation_id,
            "position": position,
            "role": message["role"],
            "content": message["content"],
            "status": message.get("status") or "complete",
            "name": message.get("name"),
            "tool_call_id": message.get("tool_call_id"),
            "tool_calls": message.get("tool_calls"),
            "pinned": False,
            "created_at": now,
        }
        key = connection.execute(insert(MessageRow).values(**row)).inserted_primary_key
        assert key is not None  # a single-row INSERT of a table with a primary key
        added.append(Message(id=int(key[0]), **row))
    return added


def _add_turn(session: Session, conversation_id: str, figures: Mapping[str, Any]) -> TurnRow:
    swap_in = figures.get("swap_in")
    if swap_in not in (None, "ram", "disk"):
        raise StoreError(f"swap_in must be 'ram', 'disk' or None, not {swap_in!r}")
    row = TurnRow(conversation_id=conversation_id, **figures)
    session.add(row)
    session.flush()
    return row


class Store(PlacementStore, TurnClaimStore, ResponseStore, CacheMixin, Closeable):
    """Conversations, messages, summaries and per-turn figures in one database.

    Opening a store upgrades its schema to the newest migration. Use as a context manager.
    Several processes and threads may share one database: writes are serialized (SQLite:
    ``BEGIN IMMEDIATE``; others: the conversation row is locked for appends) and run again
    with backoff while the database is busy; reads go on concurrently (SQLite WAL). An
    in-memory SQLite store has one connection, used by one thread at a time.
    """

    def __init__(self, url: str, *, upgrade: bool = True) -> None:
        self.url = url
        self.engine = create_db_engine(url)
        in_memory = isinstance(self.engine.pool, StaticPool)
        self._lock: AbstractContextManager[Any] = threading.RLock() if in_memory else nullcontext()
        try:
            if upgrade:
                self._upgrade()
        except BaseException:
            self.engine.dispose()
            raise
        self._reads = sessionmaker(self.engine, expire_on_commit=False)
        self._writes = sessionmaker(
            self.engine.execution_options(**{_migrate.IMMEDIATE: True}), expire_on_commit=False
        )

    @_retry_busy
    def _upgrade(self) -> None:
        try:
            _migrate.upgrade(self.engine)
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot upgrade database {self.url!r}: {exc}") from exc

    def close(self) -> None:
        self.engine.dispose()
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (a closed store is not written to)."""
        return getattr(self, "_closed", False)

    @contextmanager
    def _session(self, *, write: bool = False) -> Iterator[Session]:
        """One transaction; ``write`` takes the write lock when it begins (SQLite)."""
        with self._lock:
            session = (self._writes if write else self._reads)()
            try:
                yield session
                session.commit()
            except SQLAlchemyError as exc:
                session.rollback()
                raise StoreError(f"database error: {exc}") from exc
            except BaseException:
                session.rollback()
                raise
            finally:
                session.close()

    # conversations -------------------------------------------------------------------------

    @_retry_busy
    def create_conversation(
        self,
        conversation_id: str | None = None,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Conversation:
        """Create a conversation; an id is generated when none is given."""
        cid = conversation_id or uuid.uuid4().hex[:12]
        with self._session(write=True) as session:
            # One statement: two writers creating the same id get "already exists", never a
            # duplicate-key error from the database.
            created = insert_if_missing(
                session,
                ConversationRow,
                {
                    "id": cid,
                    "title": title,
                    "system_prompt": system_prompt,
                    "settings": settings or {},
                    "meta": metadata,
                    "created_at": utcnow(),
                    "updated_at": utcnow(),
                },
                key=["id"],
            )
            if not created:
                raise StoreError(f"conversation {cid!r} already exists")
            row = session.get(ConversationRow, cid)
            assert row is not None  # inserted in this transaction
            return _conversation(row)

    @_retry_busy
    def get_or_create_conversation(
        self,
        conversation_id: str,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> tuple[Conversation, bool]:
        """The conversation with this id, created with these fields when there is none.

        Returns (conversation, created). Idempotent under concurrency: when several threads
        or processes open the same new id at once, exactly one creates it and the others get
        it (an ``INSERT ... ON CONFLICT DO NOTHING``; a savepoint elsewhere), never an error.
        """
        with self._session(write=True) as session:
            created = insert_if_missing(
                session,
                ConversationRow,
                {
                    "id": conversation_id,
                    "title": title,
                    "system_prompt": system_prompt,
                    "settings": settings or {},
                    "created_at": utcnow(),
                    "updated_at": utcnow(),
                },
                key=["id"],
            )
            row = session.get(ConversationRow, conversation_id, populate_existing=True)
            if row is None:  # deleted between the insert and the read: rare, try again
                raise StoreError(f"conversation {conversation_id!r} vanished while opened")
            return _conversation(row), created

    def get_conversation(self, conversation_id: str) -> Conversation:
        with self._session() as session:
            return _read_conversation(session, conversation_id)

    def has_conversation(self, conversation_id: str) -> bool:
        with self._session() as session:
            return session.get(ConversationRow, conversation_id) is not None

    @_retry_busy
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
        """Change the given fields (None leaves a field as it is; ``clear_system_prompt``
        removes the system prompt)."""
        with self._session(write=True) as session:
            row = session.get(ConversationRow, conversation_id)
            if row is None:
                raise ConversationNotFound(conversation_id)
            if title is not None:
                row.title = title
            if system_prompt is not None or clear_system_prompt:
                row.system_prompt = system_prompt
            if settings is not None:
                row.settings = settings
            if metadata is not None:
                row.meta = metadata
            session.flush()
            return _conversation(row)

    def list_conversations(self) -> list[Conversation]:
        """Every conversation with its message count, most recently updated first."""
        counts = (
            select(MessageRow.conversation_id, func.count().label("n"))
            .group_by(MessageRow.conversation_id)
            .subquery()
        )
        query = (
            select(ConversationRow, func.coalesce(counts.c.n, 0))
            .outerjoin(counts, counts.c.conversation_id == ConversationRow.id)
            .order_by(ConversationRow.updated_at.desc(), ConversationRow.id)
        )
        with self._session() as session:
            return [_conversation(row, n) for row, n in session.execute(query)]

    def conversations_page(
        self,
        *,
        prefix: str = "",
        after: str | None = None,
        limit: int = 100,
    ) -> list[Conversation]:
        """At most ``limit`` conversations whose id starts with ``prefix``, ordered by id in
        code point order, the first after ``after``.

        One page read from the database, with the message counts of that page only (list
        every conversation with ``list_conversations``).
        """
        # Code point order (SQLite's and Python's) on PostgreSQL too, whatever its locale.
        postgres = self.engine.dialect.name == "postgresql"
        ident: ColumnElement[str] = (
            ConversationRow.id.collate("C") if postgres else ConversationRow.id.expression
        )
        query = select(ConversationRow).order_by(ident).limit(limit)
        if prefix:
            query = query.where(ConversationRow.id.startswith(prefix, autoescape=True))
        if after is not None:
            query = query.where(ident > after)
        with self._session() as session:
            rows = list(session.scalars(query))
            if not rows:
                return []
            counts: dict[str, int] = dict(
                session.execute(
                    select(MessageRow.conversation_id, func.count())
                    .where(MessageRow.conversation_id.in_([r.id for r in rows]))
                    .group_by(MessageRow.conversation_id)
                ).all()
            )
            return [_conversation(row, counts.get(row.id, 0)) for row in rows]

    @_retry_busy
    def delete_conversation(self, conversation_id: str) -> None:
        with self._session(write=True) as session:
            row = session.get(ConversationRow, conversation_id)
            if row is None:
                raise ConversationNotFound(conversation_id)
            session.delete(row)
            session.execute(
                delete(PlacementRow).where(PlacementRow.conversation_id == conversation_id)
            )

    # messages ------------------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: str,
        role: str,
        content: str,
        *,
        status: str = "complete",
        name: str | None = None,
        tool_call_id: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        conversation_settings: dict[str, Any] | None = None,
    ) -> Message:
        """Append a message and commit it at once (with ``conversation_settings``, the
        conversation's new settings, in the same transaction)."""
        return self.add_messages(
            conversation_id,
            [
                {
                    "role": role,
                    "content": content,
                    "status": status,
                    "name": name,
                    "tool_call_id": tool_call_id,
                    "tool_calls": tool_calls,
                }
            ],
            settings=conversation_settings,
        )[0]

    @_retry_busy
    def add_messages(
        self,
        conversation_id: str,
        messages: Sequence[dict[str, Any]],
        *,
        settings: dict[str, Any] | None = None,
    ) -> list[Message]:
        """Append several messages in one transaction (all or none); ``settings`` replace
        the conversation's in the same transaction."""
        for message in messages:
            if message["role"] not in ROLES:
                raise StoreError(f"unknown role {message['role']!r}")
        with self._session(write=True) as session:
            return _append(session, conversation_id, messages, settings)

    @_retry_busy
    def update_message(self, message_id: int, *, content: str, status: str) -> Message:
        """Set a message's content and status (used to finish a streamed reply)."""
        with self._session(write=True) as session:
            row = session.get(MessageRow, message_id)
            if row is None:
                raise StoreError(f"no message with id {message_id}")
            row.content = content
            row.status = status
            session.flush()
            return _message(row)

    def messages(self, conversation_id: str, *, from_position: int = 0) -> list[Message]:
        """The full, untrimmed history in order (from ``from_position`` on)."""
        with self._session() as session:
            if session.get(ConversationRow, conversation_id) is None:
                raise ConversationNotFound(conversation_id)
            return _read_messages(session, conversation_id, from_position)

    def context_inputs(self, conversation_id: str) -> ContextInputs:
        """The conversation, its context state, its messages from the state's window start
        and its pinned messages, in one read transaction: one consistent view, read at the
        cost of one (what every turn reads before building its context)."""
        with self._session() as session:
            conversation = _read_conversation(session, conversation_id)
            state = _read_state(session, conversation_id)
            return ContextInputs(
                conversation,
                state,
                _read_messages(session, conversation_id, state.window_start),
                _read_pinned(session, conversation_id),
            )

    def last_turn(self, conversation_id: str) -> list[Message]:
        """The messages of the newest turn: its user message and all after it (empty when
        no user message was stored yet)."""
        with self._session() as session:
            if session.get(ConversationRow, conversation_id) is None:
                raise ConversationNotFound(conversation_id)
            start = session.scalar(
                select(func.max(MessageRow.position)).where(
                    MessageRow.conversation_id == conversation_id, MessageRow.role == "user"
                )
            )
            if start is None:
                return []
            rows = session.scalars(
                select(MessageRow)
                .where(
                    MessageRow.conversation_id == conversation_id,
                    MessageRow.position >= start,
                )
                .order_by(MessageRow.position)
            )
            return [_message(row) for row in rows]

    def messages_by_ids(self, ids: Sequence[int]) -> list[Message]:
        """Messages with these ids, in conversation order."""
        if not ids:
            return []
        with self._session() as session:
            rows = session.scalars(
                select(MessageRow)
                .where(MessageRow.id.in_(list(ids)))
                .order_by(MessageRow.conversation_id, MessageRow.position)
            )
            return [_message(row) for row in rows]

    def pinned_messages(self, conversation_id: str) -> list[Message]:
        with self._session() as session:
            return _read_pinned(session, conversation_id)

    @_retry_busy
    def set_pinned(self, message_id: int, pinned: bool = True) -> Message:
        """Pin a message: it is then always sent, right after the system prompt."""
        with self._session(write=True) as session:
            row = session.get(MessageRow, message_id)
            if row is None:
                raise StoreError(f"no message with id {message_id}")
            row.pinned = pinned
            session.flush()
            return _message(row)

    # context state and summaries -----------------------------------------------------------

    def context_state(self, conversation_id: str) -> StoredContextState:
        with self._session() as session:
            return _read_state(session, conversation_id)

    @_retry_busy
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
        """Persist the window start and, when it changed, a new summary version.

        ``new_summary`` is (content, newly covered message ids, token count, tokenizer);
        ``summary_blocks`` where its parts are sent in the append layout, ``abridged`` what of
        each evicted message the abridge layout sends; ``cleared_ids`` the tool results in the
        window sent as a stub (cleared to save room).
        Both are written in one transaction. Each save adds one to the state's ``version``;
        with ``expected_version`` (the version read by ``context_state``) it is a
        compare-and-set: when another writer saved in between, nothing is written and
        ``ContextStateConflict`` is raised, so a read-modify-write never loses an update.
        """
        with self._session(write=True) as session:
            # Get-or-create in one statement, then the row locked until commit (SQLite: BEGIN
            # IMMEDIATE serializes writers already), so the version check and the write are
            # one step for every other writer.
            insert_if_missing(
                session,
                ContextStateRow,
                {
                    "conversation_id": conversation_id,
                    "window_start": 0,
                    "pending_ids": [],
                    "version": 0,
                    "updated_at": utcnow(),
                },
                key=["conversation_id"],
            )
            row = session.get(
                ContextStateRow, conversation_id, with_for_update=True, populate_existing=True
            )
            if row is None:
                raise ConversationNotFound(conversation_id)
            if expected_version is not None and row.version != expected_version:
                raise ContextStateConflict(conversation_id, expected_version, row.version)
            row.version += 1
            row.window_start = window_start
            row.pending_ids = list(pending_ids)
            row.cleared_ids = list(cleared_ids) or None
            summary_row = None
            if new_summary is not None:
                content, covered, tokens, tokenizer = new_summary
                summary_row = SummaryRow(
                    conversation_id=conversation_id,
                    content=content,
                    covered_message_ids=list(covered),
                    token_count=tokens,
                    tokenizer=tokenizer,
                    blocks=[[start, after] for start, after in summary_blocks] or None,
                    abridged=[[int(x) for x in cut] for cut in abridged] or None,
                )
                session.add(summary_row)
                session.flush()
                row.summary_id = summary_row.id
            elif row.summary_id:
                summary_row = session.get(SummaryRow, row.summary_id)
            session.flush()
            return StoredContextState(
                window_start=row.window_start,
                summary=_summary(summary_row) if summary_row else None,
                pending_ids=tuple(row.pending_ids),
                version=row.version,
                cleared_ids=tuple(row.cleared_ids or ()),
            )

    def summaries(self, conversation_id: str) -> list[Summary]:
        """Every summary version, oldest first."""
        with self._session() as session:
            rows = session.scalars(
                select(SummaryRow)
                .where(SummaryRow.conversation_id == conversation_id)
                .order_by(SummaryRow.id)
            )
            return [_summary(row) for row in rows]

    # turns ---------------------------------------------------------------------------------

    @_retry_busy
    def add_turn(
        self,
        conversation_id: str,
        *,
        slot: int | None = None,
        swap_in: str | None = None,
        swap_in_ms: float | None = None,
        swap_in_bytes: int | None = None,
        reprefill_reason: str | None = None,
        batch_max: int | None = None,
        **figures: Any,
    ) -> Turn:
        """Record one turn's token and timing figures (``figures``: the ``Turn`` fields).

        The slot pool's figures: ``slot`` the turn ran in; ``swap_in`` ``"ram"`` or
        ``"disk"`` when its KV state was restored from a swap (with ``swap_in_ms`` and
        ``swap_in_bytes``); ``reprefill_reason`` when a swapped state could not be used and
        the prompt was prefilled again; ``batch_max``, the most sequences decoded together
        in one step of the turn.
        """
        pool = {
            "slot": slot,
            "swap_in": swap_in,
            "swap_in_ms": swap_in_ms,
            "swap_in_bytes": swap_in_bytes,
            "reprefill_reason": reprefill_reason,
            "batch_max": batch_max,
        }
        with self._session(write=True) as session:
            return _turn(_add_turn(session, conversation_id, {**pool, **figures}))

    @_retry_busy
    def record_reply(
        self,
        conversation_id: str,
        reply: Mapping[str, Any] | None,
        **figures: Any,
    ) -> tuple[Message | None, Turn]:
        """Store a turn's reply (an assistant message, or None) and its turn record at once.

        One transaction: either both rows exist or neither, so no reply is ever stored
        without its figures (or figures pointing at a reply that is not there). ``figures``
        are ``add_turn``'s; ``assistant_message_id`` is filled in here.
        """
        with self._session(write=True) as session:
            message = None
            if reply is not None:
                (message,) = _append(session, conversation_id, [dict(reply)])
            figures["assistant_message_id"] = message.id if message is not None else None
            return message, _turn(_add_turn(session, conversation_id, figures))

    def turns(self, conversation_id: str) -> list[Turn]:
        with self._session() as session:
            rows = session.scalars(
                select(TurnRow)
                .where(TurnRow.conversation_id == conversation_id)
                .order_by(TurnRow.id)
            )
            return [_turn(row) for row in rows]

    # recall --------------------------------------------------------------------------------

    def search_messages(
        self,
        conversation_id: str,
        query: str,
        *,
        before_position: int | None = None,
        exclude_ids: Sequence[int] = (),
        limit: int = 5,
        replies: bool = False,
    ) -> list[tuple[Message, float]]:
        """The conversation's messages that best match the words of ``query``, best first.

        Scores are BM25 on SQLite (FTS5, porter stemming), term rarity times ``ts_rank_cd``
        on PostgreSQL (a ``tsvector`` column, Snowball stemming), a term-rarity score
        elsewhere; higher is better. Only messages before ``before_position`` and not in
        ``exclude_ids`` are searched. Any text is a valid query: FTS syntax in it is quoted.
        With ``replies``, each matched user message is followed in the list by the assistant
        message right after it (when that one is searchable and not listed already), with the
        same score, so callers can recall the exchange as a whole.
        """
        from chatctx.store import search as _search  # local: the rest of this module stays unaware

        with self._session() as session:
            found = _search.search(
                session.connection(),
                conversation_id,
                query,
                before_position=before_position,
                exclude_ids=exclude_ids,
                limit=2 * limit if replies else limit,  # a reply may also be a match
                replies=replies,
            )
        out: list[tuple[Message, float]] = []
        seen: set[int] = set()
        hits = 0
        for match in found:
            if match.row.id in seen:  # listed already as the reply to a better match
                continue
            if hits == limit:
                break
            hits += 1
            seen.add(match.row.id)
            out.append((_message(match.row), match.score))
            if match.reply is not None and match.reply.id not in seen:
                seen.add(match.reply.id)
                out.append((_message(match.reply), match.score))
        return out
