"""``chatctx replay`` and ``chatctx tune``: logged conversations through the context builder."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from chatctx.backends.base import Backend
from chatctx.cli._common import (
    console,
    db_option,
    err_console,
    handle_errors,
    model_option,
    resolve_db,
)
from chatctx.cli._options import field_option
from chatctx.errors import ChatctxError, ConfigError, ImportFormatError
from chatctx.replay import (
    REPLAY_CONTEXT,
    ConversationReport,
    LoggedConversation,
    Probe,
    ReplayConfig,
    Replayer,
    read_logs,
    replay_all,
    summarize,
    turn_rows,
)
from chatctx.replay.tune import PLOT_INSTALL, plot, plot_available, recommend, sweep, write_table
from chatctx.settings import ContextSettings
from chatctx.store import Store

F = TypeVar("F", bound=Callable[..., Any])


def context_options(func: F) -> F:
    """The ``ContextSettings`` a replay is given (the defaults of ``REPLAY_CONTEXT``)."""
    options = [
        *(
            field_option(ContextSettings, name, defaults=REPLAY_CONTEXT)
            for name in (
                "budget",
                "policy",
                "summarizer",
                "eviction",
                "layout",
                "low",
                "high",
                "recall",
                "recall_search",
                "recall_budget",
            )
        ),
        field_option(
            ContextSettings,
            "reserve",
            help_after="A replay's default: 16, or --max-tokens with --regenerate.",
        ),
        field_option(ReplayConfig, "system"),
        field_option(ReplayConfig, "max_turns"),
        click.option("--limit", type=int, default=None, help="Replay at most N conversations."),
        click.option(
            "--on-error",
            type=click.Choice(["fail", "skip"]),
            default="fail",
            show_default=True,
            help="On a bad line or conversation: stop (results so "
            "far are still written) or skip it and report it at the end.",
        ),
        click.option(
            "--from-db",
            is_flag=True,
            help="Replay conversations stored in --db "
            "(FILE arguments are then conversation ids; none = all).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _from_db(db: str | None, ids: tuple[str, ...]) -> Iterator[LoggedConversation]:
    with Store(resolve_db(db)) as store:
        for cid in ids or tuple(c.id for c in store.list_conversations()):
            conversation = store.get_conversation(cid)
            messages = [m.to_openai() for m in store.messages(cid)]
            yield LoggedConversation(
                id=cid,
                system_prompt=conversation.system_prompt,
                messages=messages,
                source=f"db:{cid}",
                line=0,
            )


def _limited(
    items: Iterator[LoggedConversation], limit: int | None
) -> Iterator[LoggedConversation]:
    for count, item in enumerate(items):
        if limit is not None and count >= limit:
            return
        yield item


@contextmanager
def _server_backend(url: str | None, model: str | None) -> Iterator[Backend | None]:
    """A ``LlamaServerBackend`` on ``url`` for the replay (closed after it), or None."""
    if url is None:
        yield None
        return
    from chatctx.backends.llama_server import LlamaServerBackend

    with LlamaServerBackend(url, model=model) as backend:
        yield backend


@contextmanager
def _progress(total_label: str) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal (stderr); silent when not a TTY."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task(total_label, total=None)
        yield lambda n: bar.update(task, advance=n)


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _print_report(reports: list[ConversationReport], errors: list[str]) -> None:
    table = Table(
        "conv",
        "turn",
        "prompt",
        "kept",
        "summ.",
        "dropped",
        "reused",
        "evaluated",
        "evicted",
        "shifted",
        "TTFT ms",
        title="per-turn",
    )
    # Ids and error texts come from the logs: escaped, so "[/x]" prints instead of
    # breaking rich's markup.
    for report in reports:
        for t in report.turns:
            table.add_row(
                escape(report.conversation),
                str(t.turn),
                str(t.prompt_tokens),
                str(t.kept),
                str(t.summarized),
                str(t.dropped),
                str(t.reused_tokens),
                str(t.evaluated_tokens),
                str(t.evicted_tokens),
                str(t.shifted_tokens),
                _fmt(t.ttft_ms, ".0f"),
            )
    console.print(table)
    summary = Table(
        "conversation",
        "turns",
        "amplification",
        "hit ratio",
        "evictions",
        "TTFT p50",
        "TTFT p95",
        "fact retention",
        title="summary",
    )
    rows = [r.summary() for r in reports]
    rows.append(
        summarize([t for r in reports for t in r.turns], reports) | {"conversation": "overall"}
    )
    for s in rows:
        summary.add_row(
            escape(s["conversation"]),
            str(s["turns"]),
            _fmt(s["prefill_amplification"]),
            _fmt(s["cache_hit_ratio"]),
            str(s["evictions"]),
            _fmt(s["ttft_p50_ms"], ".0f"),
            _fmt(s["ttft_p95_ms"], ".0f"),
            _fmt(s["fact_retention"]),
        )
    console.print(summary)
    for error in errors:
        err_console.print(f"[yellow]skipped: {escape(error)}[/yellow]")


def _write(
    reports: list[ConversationReport], errors: list[str], as_json: bool, csv_path: Path | None
) -> None:
    if csv_path is not None:
        rows = turn_rows(reports)
        with csv_path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["conversation"])
            writer.writeheader()
            writer.writerows(rows)
    if as_json:
        document = {
            "turns": turn_rows(reports),
            "conversations": [r.summary() for r in reports],
            "summary": summarize([t for r in reports for t in r.turns], reports),
            "errors": errors,
        }
        click.echo(json.dumps(document, indent=2))
    elif reports or errors:
        _print_report(reports, errors)


@click.command()
@click.argument("files", nargs=-1)
@model_option
@context_options
@field_option(ReplayConfig, "back_to_back", "--back-to-back", is_flag=True)
@click.option("--regenerate", is_flag=True, help="Let the model write each assistant turn.")
@click.option("--dry-run", is_flag=True, help="Load no weights: tokenizer-only plans.")
@field_option(ReplayConfig, "simulate", help_after="With --dry-run only.")
@click.option(
    "--backend",
    "backend_url",
    default=None,
    metavar="URL",
    help="Replay on a running llama-server (http://host:port; --model is then the GGUF it "
    "runs, read here for the tokenizer) instead of loading the model in this process.",
)
@field_option(ReplayConfig, "max_tokens")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON document instead.")
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the per-turn table to this CSV file.",
)
@db_option
@handle_errors
def replay(
    files: tuple[str, ...],
    model: str | None,
    limit: int | None,
    on_error: str,
    from_db: bool,
    regenerate: bool,
    dry_run: bool,
    backend_url: str | None,
    as_json: bool,
    csv_path: Path | None,
    db: str | None,
    **fields: Any,
) -> None:
    """Replay logged conversations (JSON Lines: OpenAI or ShareGPT; .gz; '-' = stdin).

    Teacher-forced by default: the logged replies are the history and each turn only
    prefills, showing where the context and the KV cache break.
    """
    if regenerate and dry_run:
        raise ConfigError("--regenerate and --dry-run exclude each other")
    if backend_url and dry_run:
        raise ConfigError("--backend runs on a llama-server; --dry-run on no model: pick one")
    if fields["simulate"] != "engine" and not dry_run:
        raise ConfigError("--simulate is for --dry-run (a live run measures its backend)")
    if not files and not from_db:
        raise ConfigError("name at least one FILE ('-' for stdin), or use --from-db")
    config = ReplayConfig(
        mode="dry" if dry_run else "regenerate" if regenerate else "teacher", **fields
    )
    input_errors: list[ImportFormatError] = []
    source = (
        _from_db(db, files) if from_db else read_logs(files, on_error=on_error, errors=input_errors)
    )
    reports: list[ConversationReport] = []
    errors: list[str] = []
    failure: ChatctxError | None = None
    with (
        _server_backend(backend_url, model) as server,
        Replayer(config, model=model, engine=server) as replayer,
        _progress("replaying turns") as advance,
    ):
        try:
            replay_all(
                replayer,
                _limited(source, limit),
                on_turn=lambda t: advance(1),
                on_conversation=reports.append,
                errors=errors,
                on_error=on_error,
            )
        except ChatctxError as exc:
            failure = exc
    errors = [str(e) for e in input_errors] + errors
    _write(reports, errors, as_json, csv_path)
    if failure is not None:
        raise failure


@click.command()
@click.argument("files", nargs=-1, required=True)
@model_option
@click.option(
    "--budgets", default="512,1024,2048", show_default=True, help="Comma-separated prompt budgets."
)
@click.option(
    "--policies",
    default="trim-every-turn,watermarks",
    show_default=True,
    help="Comma-separated policies.",
)
@click.option(
    "--eviction",
    "evictions",
    default="shift",
    show_default=True,
    help="Comma-separated eviction policies (shift, recompute).",
)
@field_option(
    ContextSettings,
    "summarizer",
    type=click.Choice(["extractive", "none"]),
    help_after="(A tune runs no llm summaries.)",
)
@click.option("--with-model", is_flag=True, help="Measure real timings (teacher-forced).")
@click.option("--limit", type=int, default=None, help="Use at most N conversations.")
@click.option(
    "--min-retention",
    type=float,
    default=0.9,
    show_default=True,
    help="Objective: the smallest budget whose fact retention is at least this.",
)
@click.option(
    "--max-ttft-ms",
    type=float,
    default=None,
    help="Objective: p95 TTFT at most this (needs --with-model).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("tune"),
    show_default=True,
    help="Folder for tune.csv, tune.json and tune.png.",
)
@click.option(
    "--on-error",
    type=click.Choice(["fail", "skip"]),
    default="fail",
    show_default=True,
    help="On a bad input line: stop, or skip it.",
)
@click.option(
    "--n-ubatch",
    "n_ubatch",
    default=None,
    metavar="B,B,...",
    help="With --with-model: also time prefill by micro-batch size (e.g. 128,256,512), with "
    "the planner's compute-buffer estimate beside each.",
)
@handle_errors
def tune(
    files: tuple[str, ...],
    model: str | None,
    budgets: str,
    policies: str,
    evictions: str,
    summarizer: str,
    with_model: bool,
    limit: int | None,
    min_retention: float,
    max_ttft_ms: float | None,
    out: Path,
    on_error: str,
    n_ubatch: str | None,
) -> None:
    """Sweep budgets x policies x eviction over logged conversations and recommend one."""
    ubatches: list[int] = []
    if n_ubatch:
        try:
            ubatches = [int(b) for b in n_ubatch.split(",") if b.strip()]
        except ValueError as exc:
            raise ConfigError(f"--n-ubatch must be integers: {n_ubatch!r}") from exc
        if not with_model:
            raise ConfigError("--n-ubatch times prefill: it needs --with-model")
        if any(b < 1 for b in ubatches):
            raise ConfigError(f"--n-ubatch sizes must be positive: {n_ubatch!r}")
    try:
        budget_list = [int(b) for b in budgets.split(",") if b.strip()]
    except ValueError as exc:
        raise ConfigError(f"--budgets must be integers: {budgets!r}") from exc
    policy_list = [p.strip() for p in policies.split(",") if p.strip()]
    eviction_list = [e.strip() for e in evictions.split(",") if e.strip()]
    for p in policy_list:
        if p not in ("watermarks", "trim-every-turn"):
            raise ConfigError(f"unknown policy {p!r}")
    for e in eviction_list:
        if e not in ("shift", "recompute"):
            raise ConfigError(f"unknown eviction policy {e!r}")
    conversations = list(_limited(read_logs(files, on_error=on_error), limit))
    if not conversations:
        raise ConfigError("no conversations to tune on")
    plotting = plot_available()
    if not plotting:
        console.print(f"matplotlib is not installed: no tune.png ({PLOT_INSTALL})")
    total = len(budget_list) * len(policy_list) * len(eviction_list)
    with _progress(f"{total} settings") as advance:
        rows = sweep(
            conversations,
            budgets=budget_list,
            policies=policy_list,
            evictions=eviction_list,
            summarizer=summarizer,
            with_model=with_model,
            model=model,
            on_step=lambda row: advance(1),
        )
    csv_file, json_file = write_table(rows, out)
    title = f"chatctx tune: {len(conversations)} conversations"
    png = plot(rows, out / "tune.png", title=title) if plotting else None
    table = Table(
        "budget",
        "policy",
        "eviction",
        "amplification",
        "hit ratio",
        "TTFT p95",
        "fact retention",
        "evictions",
        title="tune",
    )
    for r in rows:
        table.add_row(
            str(r["budget"]),
            r["policy"],
            r["eviction"],
            _fmt(r["prefill_amplification"]),
            _fmt(r["cache_hit_ratio"]),
            _fmt(r["ttft_p95_ms"], ".0f"),
            _fmt(r["fact_retention"]),
            str(r["evictions"]),
        )
    console.print(table)
    best, objective = recommend(rows, min_retention=min_retention, max_ttft_ms=max_ttft_ms)
    if best is None:
        console.print(f"[yellow]{objective}[/yellow]")
    else:
        console.print(
            f"recommended ({objective}, smallest budget, then lowest amplification): "
            f"--budget {best['budget']} --policy {best['policy']} "
            f"--eviction {best['eviction']}"
        )
    console.print(f"wrote {', '.join(str(f) for f in (csv_file, json_file, png) if f)}")
    if ubatches:
        from chatctx.replay.tune import sweep_ubatch, write_ubatch_table

        with _progress(f"{len(budget_list) * len(ubatches)} micro-batch sizes") as advance:
            ub_rows = sweep_ubatch(
                conversations,
                budgets=budget_list,
                ubatches=ubatches,
                policy=policy_list[0],
                eviction=eviction_list[0],
                summarizer=summarizer,
                model=model,
                on_step=lambda row: advance(1),
            )
        ub_table = Table(
            "budget",
            "n_ubatch",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "prefill tok/s",
            "compute buffer (planned)",
            title=f"micro-batch ({policy_list[0]} + {eviction_list[0]})",
        )
        for r in ub_rows:
            ub_table.add_row(
                str(r["budget"]),
                str(r["n_ubatch"]),
                _fmt(r["ttft_p50_ms"], ".0f"),
                _fmt(r["ttft_p95_ms"], ".0f"),
                _fmt(r["prefill_tokens_per_s"], ".0f"),
                f"{r['compute_bytes_planned'] / 2**20:.1f} MiB",
            )
        console.print(ub_table)
        console.print(f"wrote {write_ubatch_table(ub_rows, out)}")


__all__ = ["Probe", "replay", "tune"]
