"""The conversation store (SQLAlchemy; SQLite by default; Alembic migrations)."""

from chatctx.store._connect import create_db_engine
from chatctx.store._db import Store
from chatctx.store._jsonl import (
    ConversationRecord,
    export_conversation,
    export_jsonl,
    import_records,
    parse_line,
    read_jsonl,
)
from chatctx.store._migrate import current_revision, head_revision, migrations_dir, upgrade
from chatctx.store._placements import Placement
from chatctx.store._records import (
    ROLES,
    Conversation,
    Message,
    StoredContextState,
    Summary,
    Turn,
)

__all__ = [
    "ROLES",
    "Conversation",
    "ConversationRecord",
    "Message",
    "Placement",
    "Store",
    "StoredContextState",
    "Summary",
    "Turn",
    "create_db_engine",
    "current_revision",
    "export_conversation",
    "export_jsonl",
    "head_revision",
    "import_records",
    "migrations_dir",
    "parse_line",
    "read_jsonl",
    "upgrade",
]
