"""Summarizers fold evicted turns into the running summary.

A summarizer is any callable ``(previous_summary, evicted_messages) -> new_summary``. It sees
each message once: the builder passes only messages the summary does not cover yet.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from chatctx.errors import ChatctxError
from chatctx.store import Message

__all__ = ["ExtractiveSummarizer", "LLMSummarizer", "Summarizer", "SummaryError"]


class SummaryError(ChatctxError):
    """A summarizer failed; the previous summary stays."""


class Summarizer(Protocol):
    def __call__(self, previous: str | None, messages: Sequence[Message]) -> str: ...


# Identifiers a support conversation must not lose: order/ticket numbers, models, amounts.
_IDENTIFIER = re.compile(
    r"\b(?:[A-Z]{1,6}-?\d[\w-]*|\d+[A-Z][\w-]*|#\d[\w-]*|\d{4,})\b"
    r"|[$€£]\s?\d[\d,.]*|\b[\w.+-]+@[\w-]+\.[\w.]+\b"
)
# People introducing themselves: "my name is Maria Lopez", "I'm Jonas".
_INTRODUCED = re.compile(
    r"\b(?:[Mm]y name is|[Nn]ame's|I am|I'm|[Tt]his is|[Cc]all me)\s+"
    r"([A-Z][a-z]+(?:\s[A-Z][a-z]+)?)\b"
)
_NUMBER = re.compile(r"\b\d+(?:[.,]\d+)*\b")
_NAME = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][a-z]{2,}(?:\s[A-Z][a-z]{2,})*\b")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_FACTS = "Facts: "
_FILLER = re.compile(
    r"^(hi|hello|hey|thanks|thank you|ok|okay|great|sure|bye)\b[\s!.,]*$", re.IGNORECASE
)


def _facts_in(text: str) -> list[str]:
    return _IDENTIFIER.findall(text) + _INTRODUCED.findall(text)


def _score(sentence: str, role: str) -> float:
    score = 3.0 * len(_facts_in(sentence)) + 1.0 * len(_NUMBER.findall(sentence))
    score += 1.5 * len(_NAME.findall(sentence))
    score += 1.0 if role == "user" else 0.0
    score += 0.5 if "?" not in sentence else 0.0
    if _FILLER.match(sentence.strip()):
        score -= 5.0
    return score


class ExtractiveSummarizer:
    """Keeps the salient sentences and every identifier, with no model; deterministic.

    Each call appends a block to the previous summary: a ``Facts:`` line with the identifiers
    not yet in it (order and ticket numbers, models, amounts, e-mail addresses) and the
    highest-scoring new sentences as ``Role: sentence`` lines. Appending keeps the previous
    summary a prefix of the new one, so its tokens stay cached in llama.cpp. When the next
    block does not fit ``max_tokens``, the summary is compacted to ``compact_to`` of it: the
    oldest lines go (their facts are kept on one ``Facts:`` line first), then the
    lowest-scoring ones, then the oldest facts.
    """

    def __init__(
        self, count: Callable[[str], int], *, max_tokens: int = 192, compact_to: float = 0.7
    ) -> None:
        self.count = count
        self.max_tokens = max_tokens
        self.compact_to = compact_to

    def __call__(self, previous: str | None, messages: Sequence[Message]) -> str:
        previous = (previous or "").strip()
        facts: dict[str, None] = {}  # ordered set: first seen first
        candidates: list[tuple[float, int, str]] = []  # (score, order, text)
        for message in messages:
            if message.role not in ("user", "assistant", "tool") or not message.content.strip():
                continue
            facts.update(dict.fromkeys(_facts_in(message.content)))
            label = message.role.capitalize()
            for sentence in _SENTENCE.split(message.content):
                sentence = " ".join(sentence.split())
                score = _score(sentence, message.role) if len(sentence) >= 3 else 0.0
                if score > 0:
                    candidates.append((score, len(candidates), f"{label}: {sentence}"))
        new_facts = [f for f in facts if f not in previous]
        if previous:
            room = self.max_tokens - self.count(previous) - 1
            block = self._block(new_facts, candidates, room)
            if block:
                return f"{previous}\n{block}"
            # Nothing fits. Rewriting costs a re-evaluation of the whole summary, so only
            # compact for something worth keeping: a new fact, or a sentence with one.
            salient = any(
                score >= 3.0 and text.partition(": ")[2] not in previous
                for score, _, text in candidates
            )
            if block is not None and not salient:
                return previous
        return self._compact(previous, new_facts, candidates)

    def _block(
        self, facts: list[str], candidates: list[tuple[float, int, str]], room: int
    ) -> str | None:
        """The best block that fits ``room`` tokens; None if even the facts do not fit."""
        head = [_FACTS + "; ".join(facts)] if facts else []
        used = self.count(head[0]) + 1 if head else 0
        if used > room:
            return None
        chosen: list[tuple[float, int, str]] = []
        for item in sorted(candidates, key=lambda c: (-c[0], c[1])):
            cost = self.count(item[2]) + 1
            if used + cost <= room:
                chosen.append(item)
                used += cost
        lines = head + [text for _, _, text in sorted(chosen, key=lambda c: c[1])]
        text = "\n".join(lines)
        while lines and self.count(text) > room:  # merging across lines can add a token
            lines.pop()
            text = "\n".join(lines)
        return text

    def _compact(
        self, previous: str, new_facts: list[str], candidates: list[tuple[float, int, str]]
    ) -> str:
        target = max(16, int(self.max_tokens * self.compact_to))
        facts: dict[str, None] = {}
        lines: list[tuple[float, int, str]] = []
        for index, line in enumerate(previous.splitlines()):
            if line.startswith(_FACTS):
                facts.update(dict.fromkeys(f for f in line[len(_FACTS) :].split("; ") if f))
            elif line.strip():
                role, _, text = line.partition(": ")
                lines.append((_score(text, role.lower()), index, line))
        facts.update(dict.fromkeys(new_facts))
        base = len(lines)
        lines += [(score, base + order + 1, text) for score, order, text in candidates]
        return self._fit(list(facts), lines, target)

    def _fit(self, facts: list[str], lines: list[tuple[float, int, str]], limit: int) -> str:
        """Drop the lowest-scoring lines (oldest first among equals), then the oldest facts.

        Per-line counts make this linear; a short exact pass fixes what merging changes.
        """

        def render(facts: list[str], lines: list[tuple[float, int, str]]) -> str:
            body = [text for _, _, text in sorted(lines, key=lambda item: item[1])]
            head = [_FACTS + "; ".join(facts)] if facts else []
            return "\n".join(head + body)

        line_cost = {order: self.count(text) + 1 for _, order, text in lines}
        fact_cost = [self.count(fact) + 1 for fact in facts]
        total = self.count(_FACTS) + sum(fact_cost) + sum(line_cost.values())
        by_value = sorted(lines, key=lambda item: (item[0], item[1]))
        dropped = 0
        while total > limit and dropped < len(by_value):
            total -= line_cost[by_value[dropped][1]]
            dropped += 1
        first_fact = 0
        while total > limit and first_fact < len(facts):
            total -= fact_cost[first_fact]
            first_fact += 1
        kept_lines, kept_facts = by_value[dropped:], facts[first_fact:]
        text = render(kept_facts, kept_lines)
        while self.count(text) > limit and (kept_lines or kept_facts):
            if kept_lines:
                kept_lines = kept_lines[1:]
            else:
                kept_facts = kept_facts[1:]
            text = render(kept_facts, kept_lines)
        return text


DEFAULT_PROMPT = (
    "You maintain a running summary of a customer support conversation. Update the summary "
    "with the new messages. Keep every order number, ticket number, product model, name, "
    "amount and date exactly as written, and what was decided. Use at most {max_words} words. "
    "Write only the summary."
)


class LLMSummarizer:
    """Summarizes with a language model through ``generate(messages) -> text``.

    Evicted messages are folded in chunks of at most ``max_input_tokens`` (counted with
    ``count``), so a large eviction never produces a prompt the model cannot take.
    ChatSession wires ``generate`` to the engine's side sequence when there is one.
    """

    def __init__(
        self,
        generate: Callable[[list[dict[str, Any]]], str],
        *,
        max_tokens: int = 192,
        prompt: str = DEFAULT_PROMPT,
        count: Callable[[str], int] | None = None,
        max_input_tokens: int = 1024,
    ) -> None:
        self.generate = generate
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.count = count or (lambda text: len(text) // 3 + 1)
        self.max_input_tokens = max_input_tokens

    def request(self, previous: str | None, lines: Sequence[str]) -> list[dict[str, Any]]:
        transcript = "\n".join(lines)
        user = (
            f"Summary so far:\n{previous or '(empty)'}\n\nNew messages:\n{transcript}\n\n"
            "Updated summary:"
        )
        system = self.prompt.format(max_words=max(16, int(self.max_tokens * 0.7)))
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def _chunks(self, previous: str | None, messages: Sequence[Message]) -> list[list[str]]:
        # The request holds the instructions, the summary so far and one chunk of messages.
        overhead = self.count(self.prompt) + self.max_tokens + 64
        room = max(32, self.max_input_tokens - overhead - self.count(previous or ""))
        chunks: list[list[str]] = [[]]
        used = 0
        for m in messages:
            if not m.content.strip():
                continue
            line = f"{m.role}: {m.content}"
            n = self.count(line)
            if n > room:  # one huge message: keep its start and end
                keep = max(16, len(line) * room // (2 * n))
                line = line[:keep] + " [...] " + line[-keep:]
                n = self.count(line)
            if chunks[-1] and used + n > room:
                chunks.append([])
                used = 0
            chunks[-1].append(line)
            used += n
        return [c for c in chunks if c]

    def __call__(self, previous: str | None, messages: Sequence[Message]) -> str:
        summary = previous
        for lines in self._chunks(previous, messages):
            text = self.generate(self.request(summary, lines)).strip()
            if not text:
                raise SummaryError("the model returned an empty summary")
            summary = text
        if summary is None:
            raise SummaryError("nothing to summarize")
        return summary


def message_dicts(messages: Sequence[Message]) -> list[Mapping[str, Any]]:
    return [m.to_openai() for m in messages]


def summary_limit(max_tokens: int, budget: int) -> int:
    """A summary may take at most a quarter of the budget, so evicting still frees room."""
    return min(max_tokens, max(16, budget // 4))


def summarizer_for(
    kind: str,
    *,
    count: Callable[[str], int],
    max_tokens: int,
    budget: int,
    generate: Callable[[list[dict[str, Any]]], str] | None = None,
    max_input_tokens: int = 1024,
) -> Summarizer | None:
    """The summarizer a ``ContextSettings.summarizer`` value names (None for "none")."""
    limit = summary_limit(max_tokens, budget)
    if kind == "extractive":
        return ExtractiveSummarizer(count, max_tokens=limit)
    if kind == "llm":
        if generate is None:
            raise SummaryError("the llm summarizer needs a loaded model")
        return LLMSummarizer(
            generate, max_tokens=limit, count=count, max_input_tokens=max_input_tokens
        )
    return None
