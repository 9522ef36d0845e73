"""What one turn asks of the store: its reads in one transaction, few transactions in all.

The oracle is SQLAlchemy's own event stream: each transaction begun on the engine and the
SQL sent in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event

from chatctx import ChatSession
from chatctx.model.codec import open_codec
from chatctx.replay import DryBackend
from chatctx.store import Store


def test_a_turn_reads_its_context_in_one_transaction(
    tiny_llama3_path: Path, tmp_path: Path
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'chat.db'}")
    transactions: list[list[str]] = []
    watching = False

    def begun(*_: Any) -> None:
        if watching:
            transactions.append([])

    def sent(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if watching and transactions:
            transactions[-1].append(" ".join(statement.split()))

    event.listen(store.engine, "begin", begun)
    event.listen(store.engine, "before_cursor_execute", sent)
    codec = open_codec(tiny_llama3_path)
    with DryBackend(codec, n_ctx=1024, model_path=tiny_llama3_path) as backend, store:
        chat = ChatSession.open(store, model=backend, system_prompt="Be brief.")
        chat.send("My order 4521 has not arrived.")
        chat.store.set_pinned(chat.last_user.id)
        chat.send("It was due on Tuesday.")
        watching = True
        chat.send("Can you check the tracking?")
        watching = False
        chat.close()
    reads = [t for t in transactions if any("FROM context_states" in s for s in t)]
    assert len(reads) == 1, transactions  # read once, in one view of the database
    (read,) = reads
    assert any(s.startswith("SELECT") and "FROM conversations" in s for s in read)
    assert sum("FROM messages" in s and "ORDER BY messages.position" in s for s in read) == 2
    assert all(s.startswith(("SELECT", "BEGIN")) for s in read)
    # The claim and its release, that read, the token counts looked up and saved, the user
    # message, the reply with its turn record: 7 (there were 10 before the reads were one).
    assert len(transactions) <= 7, transactions
