"""SQLAlchemy 2 ORM models. The store is the full record: trimming never rewrites it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores aware UTC datetimes; SQLite drops the zone, so it is put back on read."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class StoredText(TypeDecorator[str]):
    """Text as given, except that PostgreSQL, which cannot hold U+0000 in text, gets U+FFFD
    in its place: a reply a model ended with a NUL byte is stored, not lost."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is not None and dialect.name == "postgresql" and "\x00" in value:
            return value.replace("\x00", "\ufffd")
        return value


class StoredString(TypeDecorator[str]):
    """``StoredText`` with a length (a title)."""

    impl = String
    cache_ok = True
    process_bind_param = StoredText.process_bind_param


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ConversationRow(Base):
    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    title: Mapped[str | None] = mapped_column(StoredString(500))
    system_prompt: Mapped[str | None] = mapped_column(StoredText)
    settings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # OpenAI's ``metadata`` (at most 16 string pairs): named apart from SQLAlchemy's own.
    meta: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)

    messages: Mapped[list[MessageRow]] = relationship(
        back_populates="conversation",
        order_by="MessageRow.position",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )


class MessageRow(Base):
    __tablename__ = "messages"
    __table_args__ = (
        Index("ix_messages_conversation_position", "conversation_id", "position", unique=True),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    position: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(20))
    content: Mapped[str] = mapped_column(StoredText)
    name: Mapped[str | None] = mapped_column(String(200))
    tool_call_id: Mapped[str | None] = mapped_column(String(200))
    tool_calls: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    # complete | partial (an interrupted reply)
    status: Mapped[str] = mapped_column(String(20), default="complete")
    # pinned messages are always sent, right after the system prompt
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    conversation: Mapped[ConversationRow] = relationship(back_populates="messages")


class SummaryRow(Base):
    """A running summary of evicted turns (filled by the context builder)."""

    __tablename__ = "summaries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    content: Mapped[str] = mapped_column(StoredText)
    covered_message_ids: Mapped[list[int]] = mapped_column(JSON, default=list)
    token_count: Mapped[int | None] = mapped_column(Integer)
    tokenizer: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # [[first character, message position it follows], ...]: where each part is sent in the
    # append layout (chatctx.context._layout); NULL: all of it up front.
    blocks: Mapped[list[list[int]] | None] = mapped_column(JSON)
    # [[message id, items it says, start, end, start, end, ...], ...]: what of each evicted
    # message the abridge layout sends (chatctx.context._abridge); NULL: none.
    abridged: Mapped[list[list[int]] | None] = mapped_column(JSON)


class TurnRow(Base):
    """What one turn cost: tokens and timings as the engine measured them."""

    __tablename__ = "turns"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    user_message_id: Mapped[int | None] = mapped_column(
        ForeignKey("messages.id", ondelete="SET NULL")
    )
    assistant_message_id: Mapped[int | None] = mapped_column(
        ForeignKey("messages.id", ondelete="SET NULL")
    )
    model: Mapped[str | None] = mapped_column(String(500))
    seq_id: Mapped[int] = mapped_column(Integer, default=0)
    n_ctx: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    reused_tokens: Mapped[int] = mapped_column(Integer)
    evaluated_tokens: Mapped[int] = mapped_column(Integer)
    generated_tokens: Mapped[int] = mapped_column(Integer)
    prefill_ms: Mapped[float] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    decode_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float] = mapped_column(Float)
    stop_reason: Mapped[str] = mapped_column(String(20))
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # KV-cache events (the monitor)
    new_tokens: Mapped[int | None] = mapped_column(Integer)
    evicted_tokens: Mapped[int | None] = mapped_column(Integer)
    shifted_tokens: Mapped[int | None] = mapped_column(Integer)
    shift_count: Mapped[int | None] = mapped_column(Integer)
    eviction_policy: Mapped[str | None] = mapped_column(String(20))
    kv_fallback: Mapped[str | None] = mapped_column(String(200))
    cells_used: Mapped[dict[str, int] | None] = mapped_column(JSON)
    summary_tokens: Mapped[int | None] = mapped_column(Integer)
    summary_ms: Mapped[float | None] = mapped_column(Float)
    # request timing (TTFT counts from the request), recall, memory
    build_ms: Mapped[float | None] = mapped_column(Float)
    store_ms: Mapped[float | None] = mapped_column(Float)
    engine_ttft_ms: Mapped[float | None] = mapped_column(Float)
    recall_tokens: Mapped[int | None] = mapped_column(Integer)
    recall_ms: Mapped[float | None] = mapped_column(Float)
    rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    gpu_used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    gpu_free_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # the slot pool: where the turn ran, how its KV state came back, how wide decoding was
    slot: Mapped[int | None] = mapped_column(Integer)
    queue_ms: Mapped[float | None] = mapped_column(Float)
    swap_in: Mapped[str | None] = mapped_column(String(10))
    swap_in_ms: Mapped[float | None] = mapped_column(Float)
    swap_in_bytes: Mapped[int | None] = mapped_column(BigInteger)
    reprefill_reason: Mapped[str | None] = mapped_column(Text)
    batch_max: Mapped[int | None] = mapped_column(Integer)
    backend: Mapped[str | None] = mapped_column(String(255))  # where several serve: which
    # an agent's turn: calls the reply made, tool-result tokens the prompt held and cleared
    tool_calls: Mapped[int | None] = mapped_column(Integer)
    tool_result_tokens: Mapped[int | None] = mapped_column(Integer)
    tool_cleared_tokens: Mapped[int | None] = mapped_column(Integer)
    tool_warning: Mapped[str | None] = mapped_column(Text)  # a call kept as text, and why
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class MessageTokensRow(Base):
    """Tokens one message adds to a prompt, per tokenizer+template fingerprint."""

    __tablename__ = "message_tokens"

    message_id: Mapped[int] = mapped_column(
        ForeignKey("messages.id", ondelete="CASCADE"), primary_key=True
    )
    tokenizer: Mapped[str] = mapped_column(String(100), primary_key=True)
    tokens: Mapped[int] = mapped_column(Integer)


