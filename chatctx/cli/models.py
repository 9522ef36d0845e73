"""``chatctx models``: what a GGUF is, read from its header (no weights loaded)."""

from __future__ import annotations

from pathlib import Path

import click

from chatctx.cli._common import handle_errors, json_option, print_json
from chatctx.engine import model_facts, read_metadata, resolve_model_path


@click.group()
def models() -> None:
    """Inspect model files."""


@models.command("info")
@click.argument("path", required=False, type=click.Path(dir_okay=False, path_type=Path))
@json_option
@handle_errors
def info(path: Path | None, as_json: bool) -> None:
    """Show a GGUF's architecture, size of context and vocabulary, template, KV cost.

    Without PATH: CHATCTX_MODEL, or the embedded default model.
    """
    resolved = resolve_model_path(path)
    facts = {"path": str(resolved), **model_facts(read_metadata(resolved))}
    if as_json:
        print_json(facts)
        return
    labels = {
        "path": "path",
        "name": "name",
        "architecture": "architecture",
        "n_layer": "layers",
        "n_embd": "embedding",
        "n_head": "heads",
        "n_head_kv": "KV heads",
        "n_ctx_train": "context trained",
        "vocab_size": "vocabulary",
        "tokenizer_model": "tokenizer",
        "chat_template": "chat template",
        "kv_bytes_per_token_f16": "KV bytes/token (f16)",
    }
    for key, label in labels.items():
        value = facts.get(key)
        if key == "chat_template":
            value = "yes" if value else "no (pass --chat-format)"
        click.echo(f"{label:<22}{'?' if value is None else value}")
