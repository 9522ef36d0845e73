"""The abridge layout: evicted messages stay where they were, cut down to what the summary keeps.

In the append layout every addition to the summary is new text, evaluated once (about 60
tokens an eviction, 0.13 of the new tokens on the final probe set). Here the summary is never
sent as text of its own: each evicted message that said one of its items (or facts) stays in
the prompt, at its place, holding only the sentences that say them. From one prompt to the
next such a message only ever loses text, and a cache that steps over deleted spans (the
llama-server walk, ``n_cache_reuse``) keeps what is left without evaluating it again.

Two things make a cut cheap for such a cache, and ``Cutter`` checks both on the real tokens:

- A cut must be a token subsequence of the message as it was, in runs of at least
  ``min_chunk`` tokens: the walk never steps over a prompt token it cannot find.
- The walk is greedy. The run before a cut message often takes the end-of-turn token, the
  header's first token, even the role along (every message boundary starts alike), and what
  is left of the header must be found with the text that follows it. So a cut keeps the
  message's first few words (what is left of the header and they make one run long enough
  to find), then the sentences worth keeping, each with the space or punctuation in front
  of it that the cache holds it with; else the message's start up to the first sentence
  worth keeping, then the others; else everything up to the last of them; else the whole
  message.

A message once cut only loses text later (a compaction that drops one of its items drops
its sentence, never its start), and only messages this prompt evicts are cut: one evicted
before and folded into the summary late is no longer in the cache, and sending it again
would be text inserted in front of cached runs.

Items are matched to sentences by their words (the summarizer's items are clauses of the
message, tidied); each item and fact is taken by the first sentence that says it, so a
longer history only adds cuts at its end. What is kept is bounded by the summary's own
limit (times ``CUT_ROOM``): past it, the cuts worth least per token are left out.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chatctx.context._facts import identifiers, sentence_spans
from chatctx.context.summarizers import parse_summary
from chatctx.model.kv import plan_in_order
from chatctx.store import Message

# A word in any script: letters and digits (Korean "배송은", Japanese and Chinese runs written
# without spaces, "mañana" whole); an item matches the sentence holding all its words.
_WORD = re.compile(r"[^\W_]+")
_WORD_RUN = re.compile(r"\S+")
_APOSTROPHES = str.maketrans({"\u2019": "", "\u2018": "", "'": ""})
Span = tuple[int, int]  # (start, end) of message content
# The cut messages may take this times the summary's limit (and at most 60% of the budget,
# as the summary): whole sentences, from a message's start, say less per token than the
# summary's clauses. On 20 chats of the final probe set at 1,024, a limit of 1.0 lost 2 of
# 60 facts that 1.5 kept (bench/README.md).
CUT_ROOM = 1.5


@dataclass(frozen=True, slots=True)
class Cut:
    """What of one evicted message is sent: ``spans`` (start, end) of its content, in order;
    ``value`` the items and facts it says."""

    message_id: int
    spans: tuple[tuple[int, int], ...]
    value: int = 1

    def text(self, content: str) -> str:
        return _text(content, self.spans)

    def to_row(self) -> list[int]:
        return [self.message_id, self.value, *(x for span in self.spans for x in span)]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> Cut:
        message_id, value, *flat = (int(x) for x in row)
        spans = tuple((flat[i], flat[i + 1]) for i in range(0, len(flat) - 1, 2))
        return cls(message_id, spans, value)


def _text(content: str, spans: Sequence[Span]) -> str:
    return "".join(content[start:end] for start, end in spans).strip()


def _openings(content: str, at: int, most: int = 8) -> list[int]:
    """Ends of the message's first words (at most ``most``), before ``at``: a cut may keep
    only that much of the message's start before its first kept sentence."""
    return [m.end() for m in itertools.islice(_WORD_RUN.finditer(content, 0, at), most)]


def _words(text: str) -> frozenset[str]:
    return frozenset(_WORD.findall(text.casefold().translate(_APOSTROPHES)))


def summary_items(summary: str) -> tuple[list[frozenset[str]], list[str]]:
    """The word sets of an extractive summary's items, and its facts (identifiers)."""
    facts, items = parse_summary(summary)
    return [w for w in (_words(text) for _, text in items) if w], facts


class Cutter:
    """Checks cuts against a cache walk of ``min_chunk`` on the codec's own tokens.

    ``tokens(role, content)`` is what a message adds to a prompt (the builder's render).
    """

    def __init__(self, tokens: Callable[[str, str], list[int]], min_chunk: int) -> None:
        self._tokens = tokens
        self.min_chunk = min_chunk
        self._headers: dict[str, int] = {}
        # The last whole message's tokens: ``_cut`` checks up to 16 cuts of one message.
        self._whole: tuple[str, str, list[int]] = ("", "", [])

    def _header(self, role: str) -> int:
        """Tokens in front of a message's content (its role header)."""
        if role not in self._headers:
            a, b = self._tokens(role, "a"), self._tokens(role, "0")
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            self._headers[role] = n
        return self._headers[role]

    def keeps(self, role: str, content: str, cut: str) -> bool:
        """Whether a cache holding the whole message keeps all of the cut message."""
        if self._whole[:2] != (role, content):
            self._whole = (role, content, self._tokens(role, content))
        whole, part = self._whole[2], self._tokens(role, cut)
        same_end = 0  # the closing tokens are found with the next message's header
        while same_end < min(len(whole), len(part)) and whole[-1 - same_end] == part[-1 - same_end]:
            same_end += 1
        core = part[: len(part) - same_end]
        # Something else precedes the message in the cache, and the walk before it may have
        # taken any part of the header along (the end-of-turn token, the header's start, the
        # role): what is left of it must be found with what follows.
        for taken in range(min(self._header(role), len(core)) + 1):
            rest = core[taken:]
            plan = plan_in_order([-1, *whole], [*rest, -2], min_chunk=self.min_chunk)
            if plan.prefix + plan.chunk_len < len(rest):
                return False
        return True


