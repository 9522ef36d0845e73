"""Summarizers fold evicted turns into the running summary.

A summarizer is any callable ``(previous_summary, evicted_messages) -> new_summary``. It sees
each message once: the builder passes only messages the summary does not cover yet.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from chatctx.context._facts import (
    FACTS_PREFIX,
    THRESHOLD,
    fact_set,
    identifiers,
    line_key,
    replaced,
    sentences,
    statement_score,
    statements,
    values,
)
from chatctx.errors import SummaryError
from chatctx.store import Message
from chatctx.store.search import unspaced

__all__ = [
    "ExtractiveSummarizer",
    "LLMSummarizer",
    "Summarizer",
    "SummaryError",
    "parse_summary",
    "summary_limit",
]


class Summarizer(Protocol):
    def __call__(self, previous: str | None, messages: Sequence[Message]) -> str: ...


_MAX_SENTENCE_WORDS = 24  # a sentence kept for its identifiers, cut beyond this
# Where a sentence's clauses part: a comma, semicolon or enumeration mark (an ASCII one only
# before a space: "6,500" is one number).
_CLAUSE_BREAK = re.compile(r"\s*(?:[\uff0c\uff1b\u3001]|[,;](?=\s))\s*")
# A bare year goes on the Facts line but is no reason to keep its whole sentence.
_YEAR = re.compile(r"(?:19|20)\d\d")
# An item worth rewriting (re-evaluating) the summary for: an identifier or a strong statement.
# Below it, an item is minor (see ``ExtractiveSummarizer``).
_SALIENT = 3.0
# What a small value (a time, a count with its unit: ``values``) adds to a sentence's worth:
# two make it salient.
VALUE_SCORE = 1.5
CHANGE_SCORE = VALUE_SCORE  # what a value said anew adds to its sentence (``_changed_score``)
# What an item giving anew a value the summary holds is worth at least: kept in a rewrite
# before any other item of its length (two identifiers and a value score 7.5).
RENEWED_SCORE = 4 * _SALIENT
# What an item whose values later items give anew is still worth at least: ``replaced`` is a
# guess, so it is kept where there is room.
_STALE_SCORE = 0.5
CHANGE_WINDOW = 32  # earlier items a new one is compared with (``_changes``): linear cost
_ITEM_SEP = "; "
# What ends a line without saying anything: not a unit ("20%", "6,50 €", "₩5,000" keep
# theirs) nor a closing bracket or quote.
_END_PUNCTUATION = re.compile(
    r"[^\w%\u2030$\u00a2-\u00a5\u20a0-\u20cf"  # percent, per mille, currency signs
    r")\]}\uff09\u300d\u300f\u201d\u00bb]+$"  # closing brackets and quotes
)

# (score, order, label, text): one kept statement; consecutive items of one speaker share a
# line, "User: a; b; c", which costs about two tokens less per item than a line each.
_Item = tuple[float, int, str, str]


def _item_score(text: str, label: str) -> float:
    """What a kept item is worth: identifiers first, then what the user says about
    themselves; 0 for anything else (greetings, chit-chat, generic advice)."""
    score = 3.0 * len(identifiers(text)) + VALUE_SCORE * min(2, len(values(text)))
    if label == "User":
        personal = statement_score(text)
        if score or personal:
            score += 1.0 + personal
    return score


def _changes(earlier: Sequence[str], text: str) -> list[tuple[str, str]]:
    """(old, new) for the values ``text`` gives anew (``replaced``) that one of the last
    ``CHANGE_WINDOW`` of the ``earlier`` items said: the latest first among several."""
    found: dict[str, tuple[str, str]] = {}
    for before in reversed(earlier[-CHANGE_WINDOW:]):
        for pair in replaced(before, text):
            found.setdefault(pair[1], pair)
    return list(found.values())


def _message_items(role: str, content: str) -> list[tuple[float, str, str]]:
    """(score, label, text) for each part of a message worth keeping: sentences holding
    identifiers or values (either speaker's, in any language; the clauses that hold them in
    scripts without spaces), and (from the user, in English) first-person statements."""
    label = role.capitalize()
    texts = [
        " ".join(_valued_clauses(sentence).split()[:_MAX_SENTENCE_WORDS])
        for sentence in sentences(content)
        if _holds_values(sentence)
    ]
    if role == "user":
        texts += [
            found.text
            for found in statements(content)
            if not any(found.text in text for text in texts)
        ]
    out = []
    for text in texts:
        text = text.replace(_ITEM_SEP, ", ")  # one item stays one item when parsed back
        # Punctuation at the end of a line merges with the next newline into one token:
        # without it, what is appended later leaves every token of the summary as it was.
        text = _END_PUNCTUATION.sub("", text)
        score = _item_score(text, label)
        if text and score > 0:
            out.append((score, label, text))
    return out


def _holds_values(text: str) -> bool:
    return any(not _YEAR.fullmatch(found) for found in identifiers(text)) or bool(values(text))


def _valued_clauses(sentence: str) -> str:
    """In a script written without spaces between words (Chinese, Japanese; Korean joins its
    endings on), where a cut at ``_MAX_SENTENCE_WORDS`` words leaves a long sentence whole,
    the clauses of ``sentence`` that hold its identifiers or values, in order: what it is
    kept for, without the advice around it. Elsewhere the sentence as it is."""
    if not unspaced([sentence]):
        return sentence
    clauses = _CLAUSE_BREAK.split(sentence)
    kept = [clause for clause in clauses if _holds_values(clause)]
    return ", ".join(kept) if kept and len(kept) < len(clauses) else sentence


def _changed_score(score: float, changes: Sequence[tuple[str, str]]) -> float:
    """What an item that gives values anew is worth: ``CHANGE_SCORE`` more per value (the
    conversation changed it: likely asked back), and never less than salient."""
    return max(score + CHANGE_SCORE * len(changes), _SALIENT)


def _latest_first(items: Sequence[_Item]) -> list[_Item]:
    """The summary's ``items`` (in order, scored afresh from their text) rescored for
    compaction so that the latest value wins: one that gives anew a value an earlier item
    holds (``replaced``) is worth as much again as when it was added (``RENEWED_SCORE``),
    and the earlier item ``CHANGE_SCORE`` less per later item that does (its value is the
    old one), so a rewrite drops the old value before the new."""
    texts = [item[3] for item in items]
    out = list(items)
    superseded: Counter[int] = Counter()  # index: later items giving its values anew
    for index, (score, order, label, text) in enumerate(items):
        older = [
            at for at in range(max(0, index - CHANGE_WINDOW), index) if replaced(texts[at], text)
        ]
        if older:
            changes = _changes(texts[:index], text)
            out[index] = (max(_changed_score(score, changes), RENEWED_SCORE), order, label, text)
            superseded.update(older)
    for at, times in superseded.items():
        score, order, label, text = items[at]
        out[at] = (max(_STALE_SCORE, score - CHANGE_SCORE * times), order, label, text)
    return out


def _render(facts: Sequence[str], items: Sequence[_Item]) -> str:
    """``Facts:`` line first, then the items in their order, one line per run of a speaker."""
    lines = [FACTS_PREFIX + _ITEM_SEP.join(facts)] if facts else []
    label = None
    for _, _, item_label, text in sorted(items, key=lambda item: item[1]):
        if item_label == label:
            lines[-1] += _ITEM_SEP + text
        else:
            lines.append(f"{item_label}: {text}")
            label = item_label
    return "\n".join(lines)


def parse_summary(summary: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The facts and the (label, text) items of a summary this class wrote."""
    facts: dict[str, None] = {}
    items: list[tuple[str, str]] = []
    for line in summary.splitlines():
        if line.startswith(FACTS_PREFIX):
            facts.update(dict.fromkeys(f for f in line[len(FACTS_PREFIX) :].split(_ITEM_SEP) if f))
        elif line.strip():
            label, _, rest = line.partition(": ")
            items += [(label, text) for text in rest.split(_ITEM_SEP) if text]
    return list(facts), items


