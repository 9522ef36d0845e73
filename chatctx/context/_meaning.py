"""Recall by meaning: evicted messages ranked by how close they are to the new one.

A question rarely repeats the words of the fact it asks about ("what can't I eat?" for "I
can't have gluten"), so full-text search alone misses most of them. ``MeaningSearch``
embeds the new message and the conversation's earlier messages with a sentence embedder
(``chatctx.backends.engine.Embedder``) and ranks the earlier ones by cosine similarity. A chat
message often says several things ("first I'll call the landlord. the van needs an oil
change before the drive"), so each sentence is embedded too and a message scores as its
closest part. A message below ``min_similarity`` is not a match.

Two priors then order the matches. A question states nothing, so a sentence that asks scores
``question_discount`` lower: "what do you like to cook?" is close to "what do I like to
cook, again?" but no answer to it. And what the user asks back is mostly what the user said, so the
other side's messages score ``reply_discount`` lower (a much closer reply still wins).

It is a ``RecallSearch``: the builder uses it exactly as it uses the store's full-text search,
and ``snippet`` picks the sentences worth sending when a whole message does not fit.

Given a ``vectors`` store (``Store.get_embeddings`` / ``put_embeddings``) and the embedder's
fingerprint, a message's vectors are read from the database and only messages without them
(or whose text changed since) are embedded, and those vectors are stored: a restarted
process, or another one, does not embed the history again.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from chatctx.context._facts import replaced, value_keys
from chatctx.context._recall import QUESTION_MARKS, sentences
from chatctx.errors import StoreError
from chatctx.settings import ContextSettings
from chatctx.store import Message
from chatctx.store.search import query_terms

logger = logging.getLogger("chatctx.context")

# Cosine similarity below which an earlier message is not taken as an answer (the setting's
# default). Chosen on the development probe sets (bench/README.md, "Recall by meaning").
MIN_SIMILARITY: float = ContextSettings.model_fields["recall_min_similarity"].default
# The priors, in cosine: small beside the spread between a match and chat (0.15 to 0.6).
QUESTION_DISCOUNT = 0.1
REPLY_DISCOUNT = 0.05
_ASKS = re.compile(f"[{re.escape(''.join(sorted(QUESTION_MARKS)))}]\\W*$")  # ends asking
# all-MiniLM-L6-v2's mean cosine of unrelated chat lines: the scale the settings' similarities
# are in. Another embedder's cosines are mapped onto it (``unrelated``).
REFERENCE_UNRELATED = 0.094
# Matched by words too (``words``): up to this much is added to a message's score, in
# proportion to its word-search score over the best one's. Words hold in any language the
# store's index splits (word pieces of Korean, Chinese, Japanese; Porter stems), and a
# question often shares one with its answer ("플랜" / "멀티캣 듀오 플랜") when their sentences
# are far apart in meaning.
WORDS_BONUS = 0.1
WORD_HITS = 10  # word matches looked at per search

Embed = Callable[[Sequence[str]], npt.NDArray[np.float32]]
Words = Callable[[str, int, int], Sequence[tuple[Message, float]]]
Vectors = npt.NDArray[np.float32]


class VectorStore(Protocol):
    """Where messages' vectors are kept (``chatctx.store.Store`` is one)."""

    def get_embeddings(
        self, embedder: str, ids: Sequence[int]
    ) -> dict[int, tuple[str, int, bytes]]: ...

    def put_embeddings(
        self, embedder: str, vectors: Mapping[int, tuple[str, int, bytes]]
    ) -> None: ...


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class MeaningSearch:
    """Finds a conversation's earlier messages closest in meaning to a query.

    ``messages`` lists the conversation's messages (the store's ``messages``), ``embed``
    gives unit-length vectors for texts (cached by the embedder, so each text is embedded
    once). Results are (message, cosine) best first; a matched user message is followed by
    the assistant reply right after it, with the same score, as ``Store.search_messages(...,
    replies=True)`` lists them.
    """

    by_meaning = True  # scores are cosine similarities (ContextSettings.recall_near_similarity)

    def __init__(
        self,
        messages: Callable[[], Sequence[Message]],
        embed: Embed,
        *,
        min_similarity: float = MIN_SIMILARITY,
        question_discount: float = QUESTION_DISCOUNT,
        reply_discount: float = REPLY_DISCOUNT,
        prefetch: Callable[[Sequence[str]], None] | None = None,
        vectors: VectorStore | None = None,
        fingerprint: str | None = None,
        unrelated: float | None = None,
        words: Words | None = None,
        words_bonus: float = WORDS_BONUS,
    ) -> None:
        self._messages = messages
        self._unrelated = unrelated
        self._words = words
        self.words_bonus = words_bonus
        self._typical = ("", unrelated or 0.0)  # (query, its conversation's median cosine)
        self._embed = embed
        self._prefetch = prefetch
        self._store = vectors if fingerprint else None
        self._fingerprint = fingerprint or ""
        # message id -> (text digest, its parts' vectors): read from the store or embedded.
        self._known: dict[int, tuple[str, Vectors]] = {}
        self._caught_up = False  # every stored message was handed to ``warm`` once
        # The values the last search found given anew, by the text that gives them.
        self._anew: dict[str, set[str]] = {}
        # message id -> (its text, the keys of its small values): ``_value_keys``.
        self._keys: dict[int, tuple[str, frozenset[tuple[str, str]]]] = {}
        self.min_similarity = min_similarity
        self.question_discount = question_discount
        self.reply_discount = reply_discount

    def _scale(self, similarity: Vectors, query: str) -> Vectors:
        """Cosines on all-MiniLM-L6-v2's scale. An embedder whose cosines crowd near 1 (its
        ``unrelated`` is given: e5's average 0.8) is mapped linearly so that the typical
        message of this conversation (the median cosine of the query's candidates, at least
        ``unrelated``) scores ``REFERENCE_UNRELATED`` and identical text stays 1: a match is
        as close as it stands out from the conversation it is in, in any language."""
        if self._unrelated is None:
            return similarity
        if len(similarity) >= 3:  # a conversation to measure against; else the last one
            self._typical = (query, max(self._unrelated, float(np.median(similarity))))
        typical = self._typical[1] if self._typical[0] == query else self._unrelated
        slope = (1 - REFERENCE_UNRELATED) / (1 - typical)
        return (REFERENCE_UNRELATED + (similarity - typical) * slope).astype(np.float32)

    def warm(self, texts: Sequence[str]) -> None:
        """Have ``texts`` embedded ahead of a search (in the background, with ``prefetch``),
        so the turn that asks does not wait for them."""
        if self._prefetch is not None:
            self._prefetch([part for text in texts for part in _parts(text)])

    def warm_messages(self, messages: Sequence[Message]) -> None:
        """``warm`` for the messages whose vectors are not stored (all without a store)."""
        self._load(messages)
        self.warm([m.content for m in messages if not self._has(m)])

    def warm_turn(self, texts: Sequence[str]) -> None:
        """``warm`` for a turn's new messages, once recall is within reach (the caller
        decides when): the first time, with every stored message not embedded yet."""
        if self._caught_up:
            self.warm(texts)
            return
        self._caught_up = True
        self.warm_messages(self._messages())

    def _has(self, message: Message) -> bool:
        known = self._known.get(message.id)
        return known is not None and known[0] == text_digest(message.content)

    def _load(self, messages: Sequence[Message]) -> None:
        """Read the stored vectors of the messages not known yet."""
        if self._store is None:
            return
        wanted = [m.id for m in messages if m.id not in self._known]
        if not wanted:
            return
        try:
            stored = self._store.get_embeddings(self._fingerprint, wanted)
        except StoreError as exc:  # a cache: recall goes on, embedding what it needs
            logger.warning("stored vectors not read: %s", exc)
            return
        for message_id, (digest, dim, data) in stored.items():
            matrix = np.frombuffer(data, dtype="<f4")
            if dim <= 0 or matrix.size % dim:
                continue  # not written by this code: embedded again
            self._known[message_id] = (digest, matrix.reshape(-1, dim).astype(np.float32))

    def _vectors(self, messages: Sequence[Message]) -> list[Vectors]:
        """Each message's parts' vectors: known ones as they are, the rest embedded in one
        call (and stored)."""
        self._load(messages)
        parts_of = [_parts(m.content) for m in messages]
        # A stored matrix with another number of rows was split by other code: embed again.
        missing, parts = [], []
        for message, message_parts in zip(messages, parts_of, strict=True):
            if not self._has(message) or len(self._known[message.id][1]) != len(message_parts):
                missing.append(message)
                parts.append(message_parts)
        if missing:
            embedded = self._embed([p for message_parts in parts for p in message_parts])
            new: dict[int, tuple[str, int, bytes]] = {}
            start = 0
            for message, message_parts in zip(missing, parts, strict=True):
                matrix = np.ascontiguousarray(
                    embedded[start : start + len(message_parts)], dtype=np.float32
                )
                start += len(message_parts)
                digest = text_digest(message.content)
                self._known[message.id] = (digest, matrix)
                new[message.id] = (digest, int(matrix.shape[1]), matrix.astype("<f4").tobytes())
            if self._store is not None:
                try:
                    self._store.put_embeddings(self._fingerprint, new)
                except StoreError as exc:
                    logger.warning("vectors of %d messages not stored: %s", len(new), exc)
        return [self._known[m.id][1] for m in messages]

    def _scores(self, messages: Sequence[Message], query: str) -> npt.NDArray[np.float32]:
        """Each message's score for ``query``: the best of the message and its sentences,
        their cosine less the priors' discounts."""
        owner: list[int] = []
        discount: list[float] = []
        for i, message in enumerate(messages):
            other = self.reply_discount if message.role != "user" else 0.0
            for part in _parts(message.content):
                owner.append(i)
                discount.append(other + (self.question_discount if _ASKS.search(part) else 0.0))
        vectors = np.concatenate(self._vectors(messages))
        raw = vectors @ self._embed([query])[0]
        if self._unrelated is not None:
            raw = raw - _hubness(vectors)
        similarity = self._scale(raw, query)
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
        self._add_words(similarity, candidates, query, before_position)
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
        out, self._anew = _with_later_values(out, candidates, self._value_keys)
        return out

    def _value_keys(self, message: Message) -> frozenset[tuple[str, str]]:
        """The keys of ``message``'s small values (``value_keys``), cached by message."""
        cached = self._keys.get(message.id)
        if cached is None or cached[0] != message.content:
            cached = (message.content, frozenset(value_keys(message.content)))
            self._keys[message.id] = cached
        return cached[1]

    def _add_words(
        self, similarity: Vectors, candidates: Sequence[Message], query: str, before: int
    ) -> None:
        """Raise the scores of the messages the word search finds (``words_bonus`` for the
        best of them, less for the others, by their word scores)."""
        if self._words is None or self.words_bonus <= 0:
            return
        try:
            found = [(m, score) for m, score in self._words(query, before, WORD_HITS) if score > 0]
        except StoreError as exc:  # meaning alone still ranks
            logger.warning("word search failed, ranking by meaning alone: %s", exc)
            return
        if not found:
            return
        best = max(score for _, score in found)
        index = {m.id: i for i, m in enumerate(candidates)}
        for message, score in found:
            if message.id in index:
                similarity[index[message.id]] += self.words_bonus * score / best

    def snippet(self, text: str, query: str) -> list[tuple[int, str]]:
        """The sentences of ``text`` at least ``min_similarity`` close to ``query`` in
        meaning, best first: what to send when the whole message does not fit. Ranked as
        messages are: the cosine, less ``question_discount`` for a sentence that asks (it
        states nothing), plus up to ``words_bonus`` for the query's words it shares (word
        pieces in unspaced scripts: "택배사" and "롯데택배로" share "택배" where an English
        embedder's cosines are noise); shared words reorder the close sentences, never make
        one close (a common word, "someone", would send a sentence alone in place of its
        whole message). A sentence that gives anew a value the last search found
        (``_with_later_values``) comes first."""
        parts = sentences(text)
        if not parts:
            return []
        similarity = self._scale(
            self._embed([s for _, s in parts]) @ self._embed([query])[0], query
        )
        score = similarity - np.asarray(
            [self.question_discount if _ASKS.search(s) else 0.0 for _, s in parts],
            dtype=np.float32,
        )
        terms = set(query_terms(query))
        shared = np.asarray([len(terms.intersection(query_terms(s))) for _, s in parts])
        if self.words_bonus > 0 and shared.max(initial=0) > 0:
            score += (self.words_bonus * shared / shared.max()).astype(np.float32)
        close = [
            (float(rank), part)
            for rank, near, part in zip(score, similarity, parts, strict=True)
            if near >= self.min_similarity
        ]
        ranked = [part for _, part in sorted(close, key=lambda x: -x[0])]
        # A sentence giving anew a value the last search found comes first, however close.
        anew = self._anew.get(text, set())
        first = [part for part in parts if any(_holds(part[1], value) for value in anew)]
        return first + [part for part in ranked if part not in first]


