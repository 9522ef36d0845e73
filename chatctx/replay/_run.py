"""Replaying logged conversations: teacher-forced, regenerated, or dry (tokenizer only).

Dry runs load no weights: the context plans come from the same builder, and the KV reuse is
computed with the engine's own planner (``plan_reuse``) over a simulated cache, so their reused
and evaluated token counts equal a teacher-forced run's (a test holds them to it). Dry runs
assume a model whose cache can shift and a spare unified sequence, as chatctx sets up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from chatctx._resource import Closeable
from chatctx.config import ContextSettings, GenerationSettings, _Model
from chatctx.context import ContextBuilder, ContextPlan, ContextState, summarizer_for, summary_limit
from chatctx.engine import Engine, plan_reuse
from chatctx.engine._codec import PromptCodec, open_codec
from chatctx.errors import ChatctxError, ConfigError, ModelError
from chatctx.monitor import percentile
from chatctx.replay._input import LoggedConversation
from chatctx.session import ChatSession
from chatctx.store import Message, Store

Mode = Literal["teacher", "regenerate", "dry"]


class ReplayConfig(_Model):
    """How logged conversations are replayed."""

    mode: Mode = Field("teacher", description="teacher-forced, regenerate, or dry (no model).")
    budget: int = Field(1024, ge=32, description="Prompt token budget.")
    reserve: int | None = Field(None, ge=0, description="Reply reserve; None = 16 or max_tokens.")
    policy: Literal["watermarks", "trim-every-turn"] = Field("watermarks", description="Policy.")
    high: float = Field(1.0, gt=0, le=1, description="High watermark (share of budget).")
    low: float = Field(0.6, gt=0, le=1, description="Low watermark (share of budget).")
    eviction: Literal["shift", "recompute"] = Field("shift", description="KV eviction policy.")
    summarizer: Literal["extractive", "llm", "none"] = Field("extractive", description="Summary.")
    max_turns: int | None = Field(None, ge=1, description="Replay at most this many user turns.")
    system: str | None = Field(None, description="System prompt replacing the logged one.")
    max_tokens: int = Field(128, ge=1, description="Longest regenerated reply.")
    recall: bool = Field(True, description="Recall evicted messages matching the new one.")
    recall_budget: int = Field(160, ge=0, description="Most tokens of recalled messages.")
    recall_k: int = Field(5, ge=1, le=50, description="Most messages recalled per turn.")
    recall_trigger: Literal["question", "always"] = Field(
        "question", description="Recall for questions only, or for every message."
    )

    def context(self) -> ContextSettings:
        return ContextSettings(
            policy=self.policy,
            budget=self.budget,
            reserve=self.reserve_tokens,
            high=self.high,
            low=self.low,
            eviction=self.eviction,
            summarizer=self.summarizer,
            recall=self.recall,
            recall_budget=self.recall_budget,
            recall_k=self.recall_k,
            recall_trigger=self.recall_trigger,
        )

    @property
    def reserve_tokens(self) -> int:
        if self.reserve is not None:
            return self.reserve
        return self.max_tokens if self.mode == "regenerate" else 16


@dataclass(frozen=True, slots=True)
class TurnReport:
    conversation: str
    turn: int  # 1-based user turn
    prompt_tokens: int
    new_tokens: int
    reused_tokens: int
    evaluated_tokens: int
    evicted_tokens: int
    shifted_tokens: int
    ttft_ms: float | None
    kept: int
    summarized: int
    dropped: int
    evicted: bool
    summary_tokens: int


@dataclass(slots=True)
class ConversationReport:
    conversation: str
    turns: list[TurnReport] = field(default_factory=list)
    probes: int = 0
    retained_in_context: int = 0
    retained_in_answer: int = 0
    answer_probes: int = 0

    def summary(self) -> dict[str, Any]:
        return summarize(self.turns, [self]) | {"conversation": self.conversation}


def summarize(
    turns: Sequence[TurnReport], conversations: Sequence[ConversationReport]
) -> dict[str, Any]:
    """Totals: prefill amplification, cache hit ratio, evictions, TTFT, fact retention."""
    prompt = sum(t.prompt_tokens for t in turns)
    new = sum(t.new_tokens for t in turns)
    evaluated = sum(t.evaluated_tokens for t in turns)
    ttfts = [t.ttft_ms for t in turns if t.ttft_ms is not None]
    probes = sum(c.probes for c in conversations)
    answer_probes = sum(c.answer_probes for c in conversations)
    return {
        "conversations": len(conversations),
        "turns": len(turns),
        "prompt_tokens": prompt,
        "new_tokens": new,
        "evaluated_tokens": evaluated,
        "reused_tokens": sum(t.reused_tokens for t in turns),
        "prefill_amplification": evaluated / new if new else None,
        "cache_hit_ratio": sum(t.reused_tokens for t in turns) / prompt if prompt else None,
        "evictions": sum(t.evicted for t in turns),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p95_ms": percentile(ttfts, 95),
        "probes": probes,
        "fact_retention": sum(c.retained_in_context for c in conversations) / probes
        if probes
        else None,
        "answer_retention": sum(c.retained_in_answer for c in conversations) / answer_probes
        if answer_probes
        else None,
    }


def _retained(fact: str, messages: Sequence[dict[str, Any]]) -> bool:
    needle = fact.casefold()
    return any(needle in str(m.get("content", "")).casefold() for m in messages)


class Replayer(Closeable):
    """Replays conversations under one configuration; reuse it for many conversations.

    Use as a context manager: a teacher-forced or regenerating replayer owns an engine.
    """

    def __init__(
        self,
        config: ReplayConfig,
        *,
        model: str | Path | None = None,
        engine: Engine | None = None,
        codec: PromptCodec | None = None,
    ) -> None:
        self.config = config
        self._engine = engine
        self._owns_engine = False
        self.codec = codec
        if config.mode == "dry":
            if config.summarizer == "llm":
                raise ConfigError("--dry-run loads no model, so it cannot use the llm summarizer")
            if self.codec is None:
                self.codec = engine.codec() if engine is not None else self._dry_codec(model)
        elif self._engine is None:
            n_ctx = config.budget + config.reserve_tokens
            if config.summarizer == "llm":
                # The summary request shares the cells: make room for its input chunk (a
                # quarter of n_ctx, 128..1024, as ChatSession folds) and its output.
                written = summary_limit(ContextSettings().summary_max_tokens, config.budget)
                while (
                    n_ctx - config.reserve_tokens - written - max(128, min(1024, n_ctx // 4))
                    < config.budget
                ):
                    n_ctx += 64
            self._engine = Engine.load(model, n_ctx=n_ctx, n_seq_max=2)
            self._owns_engine = True

    @staticmethod
    def _dry_codec(model: str | Path | None) -> PromptCodec:
        from chatctx.engine import resolve_model_path

        path = resolve_model_path(model)
        try:
            return open_codec(path)
        except ModelError:  # a vocabulary tiktoken cannot mirror: ask llama.cpp (vocab only)
            with Engine.load(path, n_ctx=256) as engine:
                return engine.codec()

    def close(self) -> None:
        if self._owns_engine and self._engine is not None:
            self._engine.close()

    def replay(
        self, conversation: LoggedConversation, on_turn: Callable[[TurnReport], None] | None = None
    ) -> ConversationReport:
        turns = conversation.turns()[: self.config.max_turns]
        system = (
            self.config.system if self.config.system is not None else (conversation.system_prompt)
        )
        report = ConversationReport(conversation=conversation.id)
        asked = {p.asked_turn: p for p in conversation.probes if p.asked_turn < len(turns)}
        report.probes = len(asked)
        if self.config.mode == "dry":
            self._dry(conversation.id, system, turns, asked, report, on_turn)
        else:
            self._live(conversation.id, system, turns, asked, report, on_turn)
        return report

    def _record(
        self,
        report: ConversationReport,
        on_turn: Callable[[TurnReport], None] | None,
        turn: TurnReport,
    ) -> None:
        report.turns.append(turn)
        if on_turn is not None:
            on_turn(turn)

    def _live(
        self,
        cid: str,
        system: str | None,
        turns: list[tuple[str, list[dict[str, Any]]]],
        asked: dict[int, Any],
        report: ConversationReport,
        on_turn: Callable[[TurnReport], None] | None,
    ) -> None:
        engine = self._engine
        assert engine is not None
        engine.clear()
        settings = GenerationSettings(max_tokens=self.config.max_tokens, temperature=0.0)
        with (
            Store("sqlite://") as store,
            ChatSession.open(
                store,
                conversation_id=cid,
                model=engine,
                system_prompt=system,
                settings=settings,
                context=self.config.context(),
            ) as chat,
        ):
            for index, (user, logged) in enumerate(turns):
                if self.config.mode == "regenerate":
                    reply = chat.send(user)
                else:
                    reply = chat.record_turn(user, logged or [{"role": "assistant", "content": ""}])
                built = chat.last_build
                assert built is not None and reply.turn is not None
                if index in asked:
                    fact = asked[index].fact
                    report.retained_in_context += _retained(fact, built.messages[:-1])
                    if self.config.mode == "regenerate":
                        report.answer_probes += 1
                        report.retained_in_answer += fact.casefold() in reply.text.casefold()
                t = reply.turn
                plan = built.plan
                self._record(
                    report,
                    on_turn,
                    _turn_report(
                        cid,
                        index,
                        plan,
                        reused=t.reused_tokens,
                        evicted=t.evicted_tokens or 0,
                        shifted=t.shifted_tokens or 0,
                        ttft_ms=t.ttft_ms,
                    ),
                )

    def _dry(
        self,
        cid: str,
        system: str | None,
        turns: list[tuple[str, list[dict[str, Any]]]],
        asked: dict[int, Any],
        report: ConversationReport,
        on_turn: Callable[[TurnReport], None] | None,
    ) -> None:
        from sqlalchemy import insert  # local: only dry runs write rows this way

        from chatctx.store._models import MessageRow

        codec = self.codec
        assert codec is not None
        settings = self.config.context()
        # The history lives in an in-memory store, as a live run's does: recall searches it
        # with the same full-text index. Rows go in with one plain INSERT per turn (the ORM
        # path costs more than the rest of a dry turn); the triggers index them all the same.
        with Store("sqlite://") as store:
            store.create_conversation(cid)
            history: list[Message] = []

            def add(messages: Sequence[dict[str, Any]]) -> None:
                new = [
                    Message(
                        id=len(history) + n + 1,
                        conversation_id=cid,
                        position=len(history) + n,
                        role=m["role"],
                        content=m["content"],
                        name=m.get("name"),
                        tool_call_id=m.get("tool_call_id"),
                        tool_calls=m.get("tool_calls"),
                    )
                    for n, m in enumerate(messages)
                ]
                with store.engine.begin() as connection:
                    connection.execute(
                        insert(MessageRow),
                        [
                            {
                                "id": m.id,
                                "conversation_id": cid,
                                "position": m.position,
                                "role": m.role,
                                "content": m.content,
                                "name": m.name,
                                "tool_call_id": m.tool_call_id,
                                "tool_calls": m.tool_calls,
                            }
                            for m in new
                        ],
                    )
                history.extend(new)

            builder = ContextBuilder(
                codec,
                settings,
                summarizer=summarizer_for(
                    settings.summarizer,
                    count=codec.count,
                    max_tokens=settings.summary_max_tokens,
                    budget=self.config.budget,
                ),
                lookup=store.messages_by_ids,
                recall=lambda query, before, limit: store.search_messages(
                    cid, query, before_position=before, limit=limit, replies=True
                ),
            )
            state = ContextState()
            cache: list[int] = []
            for index, (user, logged) in enumerate(turns):
                window = [m for m in history if m.position >= state.window_start]
                built = builder.build(
                    system_prompt=system,
                    history=window,
                    new_message=user,
                    budget=self.config.budget,
                    reserve=self.config.reserve_tokens,
                    state=state,
                )
                plan = built.plan
                reuse = plan_reuse(cache, built.tokens, history_start=plan.history_start)
                shifted = 0
                if self.config.eviction == "shift" and reuse.chunk is not None:
                    reused = reuse.prefix + reuse.chunk_len
                    shifted = reuse.chunk_len if reuse.delta else 0
                else:
                    reused = reuse.prefix
                evicted = len(cache) - reused
                cache = list(built.tokens)  # a teacher-forced prefill leaves exactly the prompt
                state = built.state
                if index in asked:
                    report.retained_in_context += _retained(asked[index].fact, built.messages[:-1])
                add(
                    [
                        {"role": "user", "content": user},
                        *(logged or [{"role": "assistant", "content": ""}]),
                    ]
                )
                self._record(
                    report,
                    on_turn,
                    _turn_report(
                        cid,
                        index,
                        plan,
                        reused=reused,
                        evicted=evicted,
                        shifted=shifted,
                        ttft_ms=None,
                    ),
                )


def _turn_report(
    cid: str,
    index: int,
    plan: ContextPlan,
    *,
    reused: int,
    evicted: int,
    shifted: int,
    ttft_ms: float | None,
) -> TurnReport:
    return TurnReport(
        conversation=cid,
        turn=index + 1,
        prompt_tokens=plan.prompt_tokens,
        new_tokens=plan.new_tokens,
        reused_tokens=reused,
        evaluated_tokens=plan.prompt_tokens - reused,
        evicted_tokens=evicted,
        shifted_tokens=shifted,
        ttft_ms=ttft_ms,
        kept=len(plan.kept_ids),
        summarized=len(plan.summarized_ids),
        dropped=len(plan.dropped_ids),
        evicted=plan.evicted,
        summary_tokens=plan.sections.get("summary", 0),
    )


def replay_all(
    replayer: Replayer,
    conversations: Iterable[LoggedConversation],
    *,
    on_turn: Callable[[TurnReport], None] | None = None,
    on_conversation: Callable[[ConversationReport], None] | None = None,
    errors: list[str] | None = None,
    on_error: str = "fail",
) -> list[ConversationReport]:
    """Replay every conversation; with ``on_error="skip"`` a failing one is reported, not fatal.

    Reports gathered before a failure are kept in the returned list (and passed to
    ``on_conversation``) even when the failure is raised. A failure is reported as
    ``FILE:LINE: ID: reason``; an unexpected exception (a bug that a logged conversation
    reached) is reported the same way, as ``internal error``, with its traceback logged to
    ``chatctx.replay``, so that one conversation never ends a batch with a traceback.
    Errors raised while reading ``conversations`` (``ImportFormatError``) pass through.
    """
    import logging  # only for the rare internal error; keeps this function self-contained

    reports: list[ConversationReport] = []
    for conversation in conversations:
        cid = conversation.id if conversation.id.isprintable() else ascii(conversation.id)
        where = f"{conversation.source}:{conversation.line}: {cid}"
        try:
            report = replayer.replay(conversation, on_turn=on_turn)
        except Exception as exc:
            if isinstance(exc, ChatctxError):
                message = f"{where}: {exc}"
            else:
                logging.getLogger("chatctx.replay").error("%s: internal error", where, exc_info=exc)
                message = f"{where}: internal error ({type(exc).__name__}: {exc})"
            if on_error != "skip":
                raise ChatctxError(message) from exc
            if errors is not None:
                errors.append(message)
            continue
        reports.append(report)
        if on_conversation is not None:
            on_conversation(report)
    return reports


def turn_rows(reports: Sequence[ConversationReport]) -> list[dict[str, Any]]:
    return [asdict(t) for r in reports for t in r.turns]
