"""Recall by meaning: evicted messages ranked by how close they are to the new one.

A question rarely repeats the words of the fact it asks about ("what can't I eat?" for "I'm
allergic to shellfish"), so full-text search alone misses most of them. ``MeaningSearch``
embeds the new message and the conversation's earlier messages with a sentence embedder
(``chatctx.engine.Embedder``) and ranks the earlier ones by cosine similarity. A chat message
often says several things ("step one would be to listen. the jeep needs new tires before the
trip"), so each sentence is embedded too and a message scores as its closest part. A message
below ``min_similarity`` is not a match.

Two priors then order the matches. A question states nothing, so a sentence that asks scores
``question_discount`` lower: "what do you do for fun?" is close to "what do I do for fun
again?" but no answer to it. And what the user asks back is mostly what the user said, so the
other side's messages score ``reply_discount`` lower (a much closer reply still wins).

It is a ``RecallSearch``: the builder uses it exactly as it uses the store's full-text search,
and ``snippet`` picks the sentences worth sending when a whole message does not fit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from chatctx.config import ContextSettings
from chatctx.context._recall import sentences
from chatctx.store import Message

# Cosine similarity below which an earlier message is not taken as an answer (the setting's
# default). Chosen on the development probe sets (bench/README.md, "Recall by meaning").
MIN_SIMILARITY: float = ContextSettings.model_fields["recall_min_similarity"].default
# The priors, in cosine: small beside the spread between a match and chat (0.15 to 0.6).
QUESTION_DISCOUNT = 0.1
REPLY_DISCOUNT = 0.05
_ASKS = re.compile(r"\?\W*$")

Embed = Callable[[Sequence[str]], npt.NDArray[np.float32]]


class MeaningSearch:
    """Finds a conversation's earlier messages closest in meaning to a query.

    ``messages`` lists the conversation's messages (the store's ``messages``), ``embed``
    gives unit-length vectors for texts (cached by the embedder, so each text is embedded
    once). Results are (message, cosine) best first; a matched user message is followed by
    the assistant reply right after it, with the same score, as ``Store.search_messages(...,
    replies=True)`` lists them.
    """

    def __init__(
        self,
        messages: Callable[[], Sequence[Message]],
        embed: Embed,
        *,
        min_similarity: float = MIN_SIMILARITY,
        question_discount: float = QUESTION_DISCOUNT,
        reply_discount: float = REPLY_DISCOUNT,
        prefetch: Callable[[Sequence[str]], None] | None = None,
    ) -> None:
        self._messages = messages
        self._embed = embed
        self._prefetch = prefetch
        self.min_similarity = min_similarity
        self.question_discount = question_discount
        self.reply_discount = reply_discount

    def warm(self, texts: Sequence[str]) -> None:
        """Have ``texts`` embedded ahead of a search (in the background, with ``prefetch``),
        so the turn that asks does not wait for them."""
        if self._prefetch is not None:
            self._prefetch([part for text in texts for part in _parts(text)])

    def _scores(self, messages: Sequence[Message], query: str) -> npt.NDArray[np.float32]:
        """Each message's score for ``query``: the best of the message and its sentences,
        their cosine less the priors' discounts."""
        parts: list[str] = []
        owner: list[int] = []
        discount: list[float] = []
        for i, message in enumerate(messages):
            other = self.reply_discount if message.role != "user" else 0.0
            for part in _parts(message.content):
                parts.append(part)
                owner.append(i)
                discount.append(other + (self.question_discount if _ASKS.search(part) else 0.0))
        similarity = self._embed(parts) @ self._embed([query])[0]
        similarity -= np.asarray(discount, dtype=np.float32)
        best = np.full(len(messages), -2.0, dtype=np.float32)
        np.maximum.at(best, np.asarray(owner), similarity)
        return best

    def __call__(self, query: str, before_position: int, limit: int) -> list[tuple[Message, float]]:
        if limit <= 0 or not query.strip():
            return []
        earlier = [m for m in self._messages() if m.position < before_position]
        candidates = [m for m in earlier if m.content.strip()]
        if not candidates:
            return []
        similarity = self._scores(candidates, query)
        # Best first; ties go to the later message (what was said last is more likely true).
        order = np.lexsort((-np.array([m.position for m in candidates]), -similarity))
        by_position = {m.position: m for m in earlier}
        out: list[tuple[Message, float]] = []
        listed: set[int] = set()
        hits = 0
        for index in order:
            score = float(similarity[index])
            if score < self.min_similarity or hits == limit:
                break
            message = candidates[index]
            if message.id in listed:  # listed already as the reply to a better match
                continue
            hits += 1
            out.append((message, score))
            listed.add(message.id)
            reply = by_position.get(message.position + 1)
            if (
                message.role == "user"
                and reply is not None
                and reply.role == "assistant"
                and reply.id not in listed
            ):
                out.append((reply, score))
                listed.add(reply.id)
        return out

    def snippet(self, text: str, query: str) -> list[tuple[int, str]]:
        """The sentences of ``text`` closest in meaning to ``query``, best first (those at
        least ``min_similarity``): what to send when the whole message does not fit."""
        parts = sentences(text)
        if not parts:
            return []
        similarity = self._embed([s for _, s in parts]) @ self._embed([query])[0]
        ranked = sorted(zip(similarity.tolist(), parts, strict=True), key=lambda x: -x[0])
        return [part for score, part in ranked if score >= self.min_similarity]


def _parts(text: str) -> list[str]:
    """What is embedded of a message: the whole text, and each sentence when it has several."""
    pieces = [s for _, s in sentences(text)]
    return [text, *pieces] if len(pieces) > 1 else [text]