class ExtractiveSummarizer:
    """Keeps identifiers and what the user says about themselves, with no model; deterministic.

    Each call appends a block to the previous summary: a ``Facts:`` line with the identifiers
    not yet in it (order and ticket numbers, models, amounts, e-mail addresses; compared as a
    parsed set, see ``fact_set``), then the best new items as ``Role: item; item`` lines:
    sentences holding identifiers or small values (times, dates, amounts; in any language,
    either speaker's; in scripts without spaces, the clauses that hold them), and the user's
    first-person statements about durable things
    (allergies, names of people and pets, family, home, work, belongings and where they are,
    plans and dates, preferences, open requests), cut to the clause that says it. Other user
    sentences that name something specific, or speak about the user with content words, are
    minor items (see ``chatctx.context._facts``): they are kept only while the summary stays
    within ``minor_share`` of ``max_tokens``, so they never crowd out, or force a rewrite
    for, the facts above. Items are chosen by value per token. Chit-chat adds nothing, and
    "nothing new" is a normal result: the previous summary comes back unchanged ("" when there
    is none). Appending keeps the previous summary a prefix of the new one, so its tokens stay
    cached in llama.cpp. When an item worth it does not fit ``max_tokens``, the summary is
    compacted to ``compact_to`` of it: the items of least value per token go first (oldest
    first among equals; identifiers stay on one ``Facts:`` line), then the oldest facts.
    """

    def __init__(
        self,
        count: Callable[[str], int],
        *,
        max_tokens: int = 192,
        compact_to: float = 0.7,
        minor_share: float = 0.7,
    ) -> None:
        self.count = count
        self.max_tokens = max_tokens
        self.compact_to = compact_to
        self.minor_share = minor_share

    def __call__(self, previous: str | None, messages: Sequence[Message]) -> str:
        previous = (previous or "").strip()
        known = fact_set(previous)
        covered = set(known)  # identifiers in the summary or in a line already taken
        earlier = [text for _, text in parse_summary(previous)[1]]
        summarized = len(earlier)  # the previous summary's items: ``earlier[:summarized]``
        held = {value for text in earlier for value in values(text)}  # the summary's values
        seen = {line_key(text) for text in earlier}
        facts: dict[str, None] = {}  # ordered set: first seen first
        candidates: list[_Item] = []
        forcing = False  # an item worth rewriting the summary for (see below)
        for message in messages:
            if message.role not in ("user", "assistant", "tool") or not message.content.strip():
                continue
            facts.update(dict.fromkeys(identifiers(message.content)))
            for score, label, text in _message_items(message.role, message.content):
                key = line_key(text)
                ids = set(identifiers(text))
                # A sentence that only repeats known identifiers ("Got it, the AX3000") adds
                # nothing; a statement about the user (not a minor one) still does.
                repeats = ids and ids <= covered and statement_score(text) < THRESHOLD
                if key not in seen and not repeats:
                    seen.add(key)
                    covered |= ids
                    # A value said anew goes in past the minor share: the prompt carries the
                    # latest, after the older one. Not marked as replacing it ("7일 → 22일"):
                    # ``replaced`` is a guess, and a false mark would tell the model a value
                    # still true (an opening time, another price) is void.
                    changes = _changes(earlier, text)
                    # A new value for one the summary already holds is worth a rewrite, and
                    # the most in it: left out, the summary holds the old value alone (not
                    # when it holds the new one too: said again, it is no news).
                    renews = bool(changes) and any(
                        new not in held for _, new in _changes(earlier[:summarized], text)
                    )
                    if score >= _SALIENT or renews:
                        forcing = True
                    if changes:
                        score = _changed_score(score, changes)
                    if renews:
                        score = max(score, RENEWED_SCORE)
                    earlier.append(text)
                    candidates.append((score, len(candidates), label, text))
        new_facts = [f for f in facts if f not in known]
        if not new_facts and not candidates:
            return previous  # nothing new: a normal result, the cached prefix stays
        if previous:
            used = self.count(previous) + 1
            minor_room = int(self.max_tokens * self.minor_share) - used
            block = self._block(new_facts, candidates, self.max_tokens - used, minor_room)
            if block:
                return f"{previous}\n{block}"
            # Nothing fits. Rewriting costs a re-evaluation of the whole summary, so only
            # compact for something worth keeping: a new identifier, a strong statement, or a
            # new value for one the summary holds (any other value said anew goes in where
            # there is room: forcing a rewrite for each lost more facts at 512 on the dev set
            # than it kept values current; for those the summary holds, none were lost).
            if block is not None and not forcing:
                return previous
        return self._compact(previous, new_facts, candidates)

    def _block(
        self, facts: list[str], candidates: list[_Item], room: int, minor_room: int
    ) -> str | None:
        """The best block that fits ``room`` tokens, minor items only ``minor_room``; None if
        even the facts do not fit."""
        used = self.count(_render(facts, [])) + 1 if facts else 0
        if used > room:
            return None
        chosen: list[_Item] = []
        costs = {c[1]: self.count(c[3]) + 2 for c in candidates}
        # Best value per token first: a summary is a knapsack of tokens.
        for item in sorted(candidates, key=lambda c: (-c[0] / costs[c[1]], c[1])):
            cost = costs[item[1]]
            if used + cost <= (room if item[0] >= _SALIENT else min(room, minor_room)):
                chosen.append(item)
                used += cost
        text = _render(facts, chosen)
        while chosen and self.count(text) > room:  # labels and joins can add a token or two
            chosen.remove(min(chosen, key=lambda c: (c[0], -c[1])))
            text = _render(facts, chosen)
        return text if self.count(text) <= room else None

    def _compact(self, previous: str, new_facts: list[str], candidates: list[_Item]) -> str:
        target = max(16, int(self.max_tokens * self.compact_to))
        old_facts, old_items = parse_summary(previous)
        facts = list(dict.fromkeys(old_facts + new_facts))
        items: list[_Item] = [
            (_item_score(text, label), order, label, text)
            for order, (label, text) in enumerate(old_items)
        ]
        items = _latest_first(items)  # the new candidates carry their change scores already
        base = len(items)
        items += [(score, base + order, label, text) for score, order, label, text in candidates]
        return self._fit(facts, items, target)

    def _fit(self, facts: list[str], items: list[_Item], limit: int) -> str:
        """Drop the items of least value per token (oldest first among equals), then the
        oldest facts; minor items too while the total is above the summary's ``minor_share``.

        Per-item counts make this linear; a short exact pass fixes what joining changes.
        """
        item_cost = {item[1]: self.count(item[3]) + 1 for item in items}
        fact_cost = [self.count(fact) + 1 for fact in facts]
        total = self.count(FACTS_PREFIX) + sum(fact_cost) + sum(item_cost.values())
        by_value = sorted(items, key=lambda item: (item[0] / item_cost[item[1]], item[1]))
        dropped = 0
        minor_limit = min(limit, int(self.max_tokens * self.minor_share))
        while dropped < len(by_value) and (
            total > limit or (total > minor_limit and by_value[dropped][0] < _SALIENT)
        ):
            total -= item_cost[by_value[dropped][1]]
            dropped += 1
        first_fact = 0
        while total > limit and first_fact < len(facts):
            total -= fact_cost[first_fact]
            first_fact += 1
        kept_items, kept_facts = by_value[dropped:], facts[first_fact:]
        text = _render(kept_facts, kept_items)
        while self.count(text) > limit and (kept_items or kept_facts):
            if kept_items:
                kept_items = kept_items[1:]
            else:
                kept_facts = kept_facts[1:]
            text = _render(kept_facts, kept_items)
        return text


