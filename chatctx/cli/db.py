"""``chatctx db``: schema migrations."""

from __future__ import annotations

import click

from chatctx.cli._common import db_option, handle_errors, json_option, print_json, resolve_db
from chatctx.store import create_db_engine, current_revision, head_revision, upgrade


@click.group()
def db() -> None:
    """Manage the conversation database schema."""


@db.command("upgrade")
@db_option
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@handle_errors
def upgrade_command(db: str | None, revision: str) -> None:
    """Upgrade the database schema (opening a store also does this)."""
    engine = create_db_engine(resolve_db(db))
    try:
        before = current_revision(engine)
        upgrade(engine, revision)
        after = current_revision(engine)
    finally:
        engine.dispose()
    click.echo(f"{before or 'empty'} -> {after}")


@db.command("current")
@db_option
@json_option
@handle_errors
def current_command(db: str | None, as_json: bool) -> None:
    """Show the database's schema revision and the newest one available."""
    engine = create_db_engine(resolve_db(db))
    try:
        current = current_revision(engine)
    finally:
        engine.dispose()
    head = head_revision()
    if as_json:
        print_json({"current": current, "head": head, "up_to_date": current == head})
    else:
        state = "up to date" if current == head else "needs upgrade"
        click.echo(f"current: {current or 'empty'}  head: {head}  ({state})")
