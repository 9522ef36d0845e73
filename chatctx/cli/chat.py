"""``chatctx chat``: an interactive, streaming REPL over one stored conversation."""

from __future__ import annotations

import click
from rich.markup import escape

from chatctx.cli._common import (
    build_engine_options,
    console,
    db_option,
    engine_options,
    handle_errors,
    model_option,
    resolve_db,
    turn_figures,
)
from chatctx.cli._options import field_option
from chatctx.cli._signals import Interrupts, interruptible
from chatctx.errors import ContextBudgetError
from chatctx.session import ChatSession
from chatctx.settings import GenerationSettings

STORED = "Default: the conversation's stored setting."

HELP = """commands:
  /history   show the stored conversation
  /stats     figures of the last reply
  /help      this text
  /quit      leave (Ctrl-D also works; Ctrl-C interrupts a reply)"""


def _history(session: ChatSession) -> None:
    if session.system_prompt:
        console.print(f"[dim]system:[/dim] {escape(session.system_prompt)}")
    for m in session.history():
        flag = "" if m.status == "complete" else f" ({m.status})"
        console.print(f"[bold]{m.role}{flag}:[/bold] {escape(m.content)}")


@click.command()
@click.option(
    "--conversation",
    "-c",
    "conversation_id",
    default=None,
    help="Conversation id to continue or create (default: a new one).",
)
@click.option("--system", "system_prompt", default=None, help="System prompt to store.")
@field_option(GenerationSettings, "max_tokens", default=None, help_after=STORED)
@field_option(GenerationSettings, "temperature", default=None, help_after=STORED)
@db_option
@model_option
@engine_options
@handle_errors
def chat(
    conversation_id: str | None,
    system_prompt: str | None,
    max_tokens: int | None,
    temperature: float | None,
    db: str | None,
    model: str | None,
    n_ctx: int | None,
    n_gpu_layers: int | None,
    chat_format: str | None,
) -> None:
    """Chat with the model; the conversation is stored and can be continued later.

    Ctrl-C interrupts a reply and SIGTERM ends the program; either way the reply so far is
    stored with status ``partial``.
    """
    overrides = {
        k: v
        for k, v in {"max_tokens": max_tokens, "temperature": temperature}.items()
        if v is not None
    }
    with (
        interruptible() as interrupts,
        ChatSession.open(
            resolve_db(db),
            conversation_id=conversation_id,
            model=model,
            system_prompt=system_prompt,
            engine_options=build_engine_options(n_ctx, n_gpu_layers, chat_format),
        ) as session,
    ):
        if overrides:
            merged = session.conversation_settings().updated(generation=overrides)
            session.store.update_conversation(session.conversation_id, settings=merged.to_json())
        info = session.engine.info()
        console.print(
            f"[dim]conversation {session.conversation_id} · {info.path.name} · "
            f"n_ctx {info.n_ctx} · /help for commands[/dim]"
        )
        _repl(session, interrupts)


def _repl(session: ChatSession, interrupts: Interrupts) -> None:
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            break
        text = text.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/quit", "/exit"):
                break
            if command == "/history":
                _history(session)
            elif command == "/stats":
                if session.last_reply:
                    console.print(f"[dim]{turn_figures(session.last_reply)}[/dim]")
                else:
                    console.print("[dim]no reply yet[/dim]")
            else:
                click.echo(HELP)
            continue
        try:
            stream = session.stream(text)
        except ContextBudgetError as exc:
            console.print(f"[red]{escape(str(exc))}[/red]")
            continue
        try:
            for chunk in stream:
                click.echo(chunk, nl=False)
        except KeyboardInterrupt:
            click.echo(" [interrupted]", nl=False)
        finally:
            # Ends the reply through ChatSession's own path (stored as partial) on Ctrl-C,
            # on SIGTERM (Terminated passes through here) and on any error.
            stream.close()
        interrupts.rearm()
        click.echo()
        if session.last_reply:
            console.print(f"[dim]{turn_figures(session.last_reply)}[/dim]")
