"""The context builder: fit a conversation into a token budget, turn by whole turn.

Pure logic over messages, a codec (chat template + exact token counter) and a summarizer. It
never imports the engine and never changes the stored history: it decides what is sent.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from chatctx.config import ContextSettings
from chatctx.context._turns import group_turns, id_ranges
from chatctx.context.summarizers import Summarizer
from chatctx.errors import ContextBudgetError
from chatctx.store import Message

logger = logging.getLogger("chatctx.context")

SUMMARY_HEADER = "Summary of the earlier conversation (older turns are not shown):\n"
TRUNCATION_MARKER = "\n[... {n} characters removed to fit the context ...]\n"
_ANCHOR = {"role": "system", "content": "."}
MAX_PENDING = 2000


class Codec(Protocol):
    """What the builder needs from a model: its template and its exact tokenizer."""

    fingerprint: str

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str: ...

    def encode_prompt(self, text: str) -> list[int]: ...


class TokenCache(Protocol):
    """Per-message token counts kept between builds (the store implements it)."""

    def get_token_counts(self, fingerprint: str, ids: Sequence[int]) -> dict[int, int]: ...

    def put_token_counts(self, fingerprint: str, counts: Mapping[int, int]) -> None: ...


@dataclass(frozen=True, slots=True)
class ContextState:
    """What the builder carries from one turn to the next (persisted by the caller)."""

    window_start: int = 0  # position of the first history message still sent
    summary: str | None = None
    summary_tokens: int = 0
    pending_ids: tuple[int, ...] = ()  # evicted, not yet folded into the summary


@dataclass(slots=True)
class ContextPlan:
    """What was sent and why. ``prompt_tokens`` is exact: the rendered prompt's length."""

    policy: str
    budget: int
    reserve: int
    high_limit: int
    low_limit: int
    prompt_tokens: int
    sections: dict[str, int]
    kept_ids: list[int]
    new_tokens: int = 0  # tokens no earlier prompt had: the new message and the last replies
    evicted_ids: list[int] = field(default_factory=list)
    summarized_ids: list[int] = field(default_factory=list)
    dropped_ids: list[int] = field(default_factory=list)
    evicted: bool = False
    reason: str | None = None
    summary_changed: bool = False
    summary_error: str | None = None
    summary_ms: float = 0.0
    truncated: bool = False
    window_start: int = 0
    prompt_hash: str = ""
    build_ms: float = 0.0

    @property
    def history_start(self) -> int:
        """Where the kept turns begin in the prompt: after system, pinned and summary."""
        return self.sections["system"] + self.sections["summary"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; id lists of evicted messages are compacted into ranges."""
        out = asdict(self)
        for key in ("evicted_ids", "summarized_ids", "dropped_ids"):
            out[key] = id_ranges(out[key])
        return out


@dataclass(frozen=True, slots=True)
class BuildResult:
    plan: ContextPlan
    messages: list[dict[str, Any]]
    tokens: list[int]
    state: ContextState
    fingerprint: str  # the codec's: tokenizer + template the counts hold for


class ContextBuilder:
    """Builds each turn's prompt under a budget with prefix-stable, whole-turn eviction."""

    def __init__(
        self,
        codec: Codec,
        settings: ContextSettings | None = None,
        *,
        summarizer: Summarizer | None = None,
        cache: TokenCache | None = None,
        lookup: Callable[[Sequence[int]], list[Message]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``lookup`` re-reads messages by id: those evicted earlier while summarizing failed
        are retried at the next eviction (the store's ``messages_by_ids``)."""
        self.codec = codec
        self.lookup = lookup
        self.settings = settings or ContextSettings()
        self.summarizer = summarizer
        self.cache = cache
        self._counts: dict[int, int] = {}
        self._clock = clock
        self._anchor_tokens: int | None = None
        self._gen_prompt_tokens: int | None = None

    # counting -----------------------------------------------------------------------------

    def count_messages(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> int:
        """Exact prompt tokens of ``messages`` rendered with the model's template."""
        return len(
            self.codec.encode_prompt(
                self.codec.render(messages, add_generation_prompt=add_generation_prompt)
            )
        )

    def message_tokens(self, messages: Sequence[Message]) -> list[int]:
        """Tokens each message adds to a prompt, cached by id and tokenizer fingerprint."""
        missing = [m.id for m in messages if m.id not in self._counts]
        if missing and self.cache is not None:
            self._counts.update(self.cache.get_token_counts(self.codec.fingerprint, missing))
        new: dict[int, int] = {}
        for m in messages:
            if m.id not in self._counts:
                new[m.id] = self._delta(m.to_openai())
        if new:
            self._counts.update(new)
            if self.cache is not None:
                self.cache.put_token_counts(self.codec.fingerprint, new)
        return [self._counts[m.id] for m in messages]

    def _delta(self, message: Mapping[str, Any]) -> int:
        # Rendered after a fixed system message, so templates that add a default system
        # prompt or a BOS to the first message do not inflate the count.
        if self._anchor_tokens is None:
            self._anchor_tokens = self.count_messages([_ANCHOR], add_generation_prompt=False)
        return (
            self.count_messages([_ANCHOR, message], add_generation_prompt=False)
            - self._anchor_tokens
        )

    # building -----------------------------------------------------------------------------

    def build(
        self,
        *,
        system_prompt: str | None,
        history: Sequence[Message],
        new_message: str,
        budget: int,
        reserve: int = 0,
        state: ContextState | None = None,
        pinned: Sequence[Message] = (),
    ) -> BuildResult:
        """Plan the prompt for ``new_message`` after ``history``.

        ``history`` holds the stored messages from ``state.window_start`` on (earlier ones are
        ignored); ``pinned`` messages always follow the system prompt.
        """
        start = self._clock()
        state = state or ContextState()
        s = self.settings
        trim = s.policy == "trim-every-turn"
        high_limit = budget if trim else math.floor(s.high * budget)
        low_limit = budget if trim else math.floor(s.low * budget)
        head: list[dict[str, Any]] = []
        if system_prompt:
            head.append({"role": "system", "content": system_prompt})
        pinned_ids = {m.id for m in pinned}
        head += [m.to_openai() for m in pinned]
        window = [m for m in history if m.position >= state.window_start and m.id not in pinned_ids]
        turns = group_turns(window)
        new = {"role": "user", "content": new_message}

        def assemble(
            summary: str | None, kept: Sequence[Sequence[Message]], last: Mapping[str, Any]
        ) -> list[dict[str, Any]]:
            out = list(head)
            if summary:
                out.append({"role": "system", "content": SUMMARY_HEADER + summary})
            out += [m.to_openai() for turn in kept for m in turn]
            out.append(dict(last))
            return out

        summary = state.summary
        summary_tokens = state.summary_tokens
        total = self.count_messages(assemble(summary, turns, new))
        plan = ContextPlan(
            policy=s.policy,
            budget=budget,
            reserve=reserve,
            high_limit=high_limit,
            low_limit=low_limit,
            prompt_tokens=total,
            sections={},
            kept_ids=[],
            window_start=state.window_start,
        )
        pending = list(state.pending_ids)
        evicted: list[Message] = []
        if total > high_limit:
            plan.evicted = True
            plan.reason = (
                f"prompt {total} tokens > high watermark {high_limit} "
                f"({s.high:.0%} of budget {budget})"
                if not trim
                else f"prompt {total} tokens > budget {budget}"
            )
            flat = self.message_tokens([m for turn in turns for m in turn])
            costs, offset = [], 0
            for turn in turns:
                costs.append(sum(flat[offset : offset + len(turn)]))
                offset += len(turn)
            excess = total - low_limit
            while turns and excess > 0:
                excess -= costs.pop(0)
                evicted += turns.pop(0)
            plan.evicted_ids = [m.id for m in evicted]
            summary, summary_tokens, pending = self._summarize(plan, state, evicted, pending)
            total = self.count_messages(assemble(summary, turns, new))
            while total > budget and turns:  # the summary grew more than expected
                late = turns.pop(0)
                plan.evicted_ids += [m.id for m in late]
                pending += [m.id for m in late] if self.summarizer is not None else []
                if self.summarizer is None:
                    plan.dropped_ids += [m.id for m in late]
                total = self.count_messages(assemble(summary, turns, new))
        if total > budget:
            new, total = self._oversized(assemble, summary, new, total, budget, plan)
        messages = assemble(summary, turns, new)
        tokens = self.codec.encode_prompt(self.codec.render(messages))
        assert len(tokens) == total
        window_start = state.window_start
        if plan.evicted:
            window_start = (
                turns[0][0].position
                if turns
                else (history[-1].position + 1 if history else state.window_start)
            )
        plan.window_start = window_start
        plan.prompt_tokens = total
        plan.kept_ids = [m.id for turn in turns for m in turn]
        plan.sections = self._sections(head, summary, turns, total, reserve, assemble, new)
        plan.new_tokens = self._new_tokens(history, plan)
        plan.prompt_hash = hashlib.sha256(
            b"".join(t.to_bytes(4, "little") for t in tokens)
        ).hexdigest()[:16]
        plan.build_ms = (self._clock() - start) * 1000
        new_state = ContextState(
            window_start=window_start,
            summary=summary,
            summary_tokens=summary_tokens,
            pending_ids=tuple(pending[-MAX_PENDING:]),
        )
        return BuildResult(
            plan=plan,
            messages=messages,
            tokens=tokens,
            state=new_state,
            fingerprint=self.codec.fingerprint,
        )

    def _summarize(
        self, plan: ContextPlan, state: ContextState, evicted: list[Message], pending: list[int]
    ) -> tuple[str | None, int, list[int]]:
        if self.summarizer is None or self.settings.summarizer == "none":
            plan.dropped_ids += [m.id for m in evicted]
            return state.summary, state.summary_tokens, []
        if not evicted and not pending:
            return state.summary, state.summary_tokens, pending
        # Messages evicted earlier while summarizing failed are retried with the new ones.
        earlier = self.lookup(pending) if self.lookup is not None and pending else []
        todo = earlier + evicted
        t0 = self._clock()
        try:
            text = self.summarizer(state.summary, todo).strip()
            elapsed = self._clock() - t0
            if elapsed > self.settings.summary_timeout_s:
                raise TimeoutError(
                    f"summarizer took {elapsed:.1f} s "
                    f"(limit {self.settings.summary_timeout_s:.0f} s)"
                )
            if not text:
                raise ValueError("the summarizer returned nothing")
        except Exception as exc:
            plan.summary_ms = (self._clock() - t0) * 1000
            plan.summary_error = f"{type(exc).__name__}: {exc}"
            logger.warning("summary not updated, the previous one stays: %s", plan.summary_error)
            return state.summary, state.summary_tokens, pending + [m.id for m in evicted]
        plan.summary_ms = (self._clock() - t0) * 1000
        plan.summary_changed = text != state.summary
        plan.summarized_ids = [m.id for m in todo]
        tokens = self.count_messages(
            [{"role": "system", "content": SUMMARY_HEADER + text}], add_generation_prompt=False
        )
        return text, tokens, []

    def _oversized(
        self,
        assemble: Callable[..., list[dict[str, Any]]],
        summary: str | None,
        new: dict[str, Any],
        total: int,
        budget: int,
        plan: ContextPlan,
    ) -> tuple[dict[str, Any], int]:
        fixed = self.count_messages(assemble(summary, [], {"role": "user", "content": ""}))
        message = total - fixed
        if not self.settings.truncate_oversized or fixed >= budget:
            raise ContextBudgetError(
                f"the newest message does not fit: system, pinned and summary take {fixed} "
                f"tokens, the new message {message}, together {total} > budget {budget}",
                prompt_tokens=total,
                budget=budget,
                n_ctx=budget + plan.reserve,
            )
        content = str(new["content"])
        lo, hi = 0, len(content)  # characters kept
        best: tuple[dict[str, Any], int] | None = None
        while lo <= hi:
            keep = (lo + hi) // 2
            cut = (
                content[: keep - keep // 2]
                + TRUNCATION_MARKER.format(n=len(content) - keep)
                + content[len(content) - keep // 2 :]
            )
            candidate = {"role": "user", "content": cut}
            n = self.count_messages(assemble(summary, [], candidate))
            if n <= budget:
                best = (candidate, n)
                lo = keep + 1
            else:
                hi = keep - 1
        if best is None:
            raise ContextBudgetError(
                f"even a truncated message does not fit the budget {budget}",
                prompt_tokens=total,
                budget=budget,
                n_ctx=budget + plan.reserve,
            )
        plan.truncated = True
        return best

    def _new_tokens(self, history: Sequence[Message], plan: ContextPlan) -> int:
        # Replies (and tool messages) stored since the last user message were never part of
        # a prompt; on the first turn everything is new.
        last_user = max((i for i, m in enumerate(history) if m.role == "user"), default=None)
        if last_user is None and not history:
            return plan.prompt_tokens
        since = history[last_user + 1 :] if last_user is not None else history
        new = plan.sections["new_message"] + sum(self.message_tokens(since))
        if since and since[0].role == "assistant" and last_user is not None:
            # The previous prompt already ended with the assistant header (the generation
            # prompt): those tokens were sent before.
            new -= self._generation_prompt_tokens()
        return new

    def _generation_prompt_tokens(self) -> int:
        if self._gen_prompt_tokens is None:
            self._gen_prompt_tokens = self.count_messages([_ANCHOR]) - self.count_messages(
                [_ANCHOR], add_generation_prompt=False
            )
        return self._gen_prompt_tokens

    def _sections(
        self,
        head: list[dict[str, Any]],
        summary: str | None,
        turns: Sequence[Sequence[Message]],
        total: int,
        reserve: int,
        assemble: Callable[..., list[dict[str, Any]]],
        new: dict[str, Any],
    ) -> dict[str, int]:
        # Prefix renders give exact section sizes that add up to the prompt's length.
        full = assemble(summary, turns, new)
        n_head = len(head)
        n_summary = n_head + (1 if summary else 0)
        n_history = len(full) - 1

        def upto(n: int) -> int:
            return self.count_messages(full[:n], add_generation_prompt=False) if n else 0

        system = upto(n_head)
        with_summary = upto(n_summary)
        with_history = upto(n_history)
        return {
            "system": system,
            "summary": with_summary - system,
            "history": with_history - with_summary,
            "new_message": total - with_history,
            "reserve": reserve,
        }


__all__ = ["BuildResult", "Codec", "ContextBuilder", "ContextPlan", "ContextState", "TokenCache"]