class ContextStateRow(Base):
    """Where the sent window starts and which summary precedes it."""

    __tablename__ = "context_states"

    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    window_start: Mapped[int] = mapped_column(Integer, default=0)
    summary_id: Mapped[int | None] = mapped_column(ForeignKey("summaries.id", ondelete="SET NULL"))
    pending_ids: Mapped[list[int]] = mapped_column(JSON, default=list)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    # One more on every save: a compare-and-set save checks it (no lost updates).
    version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Tool results in the window sent as a stub, cleared to save room (ids); NULL: none.
    cleared_ids: Mapped[list[int] | None] = mapped_column(JSON)


class MessageEmbeddingRow(Base):
    """A message's sentence vectors for recall by meaning, per embedder fingerprint.

    ``vectors`` is a C-order float32 matrix, ``dim`` columns wide: the whole text first, then
    each sentence when it has several. ``text_sha256`` is the digest of the text embedded, so
    a message whose content changed since (a finished streamed reply) is embedded again.
    """

    __tablename__ = "message_embeddings"

    message_id: Mapped[int] = mapped_column(
        ForeignKey("messages.id", ondelete="CASCADE"), primary_key=True
    )
    embedder: Mapped[str] = mapped_column(String(200), primary_key=True)
    text_sha256: Mapped[str] = mapped_column(String(64))
    dim: Mapped[int] = mapped_column(Integer)
    vectors: Mapped[bytes] = mapped_column(LargeBinary)


class PlacementRow(Base):
    """Which backend holds a conversation's cache, where a router spreads them over several.

    Every bot process and machine reads the same row, so a conversation's turns all go to
    one backend. ``moved_from``/``move_reason`` say why it last moved (failover, drain).
    No foreign key: a router may place a conversation before its first message is stored;
    ``Store.delete_conversation`` removes the row with the conversation.
    """

    __tablename__ = "placements"

    conversation_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    backend: Mapped[str] = mapped_column(String(255), index=True)
    placed_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    moves: Mapped[int] = mapped_column(Integer, default=0)
    moved_from: Mapped[str | None] = mapped_column(String(255))
    move_reason: Mapped[str | None] = mapped_column(Text)


class TurnClaimRow(Base):
    """Which process is taking a turn of a conversation now, until when.

    Several processes on one database (``chatctx serve``, bot workers running ``ChatSession``)
    take one conversation's turns one at a time: a turn claims the row, renews it while it
    runs and deletes it when done. A process that died leaves a claim that ends at
    ``expires_at`` (or sooner, taken over by a process that sees it gone). No foreign key: a
    turn claims its conversation before it stores anything (the first turn creates it).
    """

    __tablename__ = "turn_claims"

    conversation_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ResponseRow(Base):
    """One ``/v1/responses`` answer: the messages ``[start, end)`` of its conversation.

    ``start`` is where its input begins, ``output_start`` where its output begins. A branch
    (a response continuing one that is not its conversation's last) is a conversation of its
    own, made from the earlier one's first messages: ``parent_id``'s conversation up to the
    previous response's ``end``. The id is stored under the tenant's prefix, like
    conversations'.
    """

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    previous_response_id: Mapped[str | None] = mapped_column(String(200))
    start: Mapped[int] = mapped_column(Integer)
    output_start: Mapped[int] = mapped_column(Integer)
    end: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(20))
    # The response object as it was answered (output items, usage, echoed request fields).
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
