"""The ``chatctx`` command line. Library errors become click errors only here."""

from __future__ import annotations

import logging

import click

from chatctx import __version__
from chatctx.cli.chat import chat
from chatctx.cli.conversations import conversations
from chatctx.cli.db import db
from chatctx.cli.demo import demo
from chatctx.cli.doctor import doctor
from chatctx.cli.inspect import inspect
from chatctx.cli.models import models
from chatctx.cli.plan import plan
from chatctx.cli.replay import replay, tune
from chatctx.cli.serve import serve
from chatctx.cli.stats import stats
from chatctx.cli.synth import synth


@click.group()
@click.version_option(__version__, prog_name="chatctx")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug incl. llama.cpp).")
def cli(verbose: int) -> None:
    """Chatbot context and KV-cache management for llama.cpp and Llama 3 models."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


cli.add_command(chat)
cli.add_command(conversations)
cli.add_command(db)
cli.add_command(demo)
cli.add_command(doctor)
cli.add_command(inspect)
cli.add_command(models)
cli.add_command(plan)
cli.add_command(replay)
cli.add_command(serve)
cli.add_command(stats)
cli.add_command(synth)
cli.add_command(tune)


def main() -> None:
    cli(prog_name="chatctx")


__all__ = ["cli", "main"]
