"""The conversation store (SQLAlchemy; SQLite by default; Alembic migrations).

::

    Store             conversations, messages, turns, summaries and context states
    ReplayStore       a Store for replays: one transaction per turn, nothing kept
    TurnClaim         one turn at a time per conversation, across processes and hosts
    jsonl             the JSONL format of conversations (export, import, checks)
    search            the word search over stored messages (FTS5, tsvector)
"""

from chatctx.store._connect import create_db_engine
from chatctx.store._db import Store
from chatctx.store._migrate import current_revision, head_revision, migrations_dir, upgrade
from chatctx.store._placements import Placement
from chatctx.store._records import (
    ROLES,
    ContextInputs,
    Conversation,
    Message,
    StoredContextState,
    Summary,
    Turn,
)
from chatctx.store._replay import ReplayStore
from chatctx.store._responses import StoredResponse
from chatctx.store._turn_claim import CLAIM_TTL_S, TurnClaim, new_owner, try_claim
from chatctx.store.jsonl import (
    ConversationRecord,
    export_conversation,
    export_jsonl,
    import_records,
    parse_line,
    read_jsonl,
)

__all__ = [
    "CLAIM_TTL_S",
    "ROLES",
    "ContextInputs",
    "Conversation",
    "ConversationRecord",
    "Message",
    "Placement",
    "ReplayStore",
    "Store",
    "StoredContextState",
    "StoredResponse",
    "Summary",
    "Turn",
    "TurnClaim",
    "create_db_engine",
    "current_revision",
    "export_conversation",
    "export_jsonl",
    "head_revision",
    "import_records",
    "migrations_dir",
    "new_owner",
    "parse_line",
    "read_jsonl",
    "try_claim",
    "upgrade",
]
