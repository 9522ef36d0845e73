"""``chatctx demo``: replay a sample support conversation through ChatSession."""

from __future__ import annotations

import time
from dataclasses import asdict
from importlib.resources import files
from pathlib import Path

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
from chatctx.cli._signals import interruptible
from chatctx.errors import StoreError
from chatctx.monitor import totals
from chatctx.session import ChatSession, Reply
from chatctx.store import read_jsonl

SAMPLE = "data/support_sample.jsonl"


@click.command()
@click.option(
    "--file",
    "path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="JSON Lines conversation whose user turns are replayed "
    "(default: the bundled support sample).",
)
@click.option(
    "--max-tokens", type=int, default=96, show_default=True, help="Most tokens per reply."
)
@click.option("--seed", type=int, default=42, show_default=True, help="Sampling seed.")
@db_option
@model_option
@engine_options
@click.option("--json", "as_json", is_flag=True, help="Print the per-turn figures as JSON.")
@handle_errors
def demo(
    path: Path | None,
    max_tokens: int,
    seed: int,
    db: str | None,
    model: str | None,
    n_ctx: int | None,
    n_gpu_layers: int | None,
    chat_format: str | None,
    as_json: bool,
) -> None:
    """Send each user message of a logged support chat to the model and show what it cost.

    The replies are generated (not the logged ones) and stored in a new conversation. On
    Ctrl-C or SIGTERM the reply so far is stored with status ``partial``.
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
            settings={"max_tokens": max_tokens, "seed": seed, "temperature": 0.7},
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
                    }
                    for i, r in enumerate(replies, start=1)
                ],
            }
        )
        return
    table = Table(
        "turn",
        "prompt",
        "reused",
        "evaluated",
        "generated",
        "TTFT ms",
        "tok/s",
        title="per-turn figures",
    )
    for i, r in enumerate(replies, start=1):
        table.add_row(
            str(i),
            str(r.usage.prompt_tokens),
            str(r.usage.reused_tokens),
            str(r.usage.evaluated_tokens),
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