DEFAULT_PROMPT = (
    "You keep a running summary of a conversation. Update it with the new messages. Keep "
    "what the user said about themselves (names, family, pets, allergies, home, work, plans, "
    "dates, numbers, likes) and what they still want, plus every order or ticket number, "
    "e-mail and amount exactly as written. At most {max_words} words. Write only the summary."
)


class LLMSummarizer:
    """Summarizes with a language model through ``generate(messages) -> text``.

    Evicted messages are folded in chunks of at most ``max_input_tokens`` (counted with
    ``count``), so a large eviction never produces a prompt the model cannot take.
    ChatSession wires ``generate`` to the engine's side sequence when there is one. With
    ``timed``, ``generate`` is also given ``timeout_s``: the seconds left before the whole
    summary's deadline (see ``fold``).
    """

    def __init__(
        self,
        generate: Callable[..., str],
        *,
        max_tokens: int = 192,
        prompt: str = DEFAULT_PROMPT,
        count: Callable[[str], int] | None = None,
        max_input_tokens: int = 1024,
        timed: bool = False,
    ) -> None:
        self.generate = generate
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.count = count or (lambda text: len(text) // 3 + 1)
        self.max_input_tokens = max_input_tokens
        self.timed = timed

    def request(self, previous: str | None, lines: Sequence[str]) -> list[dict[str, Any]]:
        transcript = "\n".join(lines)
        user = (
            f"Summary so far:\n{previous or '(empty)'}\n\nNew messages:\n{transcript}\n\n"
            "Updated summary:"
        )
        system = self.prompt.format(max_words=max(16, int(self.max_tokens * 0.7)))
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def _chunks(
        self, previous: str | None, messages: Sequence[Message]
    ) -> list[tuple[list[str], list[int]]]:
        """(transcript lines, ids of the messages they cover) per request, in order."""
        # The request holds the instructions, the summary so far and one chunk of messages.
        overhead = self.count(self.prompt) + self.max_tokens + 64
        room = max(32, self.max_input_tokens - overhead - self.count(previous or ""))
        chunks: list[tuple[list[str], list[int]]] = [([], [])]
        used = 0
        for m in messages:
            if not m.content.strip():  # nothing to say: covered by whichever chunk is open
                chunks[-1][1].append(m.id)
                continue
            line = f"{m.role}: {m.content}"
            n = self.count(line)
            if n > room:  # one huge message: keep its start and end
                keep = max(16, len(line) * room // (2 * n))
                line = line[:keep] + " [...] " + line[-keep:]
                n = self.count(line)
            if chunks[-1][0] and used + n > room:
                chunks.append(([], []))
                used = 0
            chunks[-1][0].append(line)
            chunks[-1][1].append(m.id)
            used += n
        return [c for c in chunks if c[0] or c[1]]

    def fold(
        self,
        previous: str | None,
        messages: Sequence[Message],
        *,
        deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> tuple[str | None, list[int], str | None]:
        """Fold ``messages`` chunk by chunk until done or until ``clock()`` passes ``deadline``.

        Returns (summary, ids of the messages it covers, why it stopped early or None). What
        was finished is kept: a chunk that times out or fails ends the fold with the summary
        of the chunks before it (the caller retries the rest later). A failure before any
        chunk is done is raised. An empty answer means nothing to add: the summary so far
        stays and the chunk counts as covered.
        """
        summary = previous
        covered: list[int] = []
        chunks = self._chunks(previous, messages)
        for index, (lines, ids) in enumerate(chunks):
            if not lines:
                covered += ids
                continue
            left = None if deadline is None else deadline - clock()
            if left is not None and left <= 0:
                return summary, covered, (f"deadline reached after {index} of {len(chunks)} chunks")
            try:
                request = self.request(summary, lines)
                raw = (
                    self.generate(request, timeout_s=left) if self.timed else self.generate(request)
                )
            except Exception as exc:
                if not covered:
                    raise
                return (
                    summary,
                    covered,
                    (f"chunk {index + 1} of {len(chunks)} failed: {type(exc).__name__}: {exc}"),
                )
            text = str(raw).strip()
            if text:
                summary = text
            covered += ids
        return summary, covered, None

    def __call__(self, previous: str | None, messages: Sequence[Message]) -> str:
        summary, _, _ = self.fold(previous, messages)
        return summary or ""


def message_dicts(messages: Sequence[Message]) -> list[Mapping[str, Any]]:
    return [m.to_openai() for m in messages]


def summary_limit(max_tokens: int, budget: int) -> int:
    """A summary may take at most 60% of the budget, so evicting still frees room.

    Measured on everyday facts in real chats (bench/README.md): at budget 512, 60% keeps
    more facts than half or a quarter and costs no more prefill, since evictions are rarer.
    """
    return min(max_tokens, max(16, budget * 3 // 5))


def summarizer_for(
    kind: str,
    *,
    count: Callable[[str], int],
    max_tokens: int,
    budget: int,
    generate: Callable[..., str] | None = None,
    max_input_tokens: int = 1024,
    timed: bool = False,
) -> Summarizer | None:
    """The summarizer a ``ContextSettings.summarizer`` value names (None for "none").

    ``timed``: ``generate`` takes ``timeout_s`` (see ``LLMSummarizer``)."""
    limit = summary_limit(max_tokens, budget)
    if kind == "extractive":
        return ExtractiveSummarizer(count, max_tokens=limit)
    if kind == "llm":
        if generate is None:
            raise SummaryError("the llm summarizer needs a loaded model")
        return LLMSummarizer(
            generate,
            max_tokens=limit,
            count=count,
            max_input_tokens=max_input_tokens,
            timed=timed,
        )
    return None
