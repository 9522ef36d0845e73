"""``chatctx stats``: per-turn KV-cache figures, totals, and a Prometheus exposition."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import click
from rich.table import Table

from chatctx.cli._common import (
    console,
    db_option,
    handle_errors,
    json_option,
    print_json,
    resolve_db,
)
from chatctx.errors import ConfigError
from chatctx.monitor import prometheus_text, totals
from chatctx.store import Store, Turn


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


@click.command()
@click.argument("conversation_id", required=False)
@db_option
@json_option
@click.option(
    "--prometheus",
    is_flag=True,
    help="Print the Prometheus text exposition (all conversations without an id).",
)
@handle_errors
def stats(conversation_id: str | None, db: str | None, as_json: bool, prometheus: bool) -> None:
    """Show what the KV cache did on every turn of a conversation, with totals.

    Prefill amplification = evaluated / new prompt tokens; cache hit ratio = reused / prompt.
    """
    with Store(resolve_db(db)) as store:
        if prometheus:
            ids = (
                [conversation_id] if conversation_id else [c.id for c in store.list_conversations()]
            )
            for cid in ids:
                store.get_conversation(cid)
            click.echo(prometheus_text({cid: store.turns(cid) for cid in ids}), nl=False)
            return
        if conversation_id is None:
            raise ConfigError("name a conversation (or use --prometheus for all)")
        store.get_conversation(conversation_id)
        turns = store.turns(conversation_id)
    summary = totals(turns)
    if as_json:
        print_json(
            {
                "conversation": conversation_id,
                "turns": [asdict(t) | {"turn": i} for i, t in enumerate(turns, start=1)],
                "totals": summary.as_dict(),
                "memory": _memory(turns),
            }
        )
        return
    memory = _memory(turns)
    show_rss = memory["peak_rss_bytes"] is not None
    show_gpu = memory["last_gpu_used_bytes"] is not None
    table = Table(
        "turn",
        "prompt",
        "new",
        "reused",
        "evaluated",
        "evicted",
        "shifted",
        "cells",
        "TTFT ms",
        "tok/s",
        "policy",
        title=f"KV cache, conversation {conversation_id}",
    )
    if show_rss:
        table.add_column("RSS MiB")
    if show_gpu:
        table.add_column("GPU used/free MiB")
    for i, t in enumerate(turns, start=1):
        cells = "/".join(str(v) for _, v in sorted((t.cells_used or {}).items()))
        evicted = bool(t.plan and t.plan.get("evicted"))
        extra = [_mib(t.rss_bytes)] if show_rss else []
        if show_gpu:
            extra.append(f"{_mib(t.gpu_used_bytes)}/{_mib(t.gpu_free_bytes)}")
        table.add_row(
            str(i),
            str(t.prompt_tokens),
            _fmt(t.new_tokens),
            str(t.reused_tokens),
            str(t.evaluated_tokens),
            _fmt(t.evicted_tokens),
            _fmt(t.shifted_tokens),
            cells,
            _fmt(t.ttft_ms),
            _fmt(t.decode_tokens_per_s, ".1f"),
            (t.eviction_policy or "-") + (" *" if evicted else ""),
            *extra,
        )
    console.print(table)
    console.print(
        f"{summary.turns} turns · prefill amplification "
        f"{_fmt(summary.prefill_amplification, '.2f')} · cache hit ratio "
        f"{_fmt(summary.cache_hit_ratio, '.2f')} · evictions {summary.evictions} · shifted "
        f"{summary.shifted_tokens} tokens in {summary.shift_count} shifts · TTFT p50 "
        f"{_fmt(summary.ttft_p50_ms)} ms, p95 {_fmt(summary.ttft_p95_ms)} ms  (* = evicted)"
    )
    if show_rss or show_gpu:
        line = f"memory: peak RSS {_mib(memory['peak_rss_bytes'])} MiB"
        if show_gpu:
            line += (
                f" · GPU used {_mib(memory['last_gpu_used_bytes'])} MiB, free "
                f"{_mib(memory['last_gpu_free_bytes'])} MiB after the last turn"
            )
        console.print(line)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1024 * 1024):.0f}"


def _memory(turns: Sequence[Turn]) -> dict[str, int | None]:
    """Peak RSS over the turns, and the last turn's figures (None where not measured)."""
    rss = [t.rss_bytes for t in turns if t.rss_bytes is not None]
    last = turns[-1] if turns else None
    return {
        "peak_rss_bytes": max(rss) if rss else None,
        "last_rss_bytes": last.rss_bytes if last else None,
        "last_gpu_used_bytes": last.gpu_used_bytes if last else None,
        "last_gpu_free_bytes": last.gpu_free_bytes if last else None,
    }