LATER_VALUES = 2  # messages that give a found message's values anew, listed after it


def _with_later_values(
    found: list[tuple[Message, float]],
    candidates: Sequence[Message],
    keys: Callable[[Message], frozenset[tuple[str, str]]],
) -> tuple[list[tuple[Message, float]], dict[str, set[str]]]:
    """``found`` with, right after each message holding a small value (after its reply),
    the latest later messages that give that value anew (``replaced``: "매달 7일" then
    "매달 22일"), at its score, moved up when listed lower (with their replies): whatever
    recalls the old value recalls the new one after it, so the latest wins. Also the new
    values, by the text of the message giving them. ``keys`` gives a message's value keys
    (``value_keys``, cached by the caller); only messages sharing one are compared, latest
    first, so a search costs about the same in a long chat full of values."""
    anew: dict[str, set[str]] = {}
    by_key: dict[tuple[str, str], list[Message]] = {}  # in position order
    for m in candidates:
        for key in keys(m):
            by_key.setdefault(key, []).append(m)
    if not found or not by_key:
        return found, anew
    by_position = {m.position: m for m in candidates}
    listed = {m.id for m, _ in found}
    moved: set[int] = set()  # listed after the message whose value they give anew
    placed: set[int] = set()  # in ``out`` or ``pending``
    out: list[tuple[Message, float]] = []
    pending: list[tuple[Message, float]] = []  # to list once the found message's reply is
    for message, score in found:
        if message.id in moved:
            continue
        last = out[-1][0] if out else None
        is_reply = (
            last is not None
            and message.role == "assistant"
            and last.role == "user"
            and message.position == last.position + 1
        )
        if not is_reply:
            out += pending
            pending = []
        out.append((message, score))
        placed.add(message.id)
        for newer, pairs in _latest_changes(message, by_key, keys, moved):
            if newer.id in placed:
                continue  # listed already, higher
            anew.setdefault(newer.content, set()).update(new for _, new in pairs)
            for m in _exchange(newer, by_position, listed):
                if m.id not in placed:
                    moved.add(m.id)
                    placed.add(m.id)
                    pending.append((m, score))
    out += pending
    return out, anew


