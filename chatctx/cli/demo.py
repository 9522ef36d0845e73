"""``chatctx demo``: replay a sample support conversation through ChatSession."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from importlib.resources import files
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from chatctx.cli._common import (
    build_engine_options,
    console,
    db_option,
    engine_options,
    handle_errors,
    model_option,
    print_json,
    resolve_db,
    turn_figures,
)
from chatctx.cli._options import field_option
from chatctx.cli._signals import interruptible
from chatctx.errors import StoreError
from chatctx.monitor import totals
from chatctx.replay import Replayer, parse_logged
from chatctx.session import ChatSession, Reply
from chatctx.settings import ContextSettings, GenerationSettings, ReplayConfig
from chatctx.store import read_jsonl

SAMPLE = "data/support_sample.jsonl"
# The demo's sampling and a budget the sample outgrows at turn 5.
DEMO_SETTINGS = GenerationSettings(max_tokens=48, seed=42)
DEMO_CONTEXT = ContextSettings(budget=384)


def _kv_figures(reply: Reply) -> dict[str, int]:
    turn, plan = reply.turn, reply.plan
    sections = plan.sections if plan is not None else {}
    return {
        "evicted_tokens": (turn.evicted_tokens or 0) if turn else 0,
        "shifted_tokens": (turn.shifted_tokens or 0) if turn else 0,
        "summary_tokens": sections.get("summary", 0),
        "recall_tokens": sections.get("recall", 0),
    }


def _dry_runs(chat: ChatSession, budget: int, max_tokens: int) -> dict[str, dict[str, Any]]:
    """The same chat (its stored replies as the log) replayed without the model, with
    chatctx's policy and with trimming to fit every turn: like against like."""
    messages = [m.to_openai() for m in chat.history()]
    if chat.system_prompt:
        messages.insert(0, {"role": "system", "content": chat.system_prompt})
    logged = parse_logged(json.dumps({"id": "demo", "messages": messages}), line=1)
    out = {}
    # Trimming to fit every turn with only llama.cpp's prefix cache (what a plain loop over
    # llama-cpp-python gets) against chatctx's defaults.
    for policy, eviction in (("watermarks", "shift"), ("trim-every-turn", "recompute")):
        context = ContextSettings(
            budget=budget, reserve=max_tokens, policy=policy, eviction=eviction
        )
        config = ReplayConfig(mode="dry", context=context)
        with Replayer(config, engine=chat.engine) as replayer:
            report = replayer.replay(logged)
        evaluated = sum(t.evaluated_tokens for t in report.turns)
        new = sum(t.new_tokens for t in report.turns)
        out[policy] = {
            "evaluated_tokens": evaluated,
            "new_tokens": new,
            "prefill_amplification": evaluated / max(new, 1),
        }
    return out


