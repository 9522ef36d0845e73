"""``chatctx conversations``: list, show, export and import stored conversations."""

from __future__ import annotations

import sys
from dataclasses import asdict

import click
from rich.markup import escape
from rich.table import Table

from chatctx.cli._common import (
    console,
    db_option,
    handle_errors,
    json_option,
    print_json,
    resolve_db,
)
from chatctx.errors import ImportFormatError
from chatctx.store import Store, export_conversation, export_jsonl, import_records, read_jsonl


@click.group()
def conversations() -> None:
    """List, show, export and import conversations."""


@conversations.command("list")
@db_option
@json_option
@handle_errors
def list_command(db: str | None, as_json: bool) -> None:
    """List conversations, most recently updated first."""
    with Store(resolve_db(db)) as store:
        items = store.list_conversations()
    if as_json:
        print_json(
            [
                {
                    "id": c.id,
                    "title": c.title,
                    "messages": c.message_count,
                    "updated_at": c.updated_at,
                    "created_at": c.created_at,
                }
                for c in items
            ]
        )
        return
    if not items:
        click.echo("no conversations")
        return
    table = Table("id", "messages", "updated", "title")
    for c in items:
        updated = c.updated_at.strftime("%Y-%m-%d %H:%M") if c.updated_at else ""
        table.add_row(escape(c.id), str(c.message_count), updated, escape(c.title or ""))
    console.print(table)


@conversations.command("show")
@click.argument("conversation_id")
@db_option
@json_option
@handle_errors
def show_command(conversation_id: str, db: str | None, as_json: bool) -> None:
    """Show a conversation's messages and per-turn figures."""
    with Store(resolve_db(db)) as store:
        conversation = store.get_conversation(conversation_id)
        messages = store.messages(conversation_id)
        turns = store.turns(conversation_id)
    if as_json:
        print_json(
            {
                "conversation": asdict(conversation),
                "messages": [asdict(m) for m in messages],
                "turns": [asdict(t) for t in turns],
            }
        )
        return
    console.print(f"[bold]{escape(conversation.id)}[/bold]  {conversation.message_count} messages")
    if conversation.system_prompt:
        console.print(f"[dim]system:[/dim] {escape(conversation.system_prompt)}")
    for m in messages:
        flag = "" if m.status == "complete" else f" [yellow]({m.status})[/yellow]"
        console.print(f"[bold]{m.role}[/bold]{flag}: {escape(m.content)}", markup=True)


@conversations.command("export")
@click.argument("conversation_ids", nargs=-1)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True),
    default="-",
    help="File to write (default: stdout).",
)
@db_option
@handle_errors
def export_command(conversation_ids: tuple[str, ...], output: str, db: str | None) -> None:
    """Export conversations as JSON Lines (OpenAI chat format); all when no id is given."""
    with Store(resolve_db(db)) as store:
        ids = list(conversation_ids) or [c.id for c in store.list_conversations()]
        for cid in ids:  # fail on an unknown id before writing anything
            store.get_conversation(cid)
        if output == "-":
            count = export_jsonl(store, ids, sys.stdout)
        else:
            with open(output, "w", encoding="utf-8") as out:
                count = export_jsonl(store, ids, out)
    click.echo(f"exported {count} conversation(s)", err=True)


@conversations.command("import")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@db_option
@handle_errors
def import_command(file: str, db: str | None) -> None:
    """Import conversations from JSON Lines ('-' reads stdin); all or nothing.

    A bad line is refused as FILE:LINE: reason, and nothing is stored.
    """
    # A file name that is not UTF-8 is shown with escapes (it must still print).
    source = "<stdin>" if file == "-" else file.encode("utf-8", "backslashreplace").decode()
    # Read as bytes: read_jsonl checks UTF-8 per line and never holds more than one
    # line's limit of a hostile line.
    if file == "-":
        records = list(read_jsonl(sys.stdin.buffer, source=source))
    else:
        try:
            stream = open(file, "rb")  # noqa: SIM115 - closed by the with below
        except OSError as exc:
            raise ImportFormatError(f"cannot read: {exc.strerror}", line=0, source=source) from exc
        with stream:
            records = list(read_jsonl(stream, source=source))
    with Store(resolve_db(db)) as store:
        ids = import_records(store, records)
    click.echo(f"imported {len(ids)} conversation(s): {', '.join(ids)}")


@conversations.command("delete")
@click.argument("conversation_id")
@db_option
@handle_errors
def delete_command(conversation_id: str, db: str | None) -> None:
    """Delete a conversation and everything recorded for it."""
    with Store(resolve_db(db)) as store:
        store.delete_conversation(conversation_id)
    click.echo(f"deleted {conversation_id}")


__all__ = ["conversations", "export_conversation"]