def _cut(message: Message, kept: list[tuple[int, int]], cutter: Cutter) -> tuple[Span, ...]:
    """The message's first few words, then the kept sentences; else the kept sentences from
    the message's start; else everything up to the last kept sentence; else the whole
    message. The first words are what the walk finds the message's header with, whatever
    the run before it took of the header (see ``Cutter.keeps``)."""
    content = message.content
    tries: list[tuple[Span, ...]] = [
        ((0, end), (start, kept[0][1]), *kept[1:])
        for end in _openings(content, kept[0][0])
        for start in _leads(content, kept[0][0])
        if end < start
    ]
    tries += [((0, kept[0][1]), *kept[1:]), ((0, kept[-1][1]),)]
    for spans in tries:
        if cutter.keeps(message.role, content, _text(content, spans)):
            return spans
    return ((0, len(content)),)


def _leads(content: str, at: int) -> list[int]:
    """Where the sentence at ``at`` may start in a cut: with the space or line break in front
    of it (the cache holds " Kenji", not "Kenji"), or with the punctuation before that too
    (a tokenizer may hold "?" and a line break as one token)."""
    space = at
    while space > 0 and content[space - 1].isspace():
        space -= 1
    mark = space
    while mark > 0 and not content[mark - 1].isspace() and not content[mark - 1].isalnum():
        mark -= 1
    return list(dict.fromkeys((space, mark)))


def abridge(
    summary: str | None,
    messages: Sequence[Message],
    cutter: Cutter,
    *,
    previous: Sequence[Cut] = (),
    cost: Callable[[Message, str], int],
    limit: int,
) -> tuple[Cut, ...]:
    """The cuts of ``messages`` (evicted, in order) that keep ``summary``'s items and facts,
    within ``limit`` tokens (``cost`` of one cut message). A message cut before (``previous``)
    only loses text: what the cache holds of it stays a run it can keep."""
    if not summary:
        return ()
    items, facts = summary_items(summary)
    before = {c.message_id: c for c in previous}
    cuts: list[Cut] = []
    for message in messages:
        if message.role not in ("user", "assistant") or not message.content.strip():
            continue
        old = before.get(message.id)
        kept: list[Span] = []
        value = 0
        # The summarizer's own sentences ("Dr. Patel" is not two), with what follows them.
        for start, end in sentence_spans(message.content):
            if old is not None and not any(s <= start and end <= e for s, e in old.spans):
                continue  # cut away before: it stays away
            span = message.content[start:end]
            words = _words(span)
            said = next((w for w in items if w <= words), None)
            named = [f for f in facts if f in span and f in identifiers(span)]
            if said is None and not named:
                continue
            if said is not None:
                items.remove(said)
            for fact in named:
                facts.remove(fact)
            kept.append((start, end))
            value += (said is not None) + len(named)
        if kept:
            spans = (
                _cut(message, kept, cutter) if old is None else _narrow(message, old, kept, cutter)
            )
            cuts.append(Cut(message.id, spans, value))
    return _within(cuts, messages, cost, limit)


def _narrow(message: Message, old: Cut, kept: list[Span], cutter: Cutter) -> tuple[Span, ...]:
    """A cut message again: its first span (the message's start) and the later ones that
    still say something; as it was if that leaves a run too short to keep."""
    later = tuple((s, e) for s, e in old.spans[1:] if any(s <= ks and ke <= e for ks, ke in kept))
    spans = (old.spans[0], *later)
    keeps = cutter.keeps(message.role, message.content, _text(message.content, spans))
    return spans if keeps else old.spans


def _within(
    cuts: list[Cut],
    messages: Sequence[Message],
    cost: Callable[[Message, str], int],
    limit: int,
) -> tuple[Cut, ...]:
    by_id = {m.id: m for m in messages}
    costs = {
        c.message_id: cost(by_id[c.message_id], c.text(by_id[c.message_id].content)) for c in cuts
    }
    total = sum(costs.values())
    dropped: set[int] = set()

    def worth(c: Cut) -> tuple[float, int]:  # least value per token first, then the oldest
        return c.value / max(1, costs[c.message_id]), by_id[c.message_id].position

    for c in sorted(cuts, key=worth):
        if total <= limit:
            break
        dropped.add(c.message_id)
        total -= costs[c.message_id]
    return tuple(c for c in cuts if c.message_id not in dropped)
