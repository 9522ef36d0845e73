"""``chatctx inspect``: what the context builder sent, and every eviction so far."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

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
from chatctx.store import Store


def _count(ranges: list[list[int]]) -> int:
    return sum(last - first + 1 for first, last in ranges)


@click.command()
@click.argument("conversation_id")
@db_option
@json_option
@handle_errors
def inspect(conversation_id: str, db: str | None, as_json: bool) -> None:
    """Show the conversation's current context plan, summary and eviction history."""
    with Store(resolve_db(db)) as store:
        conversation = store.get_conversation(conversation_id)
        state = store.context_state(conversation_id)
        turns = store.turns(conversation_id)
        summaries = store.summaries(conversation_id)
    plans: list[tuple[int, dict[str, Any]]] = [
        (number, t.plan) for number, t in enumerate(turns, start=1) if t.plan
    ]
    evictions = [(n, p) for n, p in plans if p.get("evicted") or p.get("cleared_ids")]
    agent = [
        (number, t)
        for number, t in enumerate(turns, start=1)
        if t.tool_calls is not None or t.tool_result_tokens or t.tool_cleared_tokens
    ]
    if as_json:
        print_json(
            {
                "conversation": conversation.id,
                "messages": conversation.message_count,
                "window_start": state.window_start,
                "pending_ids": list(state.pending_ids),
                "summary": asdict(state.summary) if state.summary else None,
                "summary_versions": len(summaries),
                "current_plan": plans[-1][1] if plans else None,
                "evictions": [{"turn": n, **p} for n, p in evictions],
                "cleared_ids": list(state.cleared_ids),
                "tool_turns": [
                    {
                        "turn": n,
                        "tool_calls": t.tool_calls,
                        "tool_result_tokens": t.tool_result_tokens,
                        "tool_cleared_tokens": t.tool_cleared_tokens,
                        "tool_warning": t.tool_warning,
                    }
                    for n, t in agent
                ],
            }
        )
        return
    console.print(
        f"[bold]{conversation.id}[/bold] · {conversation.message_count} messages · "
        f"{len(turns)} turns · window starts at message position {state.window_start}"
    )
    if plans:
        number, plan = plans[-1]
        sections = plan.get("sections", {})
        console.print(
            f"\n[bold]current plan[/bold] (turn {number}, policy {plan.get('policy')}): "
            f"{plan.get('prompt_tokens')} prompt tokens of budget {plan.get('budget')} "
            f"(high {plan.get('high_limit')}, low {plan.get('low_limit')}), reserve "
            f"{plan.get('reserve')}"
        )
        console.print("  " + " · ".join(f"{k} {v}" for k, v in sections.items()))
        console.print(
            f"  kept {len(plan.get('kept_ids', []))} messages · layout "
            f"{plan.get('layout', 'summary-first')} · prompt hash {plan.get('prompt_hash')}"
        )
        recalled = plan.get("recalled_ids") or []
        if recalled:
            scores = plan.get("recall_scores") or []
            pairs = ", ".join(f"{i} ({s:.2f})" for i, s in zip(recalled, scores, strict=False))
            console.print(
                f"  recalled {len(recalled)} messages (id (score), best first): {pairs} · "
                f"{plan.get('recall_ms', 0):.1f} ms"
            )
        if plan.get("recall_answered") is not None:
            console.print(
                f"  best match {plan['recall_answered']} already in the prompt: the other "
                "matches sent their closest sentence only"
            )
        if plan.get("tool_result_tokens") or plan.get("tool_cleared_tokens"):
            console.print(
                f"  tool results: {plan.get('tool_result_tokens', 0)} tokens sent whole, "
                f"{plan.get('tool_cleared_tokens', 0)} tokens cleared to stubs "
                f"({len(state.cleared_ids)} results; the store keeps them)"
            )
        if plan.get("recall_error"):
            console.print(f"  [red]recall failed: {plan['recall_error']}[/red]")
        if plan.get("yielded"):
            console.print(
                "  [yellow]gave way to the new message: "
                + ", ".join(plan["yielded"])
                + (" (summary left out of this prompt)" if plan.get("summary_omitted") else "")
                + "[/yellow]"
            )
    else:
        console.print("no turns yet")
    if state.summary:
        parts = state.summary.blocks
        where = (
            f", {len(parts)} parts in the append layout, each after message position "
            + ", ".join("(front)" if after < 0 else str(after) for _, after in parts)
            if len(parts) > 1
            else ""
        )
        if state.summary.abridged:
            where = (
                f", sent as {len(state.summary.abridged)} evicted messages cut down in the "
                "abridge layout"
            )
        console.print(
            f"\n[bold]summary[/bold] (version {len(summaries)}, "
            f"{state.summary.token_count} tokens{where}):\n{state.summary.content}"
        )
    if state.pending_ids:
        console.print(
            f"[yellow]{len(state.pending_ids)} evicted messages wait to be "
            "summarized (the last summary attempt failed)[/yellow]"
        )
    if agent:
        calls = Table(
            "turn", "calls", "results whole", "results cleared", "note", title="tool calls"
        )
        for n, t in agent:
            calls.add_row(
                str(n),
                "" if t.tool_calls is None else str(t.tool_calls),
                str(t.tool_result_tokens or 0),
                str(t.tool_cleared_tokens or 0),
                f"[yellow]{t.tool_warning}[/yellow]" if t.tool_warning else "",
            )
        console.print()
        console.print(calls)
    if not evictions:
        console.print("\nno evictions")
        return
    table = Table(
        "turn",
        "prompt",
        "evicted",
        "cleared",
        "summarized",
        "dropped",
        "summary ms",
        "reason",
        title="evictions",
    )
    for n, p in evictions:
        error = p.get("summary_error")
        notes = (p.get("reason") or "") + (f" [red]summary failed: {error}[/red]" if error else "")
        if p.get("summary_stopped"):
            notes += f" [yellow]summary partial: {p['summary_stopped']}[/yellow]"
        if p.get("dropped_reason"):
            notes += f" [yellow]dropped: {p['dropped_reason']}[/yellow]"
        table.add_row(
            str(n),
            str(p.get("prompt_tokens")),
            str(_count(p["evicted_ids"])),
            str(len(p.get("cleared_ids") or ())),
            str(_count(p["summarized_ids"])),
            str(_count(p["dropped_ids"])),
            f"{p.get('summary_ms', 0):.0f}",
            notes,
        )
    console.print()
    console.print(table)
