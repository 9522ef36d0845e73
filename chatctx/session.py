"""ChatSession: one persisted conversation driven through the llama.cpp engine.

::

    with ChatSession.open("sqlite:///bot.db", conversation_id="cust-42") as chat:
        reply = chat.send("My order 1234 has not arrived")
        for chunk in chat.stream("Can you check again?"):
            print(chunk, end="")
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import ValidationError

from chatctx.config import GenerationSettings
from chatctx.engine import Engine, GenerationResult, Timings, Usage
from chatctx.errors import ConfigError, ContextBudgetError
from chatctx.store import Message, Store, Turn

__all__ = ["ChatSession", "Reply"]

logger = logging.getLogger("chatctx.session")


@dataclass(frozen=True, slots=True)
class Reply:
    """The assistant's answer to one user message, with what it cost."""

    text: str
    user_message_id: int
    message_id: int | None  # None when an interrupted reply produced no text
    usage: Usage
    timings: Timings
    stop_reason: str
    turn: Turn | None


class ChatSession:
    """A conversation stored in a ``Store`` and answered by an ``Engine``.

    The user message is committed before generation starts; the assistant message when it
    ends, or marked ``partial`` if the reply is interrupted. Close the session (or use
    ``with``) to release what it opened; a store or engine passed in stays open.
    """

    def __init__(
        self,
        *,
        store: Store,
        engine: Engine,
        conversation_id: str,
        seq_id: int = 0,
        owns_store: bool = False,
        owns_engine: bool = False,
    ) -> None:
        self.store = store
        self.engine = engine
        self.conversation_id = conversation_id
        self.seq_id = seq_id
        self._owns_store = owns_store
        self._owns_engine = owns_engine
        self.last_reply: Reply | None = None

    @classmethod
    def open(
        cls,
        db: str | Store = "sqlite:///chatctx.db",
        *,
        conversation_id: str | None = None,
        model: str | Path | Engine | None = None,
        system_prompt: str | None = None,
        settings: GenerationSettings | Mapping[str, Any] | None = None,
        engine_options: Mapping[str, Any] | None = None,
        seq_id: int = 0,
    ) -> ChatSession:
        """Open (or create) a conversation.

        ``db`` is a SQLAlchemy URL or an open ``Store``. ``model`` is a GGUF path, a loaded
        ``Engine`` (shared, left open), or None for ``CHATCTX_MODEL`` / the embedded default.
        ``system_prompt`` and ``settings``, when given, are stored with the conversation.
        """
        generation = _settings(settings) if settings is not None else None
        owns_store = not isinstance(db, Store)
        store = Store(db) if isinstance(db, str) else db
        try:
            cid = conversation_id
            if cid is not None and store.has_conversation(cid):
                if system_prompt is not None or generation is not None:
                    stored = store.get_conversation(cid).settings
                    store.update_conversation(
                        cid,
                        system_prompt=system_prompt,
                        settings=None
                        if generation is None
                        else stored | {"generation": generation.model_dump()},
                    )
            else:
                cid = store.create_conversation(
                    cid,
                    system_prompt=system_prompt,
                    settings={"generation": (generation or GenerationSettings()).model_dump()},
                ).id
            owns_engine = not isinstance(model, Engine)
            engine = (
                model
                if isinstance(model, Engine)
                else Engine.load(model, **dict(engine_options or {}))
            )
        except BaseException:
            if owns_store:
                store.close()
            raise
        return cls(
            store=store,
            engine=engine,
            conversation_id=cid,
            seq_id=seq_id,
            owns_store=owns_store,
            owns_engine=owns_engine,
        )

    # lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # state --------------------------------------------------------------------------------

    @property
    def system_prompt(self) -> str | None:
        return self.store.get_conversation(self.conversation_id).system_prompt

    @property
    def settings(self) -> GenerationSettings:
        stored = self.store.get_conversation(self.conversation_id).settings
        return _settings(stored.get("generation") or {})

    def history(self) -> list[Message]:
        """Every stored message of this conversation, in order (never trimmed)."""
        return self.store.messages(self.conversation_id)

    def context_messages(self, new_message: str | None = None) -> list[dict[str, Any]]:
        """The messages sent to the model: system prompt, the whole history, the new one."""
        messages: list[dict[str, Any]] = []
        system = self.system_prompt
        if system:
            messages.append({"role": "system", "content": system})
        messages += [m.to_openai() for m in self.history()]
        if new_message is not None:
            messages.append({"role": "user", "content": new_message})
        return messages

    # chatting -----------------------------------------------------------------------------

    def send(self, text: str) -> Reply:
        """Send a user message and wait for the whole reply."""
        for _ in self.stream(text):
            pass
        assert self.last_reply is not None
        return self.last_reply

    def stream(self, text: str) -> Generator[str, None, None]:
        """Send a user message and yield the reply as it is generated.

        Raises ``ContextBudgetError`` before storing anything when the prompt cannot fit.
        """
        if not text.strip():
            raise ConfigError("empty message")
        settings = self.settings
        prompt = self.engine.prompt_tokens(self.context_messages(text))
        budget = self.engine.n_ctx - settings.max_tokens
        if len(prompt) > budget:
            raise ContextBudgetError(
                f"the conversation needs {len(prompt)} prompt tokens but the budget is {budget} "
                f"(n_ctx {self.engine.n_ctx} - max_tokens {settings.max_tokens}); nothing was "
                "sent or stored",
                prompt_tokens=len(prompt),
                budget=budget,
                n_ctx=self.engine.n_ctx,
            )
        return self._stream(text, prompt, settings)

    def _stream(
        self, text: str, prompt: list[int], settings: GenerationSettings
    ) -> Generator[str, None, None]:
        user = self.store.add_message(self.conversation_id, "user", text)
        generation = self.engine.generate(prompt, seq_id=self.seq_id, settings=settings)
        try:
            yield from generation
        finally:
            generation.close()
            self._finish(user, generation.result, prompt_tokens=len(prompt))

    def _finish(
        self, user: Message, result: GenerationResult | None, *, prompt_tokens: int
    ) -> None:
        if result is None:  # interrupted before the engine started
            return
        complete = result.stop_reason in ("eog", "length")
        assistant = None
        if result.text or complete:
            assistant = self.store.add_message(
                self.conversation_id,
                "assistant",
                result.text,
                status="complete" if complete else "partial",
            )
        turn = self.store.add_turn(
            self.conversation_id,
            user_message_id=user.id,
            assistant_message_id=assistant.id if assistant else None,
            model=str(self.engine.config.model_path.name),
            seq_id=self.seq_id,
            n_ctx=self.engine.n_ctx,
            prompt_tokens=result.usage.prompt_tokens,
            reused_tokens=result.usage.reused_tokens,
            evaluated_tokens=result.usage.evaluated_tokens,
            generated_tokens=result.usage.generated_tokens,
            prefill_ms=result.timings.prefill_ms,
            ttft_ms=result.timings.ttft_ms,
            decode_tokens_per_s=result.timings.decode_tokens_per_s,
            total_ms=result.timings.total_ms,
            stop_reason=result.stop_reason,
            plan={"policy": "full-history", "prompt_tokens": prompt_tokens},
        )
        self.last_reply = Reply(
            text=result.text,
            user_message_id=user.id,
            message_id=assistant.id if assistant else None,
            usage=result.usage,
            timings=result.timings,
            stop_reason=result.stop_reason,
            turn=turn,
        )
        logger.debug("turn %s: %s", turn.id, result.as_dict())


def _settings(value: GenerationSettings | Mapping[str, Any]) -> GenerationSettings:
    if isinstance(value, GenerationSettings):
        return value
    try:
        return GenerationSettings.model_validate(dict(value))
    except ValidationError as exc:
        raise ConfigError(f"invalid generation settings: {exc}") from exc
