"""``chatctx synth``: long synthetic support conversations with planted facts (probes)."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path
from typing import TextIO

import click

from chatctx._json import json_line
from chatctx.cli._common import handle_errors
from chatctx.synthetic import support_conversation


@click.command()
@click.option(
    "--count", type=click.IntRange(1), default=10, show_default=True, help="Conversations to write."
)
@click.option(
    "--turns",
    type=click.IntRange(2),
    default=150,
    show_default=True,
    help="User turns per conversation.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="First seed.")
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File to write (.gz compresses; default: stdout).",
)
@handle_errors
def synth(count: int, turns: int, seed: int, output: Path | None) -> None:
    """Write synthetic support chats (OpenAI JSON Lines) with fact probes for replay/tune."""

    def emit(out: TextIO) -> None:
        for i in range(count):
            conv = support_conversation(turns, seed=seed + i, conversation_id=f"synth-{seed + i}")
            out.write(json_line(conv) + "\n")

    if output is None:
        emit(sys.stdout)
    elif output.suffix == ".gz":
        with gzip.open(output, "wt", encoding="utf-8") as f:
            emit(f)
    else:
        with output.open("w", encoding="utf-8") as f:
            emit(f)
