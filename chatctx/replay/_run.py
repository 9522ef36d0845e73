"""Replaying logged conversations: teacher-forced, regenerated, or dry (tokenizer only).

Every mode runs one loop: each logged turn goes through a ``ChatSession``, so the context
plans, the stored rows and the totals are the same code. Dry runs load no weights: their
backend (``DryBackend``) computes the KV reuse with the engine's own planner over a simulated
cache, so their reused and evaluated token counts equal a teacher-forced run's (a test holds
them to it). Dry runs assume a model whose cache can shift and a spare unified sequence, as
chatctx sets up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chatctx._resource import Closeable
from chatctx.backends.base import Backend, Codec
from chatctx.backends.dry import DryBackend
from chatctx.context import BackgroundSummarizer, ContextPlan, summary_limit
from chatctx.errors import ChatctxError, ConfigError, ModelError
from chatctx.model.codec import open_codec
from chatctx.model.paths import resolve_model_path
from chatctx.monitor import totals
from chatctx.replay._input import LoggedConversation
from chatctx.session import ChatSession
from chatctx.settings import GenerationSettings, ReplayConfig
from chatctx.store import ReplayStore, Store, Turn


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
    generated_tokens: int = 0
    shift_count: int = 0
    summary_ms: float | None = None
    decode_tokens_per_s: float | None = None
    recalled: int = 0  # messages recalled into this turn's prompt
    recall_ms: float = 0.0  # the recall search and fit, when the turn searched


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
    """Totals of ``turns`` (``chatctx.monitor.totals``, as ``chatctx stats`` shows them) with
    the conversations' probes: fact retention in the context and in regenerated answers."""
    probes = sum(c.probes for c in conversations)
    answer_probes = sum(c.answer_probes for c in conversations)
    return (
        {"conversations": len(conversations)}
        | totals([_as_turn(t) for t in turns]).as_dict()
        | {
            "probes": probes,
            "fact_retention": sum(c.retained_in_context for c in conversations) / probes
            if probes
            else None,
            "answer_retention": sum(c.retained_in_answer for c in conversations) / answer_probes
            if answer_probes
            else None,
        }
    )


def _as_turn(t: TurnReport) -> Turn:
    """The figures of a stored turn record that ``totals`` reads, from a report row.

    Reports keep rows, not the records (whose plans cost ~3 KB a turn on big replays).
    """
    return Turn(
        id=t.turn,
        conversation_id=t.conversation,
        user_message_id=None,
        assistant_message_id=None,
        model=None,
        seq_id=0,
        n_ctx=0,
        prompt_tokens=t.prompt_tokens,
        reused_tokens=t.reused_tokens,
        evaluated_tokens=t.evaluated_tokens,
        generated_tokens=t.generated_tokens,
        prefill_ms=0.0,
        ttft_ms=t.ttft_ms,
        decode_tokens_per_s=t.decode_tokens_per_s,
        total_ms=0.0,
        stop_reason="",
        plan={"evicted": t.evicted},
        created_at=None,
        new_tokens=t.new_tokens,
        evicted_tokens=t.evicted_tokens,
        shifted_tokens=t.shifted_tokens,
        shift_count=t.shift_count,
        summary_ms=t.summary_ms,
    )


def _retained(fact: str, messages: Sequence[dict[str, Any]]) -> bool:
    needle = fact.casefold()
    return any(needle in str(m.get("content", "")).casefold() for m in messages)


