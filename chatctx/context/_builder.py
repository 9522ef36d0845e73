"""The context builder: fit a conversation into a token budget, turn by whole turn.

Pure logic over messages, a codec (chat template + exact token counter) and a summarizer. It
never imports the engine and never changes the stored history: it decides what is sent.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from chatctx.backends.base import Codec, RenderedPrompt
from chatctx.context._abridge import CUT_ROOM, Cut, Cutter, abridge
from chatctx.context._facts import reads_as_english
from chatctx.context._layout import SUMMARY_HEADER, Block, next_blocks, render
from chatctx.context._recall import (
    RECALL_HEADER,
    RecallSearch,
    answers,
    asks_back,
    asks_only,
    drop_said,
    fit_recall,
    group_hits,
    is_question,
    known_text,
    marked,
    render_section,
    repeats,
    says_nothing,
    snippet,
    unsaid,
)
from chatctx.context._turns import group_turns, id_ranges
from chatctx.context.summarizers import ExtractiveSummarizer, Summarizer, summary_limit
from chatctx.errors import ConfigError, ContextBudgetError
from chatctx.model.kv import SERVER_MIN_CHUNK
from chatctx.settings import ContextSettings
from chatctx.store import Message

logger = logging.getLogger("chatctx.context")

TRUNCATION_MARKER = "\n[... {n} characters removed to fit the context ...]\n"
_ANCHOR = {"role": "system", "content": "."}
LAYOUTS = ("summary-first", "append", "abridge")
# The shortest cached run the abridge layout cuts for: llama-server's walk with chatctx's
# n_cache_reuse (``LlamaServerBackend.cache_reuse``).
ABRIDGE_MIN_CHUNK = SERVER_MIN_CHUNK
MAX_PENDING = 2000
# Where the cache cannot take new text in front of its runs, a cleared tool result keeps its
# start (enough to name the record: ``{"order_id": "A-1", "carrier": "GLS``): at most this
# many characters, cut after a letter or digit, the longest of the first tries the cache
# keeps as it is.
STUB_CHARS = 80
STUB_TRIES = 12
_WORD_END = re.compile(r"[^\W_](?=[\W_])")


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
    # Where each part of the summary is sent in the append layout (see ``_layout``); empty:
    # all of it up front.
    summary_blocks: tuple[Block, ...] = ()
    # The abridge layout: what of each evicted message is sent in its place (see ``_abridge``).
    abridged: tuple[Cut, ...] = ()
    # Tool results in the window sent as a stub: cleared to save room, for good.
    cleared_ids: tuple[int, ...] = ()


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
    summary_stopped: str | None = None  # why a summary covered only part of its messages
    summary_omitted: bool = False  # the summary was left out of this prompt to make room
    dropped_reason: str | None = None  # why ``dropped_ids`` are in no summary
    yielded: list[str] = field(default_factory=list)  # sections that gave up room, in order
    recalled_ids: list[int] = field(default_factory=list)  # best first
    recall_scores: list[float] = field(default_factory=list)  # for recalled_ids
    recall_ms: float = 0.0
    recall_error: str | None = None
    # The best match, when the prompt said all of it already: the rest recalled sentences only.
    recall_answered: int | None = None
    truncated: bool = False
    window_start: int = 0
    prompt_hash: str = ""
    build_ms: float = 0.0
    layout: str = "summary-first"
    # Where the kept turns begin in the prompt: after system, pinned and the summary sent in
    # front of them.
    history_start: int = 0
    tool_result_tokens: int = 0  # tool results sent whole (kept turns and the open one)
    tool_cleared_tokens: int = 0  # what the results cleared to stubs held
    cleared_ids: list[int] = field(default_factory=list)  # tool results cleared this turn

    def drop(self, ids: Sequence[int], reason: str) -> None:
        """List messages that no summary will cover, and why."""
        if not ids:
            return
        self.dropped_ids += list(ids)
        if self.dropped_reason is None:
            self.dropped_reason = reason
        elif reason not in self.dropped_reason:
            self.dropped_reason += f"; {reason}"

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
        recall: RecallSearch | None = None,
        clock: Callable[[], float] = time.perf_counter,
        layout: str | None = None,
        min_chunk: int = ABRIDGE_MIN_CHUNK,
        cache_edits: str = "in-place",
    ) -> None:
        """``lookup`` re-reads messages by id: those evicted earlier while summarizing failed
        are retried at the next eviction (the store's ``messages_by_ids``). ``recall`` searches
        the conversation's evicted messages (the store's ``search_messages``); without it
        nothing is recalled. ``clock`` times summaries against ``summary_timeout_s``.
        ``layout`` overrides ``settings.layout`` (a session resolves "auto" for its backend;
        "auto" here means summary-first). ``min_chunk``: the shortest cached run the backend's
        cache reuses, which the abridge layout cuts messages for. ``cache_edits``: what the
        backend's cache keeps of a changed prompt (``Backend.cache_edits``); a cleared tool
        result is a stub that says what was there where new text can go in front of cached
        runs ("in-place"), else its first words, a cut the cache keeps."""
        self.codec = codec
        self.lookup = lookup
        self.recall = recall
        self.settings = settings or ContextSettings()
        chosen = layout or self.settings.layout
        if chosen not in ("auto", *LAYOUTS):
            raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, not {chosen!r}")
        self.layout = chosen if chosen != "auto" else "summary-first"
        if self.layout == "abridge":
            if summarizer is not None and not isinstance(summarizer, ExtractiveSummarizer):
                raise ConfigError(
                    "the abridge layout keeps the sentences of the extractive summary's items; "
                    f"it cannot with {type(summarizer).__name__}: use layout append"
                )
            if lookup is None:
                raise ConfigError("the abridge layout re-reads evicted messages: give a lookup")
        self._cutter = Cutter(self._message_tokens, min_chunk)
        self.cache_edits = cache_edits
        self._stubs: dict[int, dict[str, Any] | None] = {}  # cleared results' stubs, by id
        self._evicted: dict[int, Message] = {}  # evicted messages read back, by id
        self.summarizer = summarizer
        self.cache = cache
        self._counts: dict[int, int] = {}
        self._clock = clock
        self._anchor_tokens: int | None = None
        self._gen_prompt_tokens: int | None = None
        self._system_overhead: int | None = None

    # counting -----------------------------------------------------------------------------

    def count_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        """Exact prompt tokens of ``messages`` rendered with the model's template."""
        return len(self._encode(messages, add_generation_prompt=add_generation_prompt, tools=tools))

    def _encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        if tools:  # only then: a codec without tool support still counts plain prompts
            rendered = self.codec.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        else:
            rendered = self.codec.render(messages, add_generation_prompt=add_generation_prompt)
        if not isinstance(rendered, RenderedPrompt):
            # A plain string does not say where message content lies: a user's
            # "<|eot_id|>" could become a control token and forge a turn.
            raise ConfigError(
                f"{type(self.codec).__name__}.render returned {type(rendered).__name__}, "
                "not a RenderedPrompt: message content could not be kept out of control "
                "tokens"
            )
        return self.codec.encode_prompt(rendered)

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
        return self.count_messages([_ANCHOR, message], add_generation_prompt=False) - self._anchor()

    def _anchor(self) -> int:
        """Tokens of the fixed system message messages are rendered after."""
        if self._anchor_tokens is None:
            self._anchor_tokens = self.count_messages([_ANCHOR], add_generation_prompt=False)
        return self._anchor_tokens

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
        open_turn: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> BuildResult:
        """Plan the prompt for ``new_message`` after ``history``.

        ``history`` holds the stored messages from ``state.window_start`` on (earlier ones are
        ignored); ``pinned`` messages always follow the system prompt. ``open_turn``: the
        assistant's tool calls and their results that follow ``new_message`` in a turn still
        open (they go with it, never evicted). ``tools``: OpenAI function tools the template
        writes into the prompt.
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
        cleared = set(state.cleared_ids)  # tool results sent as a stub
        names = _call_names(
            [*(m.tool_calls for m in window), *(m.get("tool_calls") for m in open_turn)]
        )
        new = [{"role": "user", "content": new_message}, *map(dict, open_turn)]

        def count(messages: Sequence[Mapping[str, Any]]) -> int:
            return self.count_messages(messages, tools=tools)

        # An addition to the summary written now is sent after the last message there is.
        after = history[-1].position if history else state.window_start - 1
        kinds: list[str] = []  # the section of each message of the last assemble()

        def assemble(
            summary: str | None,
            kept: Sequence[Sequence[Message]],
            last: Sequence[Mapping[str, Any]],
            recall: str | None = None,
        ) -> list[dict[str, Any]]:
            out = list(head)
            kinds[:] = ["system"] * len(head)
            if self.layout == "abridge":
                for cut, m in self._cut_pairs(abridged) if summary else ():
                    out.append({"role": m.role, "content": cut.text(m.content)})
                    kinds.append("summary")
            parts = render(summary, blocks, self.layout) if self.layout != "abridge" else []
            for turn in kept:
                for m in turn:
                    while parts and parts[0][0] < m.position:
                        out.append({"role": "system", "content": parts.pop(0)[1]})
                        kinds.append("summary")
                    out.append(self._stub(m, names) if m.id in cleared else m.to_openai())
                    kinds.append("history")
            for _, content in parts:
                out.append({"role": "system", "content": content})
                kinds.append("summary")
            if recall:
                out.append({"role": "system", "content": recall})
                kinds.append("recall")
            out += map(dict, last)
            kinds.extend(["new_message"] * len(last))
            return out

        summary = state.summary
        summary_tokens = state.summary_tokens
        blocks = state.summary_blocks
        abridged = state.abridged
        total = count(assemble(summary, turns, new))
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
        ready = getattr(self.summarizer, "ready", None)
        if pending and callable(ready) and ready():
            # A summary written in the background is done: it takes effect on this turn.
            summary, summary_tokens, pending, folded = self._summarize(plan, state, [], pending)
            if summary != state.summary:
                blocks = next_blocks(state.summary, blocks, summary, after)
                abridged = self._abridge(summary, abridged, folded, plan, budget)
            state = replace(
                state,
                summary=summary,
                summary_tokens=summary_tokens,
                pending_ids=tuple(pending),
                summary_blocks=blocks,
                abridged=abridged,
            )
            total = count(assemble(summary, turns, new))
            plan.prompt_tokens = total
        if total > high_limit and not trim:
            # Old tool results go first, in place: the call stays, the result becomes a stub.
            newly = self._clear(turns, open_turn, cleared, names, total - low_limit)
            if newly:
                plan.cleared_ids = newly
                plan.reason = f"prompt {total} tokens > high watermark {high_limit}: " + (
                    f"{len(newly)} old tool result(s) cleared"
                )
                total = count(assemble(summary, turns, new))
                plan.prompt_tokens = total
        evicted: list[Message] = []
        # A turn that asks back is owed its recall room: when the prompt leaves less than
        # recall_budget under the budget, the eviction the watermarks would make a few turns
        # later is made now, so the answer does not have to squeeze into what is left.
        recall_room = (
            not trim
            and total <= high_limit
            and budget - total < s.recall_budget
            and state.window_start > 0
            and bool(turns)
            and self._recalls(new_message) == "full"
        )
        if total > high_limit or recall_room:
            plan.evicted = True
            plan.reason = (
                f"prompt {total} tokens leaves {budget - total} < recall_budget "
                f"{s.recall_budget} for a message that asks back"
                if recall_room
                else f"prompt {total} tokens > high watermark {high_limit} "
                f"({s.high:.0%} of budget {budget})"
                if not trim
                else f"prompt {total} tokens > budget {budget}"
            )
            flat = self._window_tokens([m for turn in turns for m in turn], cleared, names)
            costs, offset = [], 0
            for turn in turns:
                costs.append(sum(flat[offset : offset + len(turn)]))
                offset += len(turn)
            excess = total - low_limit
            while turns and excess > 0:
                excess -= costs.pop(0)
                evicted += turns.pop(0)
            plan.evicted_ids = [m.id for m in evicted]
            summary, summary_tokens, pending, folded = self._summarize(
                plan, state, evicted, pending
            )
            if summary != state.summary:
                blocks = next_blocks(state.summary, blocks, summary, after)
                abridged = self._abridge(summary, abridged, folded, plan, budget)
            total = count(assemble(summary, turns, new))
            while total > budget and turns:  # the summary grew more than expected
                late = turns.pop(0)
                plan.evicted_ids += [m.id for m in late]
                if self._summarizing():
                    pending += [m.id for m in late]
                else:
                    plan.drop([m.id for m in late], "no summarizer")
                total = count(assemble(summary, turns, new))
        sent_summary = summary
        if total > budget and summary:
            # The summary is optional, the newest message is not: leave the summary out of
            # this prompt (it stays in the state and comes back when there is room).
            sent_summary = None
            plan.summary_omitted = True
            plan.yielded.append("summary")
            total = count(assemble(None, turns, new))
        if total > budget:
            new, total = self._oversized(assemble, sent_summary, new, total, budget, plan, count)
        window_start = state.window_start
        if plan.evicted:
            window_start = (
                turns[0][0].position
                if turns
                else (history[-1].position + 1 if history else state.window_start)
            )
        # Recall ranks below the summary: it only gets room the summary left (none when the
        # summary itself had to give way).
        room = 0 if plan.summary_omitted else min(s.recall_budget, budget - total)
        recalled = self._recall(
            plan,
            new_message,
            window_start,
            pinned_ids,
            cleared,
            end=history[-1].position + 1 if history else window_start,
            room=room,
            said=lambda: [str(m.get("content") or "") for m in assemble(sent_summary, turns, new)],
        )
        while True:
            recall_text = render_section([(m, t) for m, t, _ in recalled]) if recalled else None
            messages = assemble(sent_summary, turns, new, recall_text)
            tokens = self._encode(messages, tools=tools)
            # Per-message counts can differ from the whole prompt's by a merge at a boundary.
            if len(tokens) <= max(budget, total) or not recalled:
                break
            recalled.pop()
        assert len(tokens) == total or recall_text is not None
        total = len(tokens)
        plan.layout = self.layout
        plan.recalled_ids = [m.id for m, _, _ in recalled]
        plan.recall_scores = [round(score, 4) for _, _, score in recalled]
        plan.window_start = window_start
        plan.prompt_tokens = total
        plan.kept_ids = [m.id for turn in turns for m in turn]
        plan.sections, plan.history_start = self._sections(kinds, messages, total, reserve, tools)
        plan.new_tokens = self._new_tokens(history, plan, open_turn)
        results = [m for turn in turns for m in turn if m.role == "tool"]
        for m, n in zip(results, self.message_tokens(results), strict=True):
            if m.id in cleared:
                plan.tool_cleared_tokens += n
            else:
                plan.tool_result_tokens += n
        plan.tool_result_tokens += sum(self._delta(m) for m in open_turn if m.get("role") == "tool")
        plan.prompt_hash = hashlib.sha256(
            b"".join(t.to_bytes(4, "little") for t in tokens)
        ).hexdigest()[:16]
        plan.build_ms = (self._clock() - start) * 1000
        if len(pending) > MAX_PENDING:
            plan.drop(
                pending[:-MAX_PENDING],
                f"more than {MAX_PENDING} messages waited for a summary: the oldest are "
                "left out of it (they stay in the store and can be recalled)",
            )
            pending = pending[-MAX_PENDING:]
        new_state = ContextState(
            window_start=window_start,
            summary=summary,
            summary_tokens=summary_tokens,
            pending_ids=tuple(pending),
            summary_blocks=blocks if summary else (),
            abridged=abridged if summary else (),
            cleared_ids=tuple(sorted(cleared.intersection(plan.kept_ids))),
        )
        return BuildResult(
            plan=plan,
            messages=messages,
            tokens=tokens,
            state=new_state,
            fingerprint=self.codec.fingerprint,
        )

    def _section_tokens(self, chosen: Sequence[tuple[Message, str, float]]) -> int:
        text = render_section([(m, t) for m, t, _ in chosen])
        return self._delta({"role": "system", "content": text})

    def _section_cost(self) -> Callable[[str], int]:
        """Tokens a system message with this text adds: exact, or estimated when the codec
        can count plain text (a template render per candidate costs more than the search)."""
        exact: Callable[[str], int] = lambda text: self._delta(  # noqa: E731
            {"role": "system", "content": text}
        )
        count = getattr(self.codec, "count", None)
        if not callable(count):
            return exact
        if self._system_overhead is None:
            self._system_overhead = exact(RECALL_HEADER) - int(count(RECALL_HEADER))
        overhead = self._system_overhead
        return lambda text: overhead + int(count(text))

    def _summarizing(self) -> bool:
        return self.summarizer is not None and self.settings.summarizer != "none"

    def _recalls(self, message: str) -> str | None:
        """How this message recalls (settings and trigger): ``"full"``, owed a search and
        its room; ``"near"``, a question that does not ask back, with recall by meaning
        (cosine scores): only a match ``recall_near_similarity`` close; None: not at all."""
        s = self.settings
        if self.recall is None or not s.recall or s.recall_budget <= 0:
            return None
        if s.recall_trigger == "always":
            return "full"
        if s.recall_trigger == "any-question":
            return "full" if is_question(message) else None
        if asks_back(message):
            return "full"
        # Text the English cue words cannot read (another language) asks back by its
        # question mark, in whatever script; unmarked, it recalls what is near in meaning.
        english = reads_as_english(message)
        if not english and marked(message):
            return "full"
        near = (
            s.recall_near_similarity <= 1
            and getattr(self.recall, "by_meaning", False)
            and (is_question(message) or not english)
            and not says_nothing(message)  # "what?", "really?": close to any chat
        )
        return "near" if near else None

    def _recall(
        self,
        plan: ContextPlan,
        query: str,
        window_start: int,
        pinned_ids: set[int],
        cleared: set[int],
        *,
        end: int,
        room: int,
        said: Callable[[], list[str]],
    ) -> list[tuple[Message, str, float]]:
        """What to recall for this prompt: (message, text sent, score), best first. ``end``:
        the position after the last stored message (the kept ones, from ``window_start``, are
        searched too). ``said`` gives the rest of the prompt's texts, the new message last: a
        sentence they hold is not recalled again. ``cleared`` tool results are searched as
        the evicted messages are: the prompt holds only their stubs."""
        s, search = self.settings, self.recall
        mode = self._recalls(query)
        if search is None or (window_start <= 0 and not cleared) or mode is None:
            return []
        t0 = self._clock()
        try:
            # The kept messages are searched too: the best match may be one of them.
            kept = max(0, end - window_start)
            found = search(query, max(end, window_start), s.recall_k + len(pinned_ids) + kept)
            if mode == "near":  # only what is that close, not the rest of the hits with it,
                # and only what states something: an earlier question answers nothing
                found = [
                    (hit, score)
                    for hit, score in found
                    if score >= s.recall_near_similarity and not asks_only(hit.content)
                ]
        except Exception as exc:  # recall is optional: a failing search never fails a turn
            plan.recall_error = f"{type(exc).__name__}: {exc}"
            logger.warning("recall search failed, nothing recalled: %s", plan.recall_error)
            plan.recall_ms = (self._clock() - t0) * 1000
            return []
        hits = [
            h
            for h in group_hits(found)
            if h.message.id not in pinned_ids and not repeats(h.message, query)
        ]
        # The best match kept in the prompt: it holds what the question is most likely about,
        # and the evicted matches are a hedge (their closest sentences, as below).
        whole = mode == "full"

        def out_of_prompt(message: Message) -> bool:
            return message.position < window_start or message.id in cleared

        if hits and not out_of_prompt(hits[0].message):
            plan.recall_answered = hits[0].message.id
            whole = False
        hits = [h for h in hits if out_of_prompt(h.message)][: s.recall_k]
        if hits:
            *rest, asked = said()
            known = known_text(rest, asked)
            # The best match all said already (kept, cut down or in the summary): the prompt
            # holds what the question is most likely about, and the other matches are a
            # hedge; they get their closest sentences, not whole messages and replies.
            if plan.recall_answered is None and unsaid(hits[0].message, known) is None:
                plan.recall_answered = hits[0].message.id
                whole = False
            hits = drop_said(hits, known)
        # An earlier question states nothing: its reply is what answers (``answers``).
        hits = answers(hits)
        pick = getattr(self.recall, "snippet", snippet)  # a search may rank sentences itself
        # A question that does not ask back gets the sentences that matched, not whole
        # messages and their replies: it is owed no recall room, only what is that close.
        chosen = fit_recall(hits, query, room, self._section_cost(), pick, whole=whole)
        # The choice used an estimate; the section's exact cost decides.
        while chosen and self._section_tokens(chosen) > room:
            chosen.pop()
        sent = {m.id for m, _, _ in chosen}
        if hits and room < s.recall_budget and any(h.message.id not in sent for h in hits):
            plan.yielded.insert(0, "recall")  # recall gives way first
        plan.recall_ms = (self._clock() - t0) * 1000
        return chosen

    # clearing old tool results ------------------------------------------------------------

    def _stub(self, message: Message, names: Mapping[str, str]) -> dict[str, Any]:
        """What a cleared tool result is sent as (``_stub_for``; a result is cleared only
        when it has one)."""
        stub = self._stub_for(message, names)
        assert stub is not None
        return stub

    def _stub_for(self, message: Message, names: Mapping[str, str]) -> dict[str, Any] | None:
        """What a cleared tool result is sent as: what was there, not what it said. Where
        the cache cannot take new text in front of cached runs (llama-server), its first
        words instead, a cut of the result the cache keeps as it is; None when none is."""
        if message.id in self._stubs:
            return self._stubs[message.id]
        call_id = message.tool_call_id or "?"
        stub: dict[str, Any] | None = {"role": "tool", "tool_call_id": message.tool_call_id}
        if self.cache_edits == "in-place":
            size = self.message_tokens([message])[0]
            text = (
                f"[result of {names.get(call_id, 'a tool')} ({call_id}) cleared to save room: "
                f"{size} tokens, kept in the conversation's store]"
            )
        else:
            text = self._first_words(message.content) or ""
            if not text:
                stub = None
        if stub is not None:
            stub["content"] = text
        self._stubs[message.id] = stub
        return stub

    def _first_words(self, content: str) -> str | None:
        """The longest start of ``content`` (up to ``STUB_CHARS`` characters, ending after a
        letter or digit, where tokens split) that a cache holding the whole of it keeps as
        it is (``Cutter.keeps``)."""
        ends = [
            m.end()
            for m in _WORD_END.finditer(content, 0, STUB_CHARS)
            if m.end() < len(content) - 1
        ]
        for end in sorted(ends, reverse=True)[:STUB_TRIES]:
            if self._cutter.keeps("tool", content, content[:end]):
                return content[:end]
        return None

    def _window_tokens(
        self, messages: Sequence[Message], cleared: set[int], names: Mapping[str, str]
    ) -> list[int]:
        """Tokens each message adds as it is sent (a cleared result: its stub's)."""
        counts = self.message_tokens(messages)
        return [
            self._delta(self._stub(m, names)) if m.id in cleared else n
            for m, n in zip(messages, counts, strict=True)
        ]

    def _clear(
        self,
        turns: Sequence[Sequence[Message]],
        open_turn: Sequence[Mapping[str, Any]],
        cleared: set[int],
        names: Mapping[str, str],
        excess: int,
    ) -> list[int]:
        """Clear the oldest tool results (all but the newest ``tool_results_keep``, each at
        least ``tool_result_clear_min`` tokens) until about ``excess`` tokens are saved; the
        ids cleared (added to ``cleared``)."""
        s = self.settings
        if s.tool_results_keep is None:
            return []
        results = [m for turn in turns for m in turn if m.role == "tool"]
        keep = max(0, s.tool_results_keep - sum(m.get("role") == "tool" for m in open_turn))
        old = results[: len(results) - keep] if keep else results
        candidates = [
            m for m in old if m.id not in cleared and self._stub_for(m, names) is not None
        ]
        newly: list[int] = []
        for m, n in zip(candidates, self.message_tokens(candidates), strict=True):
            if excess <= 0:
                break
            if n < s.tool_result_clear_min:
                continue
            cleared.add(m.id)
            newly.append(m.id)
            excess -= n - self._delta(self._stub(m, names))
        return newly

    def _summarize(
        self, plan: ContextPlan, state: ContextState, evicted: list[Message], pending: list[int]
    ) -> tuple[str | None, int, list[int], list[Message]]:
        """Fold what waits into the summary: (summary, its tokens, ids still waiting, the
        messages folded in).

        One deadline (``summary_timeout_s``) covers the whole fold. A summarizer with a
        ``fold`` method (the LLM one) stops at the deadline and keeps what it finished: the
        messages it did not reach stay pending and are retried, from there, at the next
        eviction. A plain callable's result is kept however long it took.
        """
        if not self._summarizing():
            plan.drop([m.id for m in evicted], "no summarizer")
            return state.summary, state.summary_tokens, [], []
        assert self.summarizer is not None
        if not evicted and not pending:
            return state.summary, state.summary_tokens, pending, []
        # Messages evicted earlier while summarizing failed are retried with the new ones.
        earlier: list[Message] = []
        if pending:
            if self.lookup is not None:
                earlier = self.lookup(pending)
            else:
                plan.drop(pending, "no lookup to re-read messages waiting for a summary")
        todo = earlier + evicted
        timeout = self.settings.summary_timeout_s
        t0 = self._clock()
        stopped: str | None = None
        try:
            fold = getattr(self.summarizer, "fold", None)
            if callable(fold):
                text, covered_ids, stopped = fold(
                    state.summary, todo, deadline=t0 + timeout, clock=self._clock
                )
                covered = set(covered_ids)
            else:
                text = self.summarizer(state.summary, todo)
                covered = {m.id for m in todo}
            text = (text or "").strip()
        except Exception as exc:
            plan.summary_ms = (self._clock() - t0) * 1000
            plan.summary_error = f"{type(exc).__name__}: {exc}"
            logger.warning("summary not updated, the previous one stays: %s", plan.summary_error)
            return state.summary, state.summary_tokens, [m.id for m in todo], []
        elapsed = self._clock() - t0
        plan.summary_ms = elapsed * 1000
        if elapsed > timeout and stopped is None:
            logger.warning("summarizer took %.1f s (limit %.0f s); kept", elapsed, timeout)
        left = [m.id for m in todo if m.id not in covered]
        if stopped is not None:
            plan.summary_stopped = stopped
            logger.info(
                "summary covers %d of %d messages (%s); the rest waits",
                len(todo) - len(left),
                len(todo),
                stopped,
            )
        plan.summarized_ids += [m.id for m in todo if m.id in covered]
        # "Nothing new to add" is a result: the previous summary (or none) stays.
        folded = [m for m in todo if m.id in covered]
        if not text or text == state.summary:
            return state.summary, state.summary_tokens, left, folded
        plan.summary_changed = True
        tokens = self.count_messages(
            [{"role": "system", "content": SUMMARY_HEADER + text}], add_generation_prompt=False
        )
        return text, tokens, left, folded

    def _abridge(
        self,
        summary: str | None,
        cuts: Sequence[Cut],
        folded: Sequence[Message],
        plan: ContextPlan,
        budget: int,
    ) -> tuple[Cut, ...]:
        """The abridge layout's cuts for a changed summary: of the messages cut so far and
        those folded into it that this prompt evicts. One evicted earlier (folded late, after
        a failed or pending summary) is no longer in the cache: sent again, it would be text
        inserted in front of cached runs, so only the summary keeps what it said."""
        if self.layout != "abridge":
            return ()
        now = set(plan.evicted_ids)
        for m in folded:
            self._evicted[m.id] = m
        known = {c.message_id for c in cuts}
        messages = [m for _, m in self._cut_pairs(cuts)]
        messages += [m for m in folded if m.id not in known and m.id in now]
        messages.sort(key=lambda m: m.position)
        return abridge(
            summary,
            messages,
            self._cutter,
            previous=cuts,
            cost=lambda m, text: self._delta({"role": m.role, "content": text}),
            # As the summary: at most 60% of the budget, so that evicting still frees room.
            limit=min(
                int(summary_limit(self.settings.summary_max_tokens, budget) * CUT_ROOM),
                budget * 3 // 5,
            ),
        )

    def _cut_pairs(self, cuts: Sequence[Cut]) -> list[tuple[Cut, Message]]:
        """Each cut with the evicted message it is of (read back once; one deleted since
        is left out)."""
        missing = [c.message_id for c in cuts if c.message_id not in self._evicted]
        if missing and self.lookup is not None:
            for m in self.lookup(missing):
                self._evicted[m.id] = m
        return [(c, self._evicted[c.message_id]) for c in cuts if c.message_id in self._evicted]

    def _message_tokens(self, role: str, content: str) -> list[int]:
        """The tokens one message adds to a prompt (after a fixed system message)."""
        message = {"role": role, "content": content}
        return self._encode([_ANCHOR, message], add_generation_prompt=False)[self._anchor() :]

    def _oversized(
        self,
        assemble: Callable[..., list[dict[str, Any]]],
        summary: str | None,
        new: list[dict[str, Any]],
        total: int,
        budget: int,
        plan: ContextPlan,
        count: Callable[[Sequence[Mapping[str, Any]]], int],
    ) -> tuple[list[dict[str, Any]], int]:
        """The newest message cut in its middle until the prompt fits (the rest of an open
        turn, tool calls and results, is kept whole)."""
        fixed = count(assemble(summary, [], [{"role": "user", "content": ""}, *new[1:]]))
        message = total - fixed
        if not self.settings.truncate_oversized or fixed >= budget:
            raise ContextBudgetError(
                f"the newest message does not fit: system, pinned and summary take {fixed} "
                f"tokens, the new message {message}, together {total} > budget {budget}",
                prompt_tokens=total,
                budget=budget,
                n_ctx=budget + plan.reserve,
            )
        content = str(new[0]["content"])
        lo, hi = 0, len(content)  # characters kept
        best: tuple[list[dict[str, Any]], int] | None = None
        while lo <= hi:
            keep = (lo + hi) // 2
            cut = (
                content[: keep - keep // 2]
                + TRUNCATION_MARKER.format(n=len(content) - keep)
                + content[len(content) - keep // 2 :]
            )
            candidate = [{"role": "user", "content": cut}, *new[1:]]
            n = count(assemble(summary, [], candidate))
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

    def _new_tokens(
        self,
        history: Sequence[Message],
        plan: ContextPlan,
        open_turn: Sequence[Mapping[str, Any]] = (),
    ) -> int:
        # Replies (and tool messages) stored since the last user message were never part of
        # a prompt; on the first turn everything is new. In an open turn the user message and
        # the calls before the newest results were: the previous step's prompt and output.
        if open_turn:
            results = len(open_turn) - next(
                (i for i, m in enumerate(reversed(open_turn)) if m.get("role") != "tool"),
                len(open_turn),
            )
            return (
                plan.sections["recall"]
                + sum(self._delta(m) for m in open_turn[len(open_turn) - results :])
                + self._generation_prompt_tokens()
            )
        last_user = max((i for i, m in enumerate(history) if m.role == "user"), default=None)
        if last_user is None and not history:
            return plan.prompt_tokens
        since = history[last_user + 1 :] if last_user is not None else history
        # Recalled text is new too: it was never at this place in a prompt.
        new = plan.sections["new_message"] + plan.sections["recall"]
        new += sum(self.message_tokens(since))
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
        kinds: Sequence[str],
        full: list[dict[str, Any]],
        total: int,
        reserve: int,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[dict[str, int], int]:
        """Exact section sizes that add up to the prompt's length (from prefix renders, one
        where the section changes), and where the first kept turn begins."""

        def upto(n: int) -> int:
            # n == 0 still counts: a template may open every prompt with BOS.
            return self.count_messages(full[:n], add_generation_prompt=False, tools=tools)

        sections = dict.fromkeys(("system", "summary", "history", "recall", "new_message"), 0)
        n_head = sum(1 for kind in kinds if kind == "system")
        at = sections["system"] = upto(n_head)
        history_start = None
        i = n_head
        while i < len(kinds):
            j = i
            while j < len(kinds) and kinds[j] == kinds[i]:
                j += 1
            if history_start is None and kinds[i] != "summary":
                history_start = at
            end = total if j == len(kinds) else upto(j)
            sections[kinds[i]] += end - at
            at, i = end, j
        sections["reserve"] = reserve
        return sections, at if history_start is None else history_start


def _call_names(calls: Iterable[Sequence[Any] | None]) -> dict[str, str]:
    """Each call id's function name, from the ``tool_calls`` of the messages that made them."""
    names: dict[str, str] = {}
    for made in calls:
        for call in made or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping) and isinstance(call.get("id"), str):
                names[call["id"]] = str(function.get("name"))
    return names
