"""``chatctx models``: what a GGUF is, read from its header (no weights loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    for kv in ("q8_0", "q4_0"):
        facts[f"kv_bytes_per_token_{kv}"] = _kv_bytes(facts, kv)
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
        "kv_bytes_per_token_q8_0": "KV bytes/token (q8_0)",
        "kv_bytes_per_token_q4_0": "KV bytes/token (q4_0)",
        "rope_freq_base": "RoPE base",
        "rope_scaling": "RoPE scaling",
    }
    for key, label in labels.items():
        value = facts.get(key)
        if key == "chat_template":
            value = "yes" if value else "no (pass --chat-format)"
        if key == "rope_scaling" and not value:
            value = "none (past the trained context: rope_scaling linear|yarn)"
        click.echo(f"{label:<22}{'?' if value is None else value}")


def _kv_bytes(facts: dict[str, Any], kv_type: str) -> int | None:
    """One token's KV bytes over all layers in a quantized cache (None if it cannot hold it)."""
    from chatctx.engine._memory import KV_TYPE_IDS, tensor_bytes

    if not (facts.get("n_layer") and facts.get("n_head_kv") and facts.get("key_length")):
        return None
    k = facts["n_head_kv"] * facts["key_length"]
    v = facts["n_head_kv"] * (facts.get("value_length") or facts["key_length"])
    if facts["key_length"] % 32 or (facts.get("value_length") or 0) % 32:
        return None
    per_layer = tensor_bytes(KV_TYPE_IDS[kv_type], (k,)) + tensor_bytes(KV_TYPE_IDS[kv_type], (v,))
    return int(facts["n_layer"] * per_layer)