class Replayer(Closeable):
    """Replays conversations under one configuration; reuse it for many conversations.

    Every mode runs the same loop: each logged turn goes through a ``ChatSession`` on an
    in-memory store. Teacher-forced and regenerating runs drive an ``Engine``; a dry run
    drives a ``DryBackend`` (the tokenizer and a simulated KV cache, no weights). Use as a
    context manager: a replayer owns the backend it made.
    """

    def __init__(
        self,
        config: ReplayConfig,
        *,
        model: str | Path | None = None,
        engine: Backend | None = None,
        codec: Codec | None = None,
        store: Callable[[str], Store] | None = None,
    ) -> None:
        self.config = config
        self.codec = codec
        # Each conversation's store: ``store(conversation_id)`` (it is closed after the
        # conversation); by default an in-memory ReplayStore.
        self._new_store = store
        backend: Backend
        if config.mode == "dry":
            if config.context.summarizer == "llm":
                raise ConfigError("--dry-run loads no model, so it cannot use the llm summarizer")
            path = engine.info().path if engine is not None else None
            if self.codec is None:
                if engine is not None:
                    self.codec = engine.codec()
                else:
                    path = resolve_model_path(model)
                    self.codec = self._dry_codec(path)
            elif path is None and model is not None:
                path = resolve_model_path(model)
            # The context a live run's engine would have: budget and reserve, padded to 256.
            backend = DryBackend(
                self.codec,
                n_ctx=config.budget + config.reserve_tokens,
                model_path=path,
                cache_edits="in-place" if config.simulate == "engine" else "deletions",
            )
            self._owns_backend = True
        elif engine is None:
            n_ctx = config.budget + config.reserve_tokens
            if config.context.summarizer == "llm":
                # The summary request shares the cells: make room for its input chunk (a
                # quarter of n_ctx, 128..1024, as ChatSession folds) and its output.
                written = summary_limit(config.context.summary_max_tokens, config.budget)
                while (
                    n_ctx - config.reserve_tokens - written - max(128, min(1024, n_ctx // 4))
                    < config.budget
                ):
                    n_ctx += 64
            from chatctx.backends.engine import Engine  # a live run: llama.cpp in this process

            backend = Engine.load(model, n_ctx=n_ctx, n_seq_max=2)
            self._owns_backend = True
        else:
            backend = engine
            self._owns_backend = False
        self._backend = backend

    @staticmethod
    def _dry_codec(path: Path) -> Codec:
        try:
            return open_codec(path)
        except ModelError:  # a vocabulary tiktoken cannot mirror: ask llama.cpp (vocab only)
            from chatctx.backends.engine import Engine

            with Engine.load(path, n_ctx=256) as engine:
                return engine.codec()

    def close(self) -> None:
        if self._owns_backend:
            self._backend.close()

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
        self._run(conversation.id, system, turns, asked, report, on_turn)
        return report

    def _run(
        self,
        cid: str,
        system: str | None,
        turns: list[tuple[str, list[dict[str, Any]]]],
        asked: dict[int, Any],
        report: ConversationReport,
        on_turn: Callable[[TurnReport], None] | None,
    ) -> None:
        backend = self._backend
        backend.clear()
        regenerate = self.config.mode == "regenerate"
        settings = GenerationSettings(max_tokens=self.config.max_tokens, temperature=0.0)
        with (
            self._new_store(cid) if self._new_store is not None else ReplayStore() as store,
            ChatSession.open(
                store,
                conversation_id=cid,
                model=backend,
                system_prompt=system,
                settings=settings,
                context=self.config.session_context(),
                claim_turns=False,  # a replay is the only writer of the conversations it makes
            ) as chat,
        ):
            for index, (user, logged) in enumerate(turns):
                if not self.config.back_to_back:
                    _let_summary_finish(chat)
                if regenerate:
                    reply = chat.send(user)
                else:
                    reply = chat.record_turn(user, logged or [{"role": "assistant", "content": ""}])
                built = chat.last_build
                assert built is not None and reply.turn is not None
                if index in asked:
                    fact = asked[index].fact
                    report.retained_in_context += _retained(fact, built.messages[:-1])
                    if regenerate:
                        report.answer_probes += 1
                        report.retained_in_answer += fact.casefold() in reply.text.casefold()
                turn = _turn_report(cid, index, built.plan, reply.turn)
                report.turns.append(turn)
                if on_turn is not None:
                    on_turn(turn)


def _let_summary_finish(chat: ChatSession) -> None:
    """Wait for a summary the session writes in the background (bounded by its deadline)."""
    summarizer = chat.builder().summarizer
    if isinstance(summarizer, BackgroundSummarizer) and summarizer.running():
        summarizer.wait(summarizer.timeout_s)


def _turn_report(cid: str, index: int, plan: ContextPlan, turn: Turn) -> TurnReport:
    return TurnReport(
        conversation=cid,
        turn=index + 1,
        prompt_tokens=turn.prompt_tokens,
        new_tokens=plan.new_tokens,
        reused_tokens=turn.reused_tokens,
        evaluated_tokens=turn.evaluated_tokens,
        evicted_tokens=turn.evicted_tokens or 0,
        shifted_tokens=turn.shifted_tokens or 0,
        ttft_ms=turn.ttft_ms,
        kept=len(plan.kept_ids),
        summarized=len(plan.summarized_ids),
        dropped=len(plan.dropped_ids),
        evicted=plan.evicted,
        summary_tokens=plan.sections.get("summary", 0),
        generated_tokens=turn.generated_tokens,
        shift_count=turn.shift_count or 0,
        summary_ms=turn.summary_ms,
        decode_tokens_per_s=turn.decode_tokens_per_s,
        recalled=len(plan.recalled_ids),
        recall_ms=plan.recall_ms,
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
