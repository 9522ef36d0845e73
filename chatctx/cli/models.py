"""``chatctx models``: what a GGUF is, read from its header (no weights loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from chatctx.cli._common import handle_errors, json_option, print_json, settings
from chatctx.cli._options import field_option
from chatctx.errors import ConfigError
from chatctx.model.gguf import model_facts, read_metadata
from chatctx.model.paths import resolve_model_path
from chatctx.settings import EngineConfig


@click.group()
def models() -> None:
    """Inspect model files."""


@models.command("info")
@click.argument("path", required=False, type=click.Path(dir_okay=False, path_type=Path))
@field_option(EngineConfig, "n_ctx", default=None, help_after="Default: CHATCTX_N_CTX.")
@field_option(EngineConfig, "slots")
@field_option(EngineConfig, "kv_unified", "--unified/--split", "unified")
@json_option
@handle_errors
def info(path: Path | None, n_ctx: int | None, slots: int, unified: bool, as_json: bool) -> None:
    """Show a GGUF's architecture, size of context and vocabulary, template, KV cost.

    \b
    --n-ctx is ONE conversation's context: the engine holds --slots of them, plus a
    sequence reserved for summaries, and KV cells / KV cache are what loading it that way
    allocates (see `chatctx plan` for the whole memory budget).
    Without PATH: CHATCTX_MODEL, or the embedded default model.
    """
    resolved = resolve_model_path(path)
    facts = {"path": str(resolved), **model_facts(read_metadata(resolved))}
    for kv in ("q8_0", "q4_0"):
        facts[f"kv_bytes_per_token_{kv}"] = _kv_bytes(facts, kv)
    facts.update(_pool(resolved, n_ctx or settings().n_ctx, slots, unified))
    per_token = facts.get("kv_bytes_per_token_f16")
    facts["kv_cache_bytes_f16"] = facts["kv_cells"] * per_token if per_token else None
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
    layout = (
        f"unified pool: {facts['slots']} x {facts['n_ctx']} + {facts['summary_room']} "
        "summary room, padded to 256"
        if facts["kv_unified"]
        else f"split: {facts['n_seq_max']} streams x {facts['n_ctx']}"
    )
    cache = facts["kv_cache_bytes_f16"]
    for label, value in (
        ("n_ctx", f"{facts['n_ctx']} tokens: one conversation's context (one slot)"),
        ("slots", f"{facts['slots']} (+1 sequence reserved for summaries)"),
        ("KV cells", f"{facts['kv_cells']} ({layout})"),
        ("KV cache (f16)", "?" if cache is None else f"{cache / 2**20:,.1f} MiB"),
    ):
        click.echo(f"{label:<22}{value}")


def _pool(path: Path, n_ctx: int, slots: int, unified: bool) -> dict[str, Any]:
    """How an engine loaded with these options sizes its KV cache (``Engine.info()``)."""
    from chatctx.model.memory import kv_cells, pad256, summary_room_for

    try:
        config = EngineConfig(model_path=path, n_ctx=n_ctx, slots=slots, kv_unified=unified)
    except ValidationError as exc:
        raise ConfigError(f"invalid engine options: {exc}") from exc
    per_conversation = pad256(config.n_ctx)
    room = summary_room_for(per_conversation, config.summary_room) if unified else 0
    return {
        "n_ctx": per_conversation,
        "slots": config.slots,
        "n_seq_max": config.n_seq_max,
        "kv_unified": unified,
        "summary_room": room,
        "kv_cells": kv_cells(per_conversation, config.slots, unified, room),
    }


def _kv_bytes(facts: dict[str, Any], kv_type: str) -> int | None:
    """One token's KV bytes over all layers in a quantized cache (None if it cannot hold it)."""
    from chatctx.model.memory import KV_TYPE_IDS, tensor_bytes

    if not (facts.get("n_layer") and facts.get("n_head_kv") and facts.get("key_length")):
        return None
    k = facts["n_head_kv"] * facts["key_length"]
    v = facts["n_head_kv"] * (facts.get("value_length") or facts["key_length"])
    if facts["key_length"] % 32 or (facts.get("value_length") or 0) % 32:
        return None
    per_layer = tensor_bytes(KV_TYPE_IDS[kv_type], (k,)) + tensor_bytes(KV_TYPE_IDS[kv_type], (v,))
    return int(facts["n_layer"] * per_layer)
