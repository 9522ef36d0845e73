"""``chatctx stats``: per-turn KV-cache figures, totals, and a Prometheus exposition."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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
from chatctx.errors import ConfigError, StoreError
from chatctx.monitor import (
    BackendTotals,
    SlotTable,
    SwapTotals,
    backend_totals,
    default_slots_path,
    engines_dir,
    live_slot_tables,
    prometheus_text,
    read_slot_table,
    swap_totals,
    totals,
)
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
@click.option(
    "--slots",
    is_flag=True,
    help="Show the engine's slot pool (slot table file) and how turns found their KV state; "
    "with --prometheus, add the pool's metrics.",
)
@click.option(
    "--slots-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read this slot table file instead of every live engine's under "
    "CHATCTX_HOME/engines; implies --slots.",
)
@click.option(
    "--backends",
    is_flag=True,
    help="Per backend behind a router (from the store's placements and turns): "
    "conversations placed, turns, hit ratio, failovers, swap-ins, re-prefills by reason; with "
    "--prometheus, add them as gauges.",
)
@handle_errors
def stats(
    conversation_id: str | None,
    db: str | None,
    as_json: bool,
    prometheus: bool,
    slots: bool,
    slots_file: Path | None,
    backends: bool,
) -> None:
    """Show what the KV cache did on every turn of a conversation, with totals.

    Prefill amplification = evaluated / new prompt tokens; cache hit ratio = reused / prompt.
    With --slots: the engine's slot pool (slots, reserved sequences, swapped conversations,
    swap and batching counters) and, from the stored turns (all, or the named conversation's),
    how many started from a swap-in or a re-prefill.
    """
    tables = _slot_tables(slots_file, slots)
    with Store(resolve_db(db)) as store:
        per_backend = None
        if backends:
            ids = [conversation_id] if conversation_id else None
            all_turns_of = [
                t for cid in ids or [c.id for c in store.list_conversations()]
                for t in store.turns(cid)
            ]  # fmt: skip
            counts = store.placement_counts()
            if ids:
                placed = store.get_placement(conversation_id or "")
                counts = {placed.backend: 1} if placed else {}
            per_backend = backend_totals(all_turns_of, counts)
            if not prometheus:
                _show_backends(per_backend, conversation_id, as_json)
                return
        if prometheus or tables is not None:
            ids = (
                [conversation_id] if conversation_id else [c.id for c in store.list_conversations()]
            )
            for cid in ids:
                store.get_conversation(cid)
            by_conversation = {cid: store.turns(cid) for cid in ids}
            if prometheus:
                gauges = per_backend or ()
                if tables is not None and len(tables) > 1:
                    text = prometheus_text(
                        by_conversation, slot_tables=[t for _, t in tables], backends=gauges
                    )
                else:
                    text = prometheus_text(
                        by_conversation,
                        slot_table=tables[0][1] if tables else None,
                        backends=gauges,
                    )
                click.echo(text, nl=False)
                return
            assert tables is not None
            all_turns = swap_totals([t for turns in by_conversation.values() for t in turns])
            if slots_file is not None:  # one named file: its report as it always was
                _show_slots(tables[0][1], slots_file, all_turns, conversation_id, as_json)
                return
            if as_json:  # every live engine: a list, however many there are
                print_json(
                    {
                        "engines": [
                            _slots_report(table, path, all_turns, conversation_id)
                            for path, table in tables
                        ]
                    }
                )
                return
            for path, slot_table in tables:
                _show_slots(slot_table, path, all_turns, conversation_id, False)
            return
        if conversation_id is None:
            raise ConfigError("name a conversation (or use --prometheus or --slots for all)")
        store.get_conversation(conversation_id)
        turns = store.turns(conversation_id)
    _show_turns(conversation_id, turns, as_json)


def _slot_tables(slots_file: Path | None, slots: bool) -> list[tuple[Path, SlotTable]] | None:
    """The slot tables to report: the named file, every live engine's (--slots), or None."""
    if slots_file is not None:
        return [(slots_file, read_slot_table(slots_file))]
    if not slots:
        return None
    tables = live_slot_tables()
    if not tables and default_slots_path().is_file():  # the older, one-engine layout
        tables = [(default_slots_path(), read_slot_table(default_slots_path()))]
    if not tables:
        raise StoreError(
            f"no running engine has written a slot table under {engines_dir()} "
            f"(nor is there {default_slots_path()})"
        )
    return tables


def _show_turns(conversation_id: str, turns: list[Turn], as_json: bool) -> None:
    """One conversation's turns as a table (or JSON), with totals and memory figures."""
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
        title=f"KV cache, conversation {escape(conversation_id)}",
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
            escape(t.eviction_policy or "-") + (" *" if evicted else ""),
            *extra,
        )
    console.print(table)
    console.print(
        f"{summary.turns} turns · prefill amplification "
        f"{_fmt(summary.prefill_amplification, '.2f')} · cache hit ratio "
        f"{_fmt(summary.cache_hit_ratio, '.2f')} · evictions {summary.evictions} · shifted "
        f"{summary.shifted_tokens} tokens in {summary.shift_count} shifts · TTFT p50 "
        f"{_fmt(summary.ttft_p50_ms)} ms, p95 {_fmt(summary.ttft_p95_ms)} ms · queue wait p50 "
        f"{_fmt(summary.queue_p50_ms)} ms, p95 {_fmt(summary.queue_p95_ms)} ms  (* = evicted)"
    )
    if summary.tool_calls or summary.tool_results_cleared:
        console.print(
            f"agent: {summary.tool_calls} tool calls · {summary.tool_results_cleared} old tool "
            "results cleared to stubs (`chatctx inspect` shows them per turn)"
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


def _size(value: float) -> str:
    """Bytes in binary units, one decimal (``120.6 KiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _when(value: datetime | None) -> str:
    return "-" if value is None else f"{value.astimezone(UTC):%Y-%m-%d %H:%M:%S}"


def _slots_report(
    table: SlotTable, path: Path, turns: SwapTotals, conversation_id: str | None
) -> dict[str, Any]:
    return {
        "slots_file": str(path),
        "conversation": conversation_id,
        "writer_running": table.writer_running(),
        "table": table.as_dict(),
        "derived": {
            "slots": len(table.slots),
            "leased": table.leased,
            "cells": sum(r.cells for r in table.slots),
            "swap_in": table.swap_ins,
            "mean_swap_in_ms": table.mean_swap_in_ms,
            "mean_swap_out_ms": table.mean_swap_out_ms,
            "mean_batch_sequences": table.mean_batch_sequences,
            "mean_batch_tokens": table.mean_batch_tokens,
            "max_batch_sequences": table.counters["batch_max"],
        },
        "turns": turns.as_dict(),
    }


def _show_slots(
    table: SlotTable,
    path: Path,
    turns: SwapTotals,
    conversation_id: str | None,
    as_json: bool,
) -> None:
    if as_json:
        print_json(_slots_report(table, path, turns, conversation_id))
        return
    c = table.counters
    console.print(
        f"slot table {escape(str(path))} · model {escape(table.model or '-')} · n_ctx "
        f"{table.n_ctx} · unified KV {'yes' if table.kv_unified else 'no'} · pid {table.pid} · "
        f"updated {_when(table.updated_at)} UTC"
    )
    if table.writer_running() is False:
        console.print(
            f"[yellow]process {table.pid} is not running: the table shows the pool as it "
            "was left[/yellow]"
        )
    slots = Table("slot", "seq", "conversation", "cells", "leased", "last use (UTC)", title="Slots")
    for r in table.slots:
        slots.add_row(
            str(r.slot),
            str(r.seq_id),
            escape(r.conversation or "-"),
            str(r.cells),
            "yes" if r.leased else "no",
            _when(r.last_use),
        )
    console.print(slots)
    console.print(
        f"{table.leased} of {len(table.slots)} slots leased · "
        f"{sum(r.cells for r in table.slots)} cells in slots"
    )
    if table.reserved:
        reserved = Table("seq", "role", "cells", title="Reserved sequences")
        for res in table.reserved:
            reserved.add_row(str(res.seq_id), escape(res.role), str(res.cells))
        console.print(reserved)
    if table.swapped:
        swapped = Table(
            "conversation", "where", "bytes", "tokens", "saved (UTC)", title="Swapped out"
        )
        for sw in table.swapped:
            swapped.add_row(
                escape(sw.conversation),
                "RAM" if sw.where == "ram" else "disk",
                _size(sw.bytes),
                str(sw.tokens),
                _when(sw.saved_at),
            )
        console.print(swapped)
    else:
        console.print("no conversation swapped out")
    console.print(
        f"swap-ins {table.swap_ins} (RAM {c['swap_in_ram']}, disk {c['swap_in_disk']}) · "
        f"{_size(c['swap_in_bytes'])} · {_fmt(table.mean_swap_in_ms, '.2f')} ms per swap-in"
    )
    console.print(
        f"swap-outs {c['swap_out']} · {_size(c['swap_out_bytes'])} · "
        f"{_fmt(table.mean_swap_out_ms, '.2f')} ms per swap-out"
    )
    console.print(
        f"held now: RAM {_size(c['ram_bytes'])}, disk {_size(c['disk_bytes'])} · spilled to "
        f"disk {c['spill_to_disk']} · dropped from disk {c['disk_dropped']} · re-prefills "
        f"{c['reprefill']}"
    )
    console.print(
        f"batching: {c['batch_steps']} steps · {c['batch_tokens']} tokens "
        f"({_fmt(table.mean_batch_tokens, '.1f')} per step) · sequences per step: mean "
        f"{_fmt(table.mean_batch_sequences, '.2f')}, max {c['batch_max']}"
    )
    scope = f"conversation {escape(conversation_id)}" if conversation_id else "all conversations"
    console.print(
        f"stored turns ({scope}): {turns.turns} · from a swap-in "
        f"{turns.swap_in_ram + turns.swap_in_disk} (RAM {turns.swap_in_ram}, disk "
        f"{turns.swap_in_disk}), mean swap-in {_fmt(turns.swap_in_ms_mean, '.2f')} ms · "
        f"re-prefilled {turns.reprefills}"
    )
    if turns.reprefill_reasons:
        reasons = Table("re-prefill reason", "turns", title="Why swapped states were refused")
        for reason, count in turns.reprefill_reasons.items():
            reasons.add_row(escape(reason), str(count))
        console.print(reasons)


def _show_backends(
    rows: Sequence[BackendTotals], conversation_id: str | None, as_json: bool
) -> None:
    if as_json:
        print_json({"conversation": conversation_id, "backends": [r.as_dict() for r in rows]})
        return
    if not rows:
        console.print("no conversation was placed by a router (no placements, no backend turns)")
        return
    table = Table(
        "backend",
        "conversations",
        "turns",
        "hit ratio",
        "failovers",
        "swap-ins",
        "re-prefills",
        "TTFT p50 ms",
        "p95",
        title="Backends",
    )
    for r in rows:
        table.add_row(
            escape(r.backend),
            str(r.conversations),
            str(r.turns),
            _fmt(r.cache_hit_ratio, ".2f"),
            str(r.failovers),
            str(r.swap_ins),
            str(r.reprefills),
            _fmt(r.ttft_p50_ms),
            _fmt(r.ttft_p95_ms),
        )
    console.print(table)
    reasons: dict[str, int] = {}
    for r in rows:
        for reason, n in r.reprefill_reasons.items():
            reasons[reason] = reasons.get(reason, 0) + n
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        console.print(f"re-prefilled: {escape(reason)} · {n} turns")