def _exchange(
    message: Message, by_position: Mapping[int, Message], listed: set[int]
) -> list[Message]:
    """``message`` with the other half of its exchange where that is listed too: a user
    message and the reply right after it, a reply and the question right before it."""
    if message.role == "user":
        reply = by_position.get(message.position + 1)
        if reply is not None and reply.role == "assistant" and reply.id in listed:
            return [message, reply]
    elif message.role == "assistant":
        question = by_position.get(message.position - 1)
        if question is not None and question.role == "user" and question.id in listed:
            return [question, message]
    return [message]


def _latest_changes(
    message: Message,
    by_key: Mapping[tuple[str, str], Sequence[Message]],
    keys: Callable[[Message], frozenset[tuple[str, str]]],
    moved: set[int],
) -> list[tuple[Message, list[tuple[str, str]]]]:
    """The last ``LATER_VALUES`` messages after ``message`` that give one of its values
    anew, with the (old, new) pairs, in order."""
    later: dict[int, Message] = {}
    for key in keys(message):
        bucket = by_key.get(key, ())
        start = bisect.bisect_right(bucket, message.position, key=lambda m: m.position)
        for m in bucket[start:][-(LATER_VALUES + 2) :]:  # a few spare: some may not count
            if m.id not in moved:
                later[m.id] = m
    changes: list[tuple[Message, list[tuple[str, str]]]] = []
    for m in sorted(later.values(), key=lambda m: -m.position):
        pairs = replaced(message.content, m.content)
        if pairs:
            changes.append((m, pairs))
            if len(changes) == LATER_VALUES:
                break
    return changes[::-1]