@click.command()
@click.option(
    "--file",
    "path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="JSON Lines conversation whose user turns are replayed "
    "(default: the bundled support sample).",
)
@field_option(GenerationSettings, "max_tokens", defaults=DEMO_SETTINGS)
@field_option(GenerationSettings, "seed", defaults=DEMO_SETTINGS)
@field_option(
    ContextSettings,
    "budget",
    defaults=DEMO_CONTEXT,
    help_after="The demo's is small enough that the sample outgrows it, so turns are "
    "evicted, summarized and recalled.",
)
@db_option
@model_option
@engine_options
@click.option("--json", "as_json", is_flag=True, help="Print the per-turn figures as JSON.")
@handle_errors
def demo(
    path: Path | None,
    max_tokens: int,
    seed: int,
    budget: int,
    db: str | None,
    model: str | None,
    n_ctx: int | None,
    n_gpu_layers: int | None,
    chat_format: str | None,
    as_json: bool,
) -> None:
    """Send each user message of a logged support chat to the model and show what it cost.

    The replies are generated (not the logged ones) and stored in a new conversation. The
    chat outgrows the budget: early turns are evicted from the prompt and the KV cache in
    place, folded into the summary, and recalled when the last message asks for a fact said
    before. The table shows it turn by turn, and a dry run of the same chat says what
    trimming to fit every turn would have evaluated. On Ctrl-C or SIGTERM the reply so far
    is stored with status ``partial``.
    """
    if path is None:
        text = files("chatctx").joinpath(SAMPLE).read_text(encoding="utf-8")
        source = "bundled sample"
    else:
        text = path.read_text(encoding="utf-8")
        source = str(path)
    records = list(read_jsonl(text.splitlines(), source=source))
    if not records:
        raise StoreError(f"{source}: no conversation found")
    record = records[0]
    user_turns = [m["content"] for m in record.messages if m["role"] == "user"]
    cid = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    replies: list[Reply] = []
    with (
        interruptible(),
        ChatSession.open(
            resolve_db(db),
            conversation_id=cid,
            model=model,
            system_prompt=record.system_prompt,
            settings=DEMO_SETTINGS.model_copy(update={"max_tokens": max_tokens, "seed": seed}),
            context=DEMO_CONTEXT.model_copy(update={"budget": budget}),
            engine_options=build_engine_options(n_ctx, n_gpu_layers, chat_format),
        ) as chat,
    ):
        info = chat.engine.info()
        if not as_json:
            console.print(
                f"[bold]chatctx demo[/bold] · {source} · {len(user_turns)} turns · "
                f"{info.path.name} · n_ctx {info.n_ctx} · "
                f"GPU offload {'on' if info.gpu_offload else 'off'}"
            )
        for number, user_text in enumerate(user_turns, start=1):
            if not as_json:
                console.print(f"\n[bold cyan]user {number}:[/bold cyan] {user_text}")
                console.print("[bold green]assistant:[/bold green] ", end="")
            stream = chat.stream(user_text)
            try:
                for chunk in stream:
                    if not as_json:
                        console.print(chunk, end="", markup=False)
            finally:
                # On Ctrl-C or SIGTERM this stores the partial reply before the session closes.
                stream.close()
            assert chat.last_reply is not None
            replies.append(chat.last_reply)
            if not as_json:
                console.print(f"\n[dim]{turn_figures(chat.last_reply)}[/dim]")
        dry = _dry_runs(chat, budget, max_tokens)
    if as_json:
        print_json(
            {
                "conversation": cid,
                "model": str(info.path),
                "turns": [
                    {
                        "turn": i,
                        "text": r.text,
                        "stop_reason": r.stop_reason,
                        **asdict(r.usage),
                        **asdict(r.timings),
                        **_kv_figures(r),
                    }
                    for i, r in enumerate(replies, start=1)
                ],
                "dry_run": dry,
            }
        )
        return
    _show_figures(replies, budget, cid, dry)


def _show_figures(
    replies: list[Reply], budget: int, cid: str, dry: dict[str, dict[str, Any]]
) -> None:
    """The per-turn table, the totals, and what the dry runs say trimming would cost."""
    table = Table(
        "turn",
        "prompt",
        "reused",
        "evaluated",
        "evicted",
        "shifted",
        "summary",
        "recalled",
        "generated",
        "TTFT ms",
        "tok/s",
        title=f"per-turn figures (budget {budget} tokens)",
    )
    for i, r in enumerate(replies, start=1):
        kv = _kv_figures(r)
        table.add_row(
            str(i),
            str(r.usage.prompt_tokens),
            str(r.usage.reused_tokens),
            str(r.usage.evaluated_tokens),
            str(kv["evicted_tokens"]),
            str(kv["shifted_tokens"]),
            str(kv["summary_tokens"]),
            str(kv["recall_tokens"]),
            str(r.usage.generated_tokens),
            f"{r.timings.ttft_ms or 0:.0f}",
            f"{r.timings.decode_tokens_per_s or 0:.1f}",
        )
    console.print()
    console.print(table)
    # The totals `chatctx stats` and `chatctx replay` show, over the stored turn records.
    summary = totals([r.turn for r in replies if r.turn is not None])
    hit_ratio = summary.cache_hit_ratio
    console.print(
        f"cache hit ratio {'-' if hit_ratio is None else f'{hit_ratio:.2f}'} (reused / prompt "
        f"tokens) · stored as conversation {cid}: `chatctx conversations show {cid}`"
    )
    ours, naive = dry["watermarks"], dry["trim-every-turn"]
    console.print(
        f"the same chat without the model (a dry run, replies as logged): trimming to fit "
        f"every turn with a prefix cache evaluates {naive['evaluated_tokens']} prompt tokens "
        f"({naive['prefill_amplification']:.2f}x the new ones), chatctx "
        f"{ours['evaluated_tokens']} ({ours['prefill_amplification']:.2f}x)"
    )
