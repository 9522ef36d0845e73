"""Vectors for recall by meaning are stored with the messages: a restarted process embeds only
what is new.

Oracles: what the real embedder (all-MiniLM-L6-v2) was asked, counted by a wrapper around it;
the ``message_embeddings`` rows read with SQL; the vectors compared with a fresh embedding.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from sqlalchemy import text

from chatctx import ChatSession
from chatctx.backends.engine._embedder import Embedder, shared_embedder
from chatctx.model.codec import open_codec
from chatctx.replay import DryBackend
from chatctx.store import Store

# No summary: an extractive one would hold the fact word for word, and recall leaves out
# what the prompt already says.
CONTEXT = {
    "budget": 160,
    "summarizer": "none",
    "recall_search": "meaning",
    "recall_trigger": "always",
}
FACT = "my locker number is 4412 and it is in the east wing"
QUESTION = "where do I keep my gym things?"


class CountingEmbedder:
    """The real embedder, with every text it is asked for (to embed or to prefetch) listed."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.asked: list[str] = []

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.asked += texts
        return self.inner.embed(texts)

    def prefetch(self, texts: Sequence[str]) -> None:
        self.asked += texts
        self.inner.prefetch(texts)


def _chat(store: Store, backend: DryBackend, embedder: CountingEmbedder) -> ChatSession:
    return ChatSession.open(
        store,
        conversation_id="c",
        model=backend,
        embedder=embedder,
        settings={"max_tokens": 16},
        context=CONTEXT,
    )


def _stored(store: Store) -> dict[int, tuple[str, int, bytes]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT message_id, embedder, dim, vectors FROM message_embeddings")
        )
        return {r[0]: (r[1], r[2], bytes(r[3])) for r in rows}


def test_a_restarted_process_embeds_none_of_the_stored_messages(
    db_url: str, tiny_llama3_path: Path, embedder_path: Path
) -> None:
    inner = shared_embedder(embedder_path)
    codec = open_codec(tiny_llama3_path)
    first = CountingEmbedder(inner)
    with (
        Store(db_url) as store,
        DryBackend(codec, n_ctx=512, model_path=tiny_llama3_path) as backend,
        _chat(store, backend, first) as chat,
    ):
        chat.record_turn(FACT, "noted")
        for n in range(10):
            chat.record_turn(f"the weather on day {n} was fine and mild", f"fine, day {n}")
        chat.record_turn(QUESTION, "in your locker, I think")
        assert store.context_state("c").window_start > 0  # evicted: recall by meaning ran
        history = store.messages("c")
        stored = _stored(store)
    fact = next(m for m in history if m.content == FACT)
    assert fact.id in stored
    assert {fingerprint for fingerprint, _, _ in stored.values()} == {inner.fingerprint}
    # What is stored is what the model gives for the text (the whole text is the first row).
    _, dim, data = stored[fact.id]
    vector = np.frombuffer(data, dtype="<f4").reshape(-1, dim)[0]
    np.testing.assert_allclose(vector, inner.embed([FACT])[0], atol=1e-5)
    stored_texts = {m.content for m in history if m.id in stored}

    # The restart: a new store and session on the same database, a new embedder wrapper.
    second = CountingEmbedder(inner)
    with (
        Store(db_url) as store,
        DryBackend(codec, n_ctx=512, model_path=tiny_llama3_path) as backend,
        _chat(store, backend, second) as chat,
    ):
        reply = chat.record_turn("which wing was my locker in again?", "the east wing")
        recalled = chat.last_build.plan.recalled_ids if chat.last_build else []
        assert reply is not None
    assert fact.id in recalled  # recall by meaning found it, from the stored vectors
    asked_again = [t for t in second.asked if t in stored_texts]
    assert asked_again == []
    assert "which wing was my locker in again?" in second.asked


def test_vectors_go_with_their_message_and_a_changed_text_is_embedded_again(
    db_url: str, embedder_path: Path
) -> None:
    from chatctx.context import MeaningSearch

    inner = shared_embedder(embedder_path)
    with Store(db_url) as store:
        store.create_conversation("c")
        kept, changed = store.add_messages(
            "c",
            [
                {"role": "user", "content": "I am allergic to peanuts"},
                {"role": "assistant", "content": "partial rep", "status": "partial"},
            ],
        )
        store.add_message("c", "user", "next")
        counting = CountingEmbedder(inner)
        search = MeaningSearch(
            lambda: store.messages("c"),
            counting.embed,
            vectors=store,
            fingerprint=counting.fingerprint,
        )
        search("what can't I eat?", before_position=2, limit=2)
        assert set(_stored(store)) == {kept.id, changed.id}
        store.update_message(changed.id, content="the final reply text", status="complete")
        counting.asked.clear()
        again = MeaningSearch(
            lambda: store.messages("c"),
            counting.embed,
            vectors=store,
            fingerprint=counting.fingerprint,
        )
        again("what can't I eat?", before_position=2, limit=2)
        assert counting.asked == ["the final reply text", "what can't I eat?"]
        _, dim, data = _stored(store)[changed.id]
        vector = np.frombuffer(data, dtype="<f4").reshape(-1, dim)[0]
        np.testing.assert_allclose(vector, inner.embed(["the final reply text"])[0], atol=1e-5)
        store.delete_conversation("c")
        assert _stored(store) == {}