def _holds(text: str, value: str) -> bool:
    """Whether ``text`` says ``value`` as a value: not inside a longer number ("8시" is not
    in "18시")."""
    end = r"(?!\d)" if value[-1:].isdigit() else ""
    return re.search(r"(?<!\d)" + re.escape(value) + end, text) is not None


HUB_NEIGHBOURS = 10
HUB_SAMPLE = 512  # vectors each is compared with: the cost stays linear in a long chat


def _hubness(vectors: Vectors) -> Vectors:
    """How much closer than usual each vector is to its conversation: the mean cosine to its
    ``HUB_NEIGHBOURS`` nearest others (among ``HUB_SAMPLE`` spread over the conversation),
    less the median of that over all of them. A short generic line ("thank you, let me
    check") sits close to everything an embedder whose cosines crowd near 1 compares it
    with, and would top every search; less this, a match is as close as it is to the query
    beyond what it is to anything (CSLS, Lample et al. 2018)."""
    n = len(vectors)
    if n <= HUB_NEIGHBOURS:
        return np.zeros(n, dtype=np.float32)
    sample = np.linspace(0, n - 1, min(n, HUB_SAMPLE)).astype(int)
    similarity = vectors @ vectors[sample].T
    similarity[sample, np.arange(len(sample))] = -2.0  # not itself
    k = min(HUB_NEIGHBOURS, len(sample) - 1)
    nearest = np.partition(similarity, len(sample) - k, axis=1)[:, len(sample) - k :]
    closeness: Vectors = nearest.mean(axis=1).astype(np.float32)
    return closeness - np.float32(np.median(closeness))


def _parts(text: str) -> list[str]:
    """What is embedded of a message: the whole text, and each sentence when it has several."""
    pieces = [s for _, s in sentences(text)]
    return [text, *pieces] if len(pieces) > 1 else [text]
