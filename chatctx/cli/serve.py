"""``chatctx serve``: the OpenAI-compatible service (``chatctx.serve``) on uvicorn."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from chatctx.cli._common import (
    build_engine_options,
    db_option,
    engine_options,
    handle_errors,
    model_option,
)
from chatctx.errors import ConfigError


def _logging(access_log: bool) -> None:
    # The access log is JSON, one object a line, on stderr; the rest as the CLI logs.
    access = logging.getLogger("chatctx.serve.access")
    access.propagate = False
    access.setLevel(logging.INFO if access_log else logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    serve_logger = logging.getLogger("chatctx.serve")
    if serve_logger.getEffectiveLevel() > logging.INFO:
        serve_logger.setLevel(logging.INFO)  # startup, listening, drain lines


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port to listen on.")
@db_option
@model_option
@click.option(
    "--backend",
    "backend_urls",
    multiple=True,
    metavar="URL",
    help="A llama-server to run turns on instead of a local model (repeat for several: "
    "conversations are routed, each kept on the server holding its cache; default "
    "CHATCTX_BACKENDS). --model is then the GGUF the servers run, read for its tokenizer.",
)
@click.option(
    "--slot-save-path",
    default=None,
    metavar="DIR",
    help="With --backend: the servers' --slot-save-path (the same on each). A conversation's "
    "slot given to another is saved there and restored when it comes back.",
)
@click.option(
    "--swap-disk-mb",
    type=float,
    default=4096.0,
    show_default=True,
    help="With --slot-save-path: the most the swap files take (the oldest are deleted beyond "
    "it, where that folder is seen from this machine).",
)
@click.option(
    "--slots",
    type=int,
    default=4,
    show_default=True,
    help="Conversations whose KV caches the engine holds at once (others are swapped).",
)
@click.option(
    "--api-keys",
    "api_keys",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help='JSON file {"<key>": "<tenant>"} (or CHATCTX_API_KEYS / CHATCTX_API_KEYS_FILE). '
    "Without keys the server only listens on loopback.",
)
@click.option("--model-id", default=None, help="Model name in /v1/models (default: the file's).")
@click.option(
    "--max-body-bytes", type=int, default=1_048_576, show_default=True, help="Largest body."
)
@click.option(
    "--max-message-chars",
    type=int,
    default=32_000,
    show_default=True,
    help="Longest message in characters.",
)
@click.option(
    "--max-messages", type=int, default=64, show_default=True, help="Most messages a request."
)
@click.option(
    "--max-concurrent-turns",
    type=int,
    default=8,
    show_default=True,
    help="Turns one tenant may have in flight (more get 429).",
)
@click.option(
    "--request-timeout",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds before a turn is cut (stored as partial).",
)
@click.option(
    "--conversation-wait",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds a turn waits for the same conversation's turn in flight (then 409).",
)
@click.option(
    "--drain-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="On SIGTERM, seconds replies in flight may go on before they are cut.",
)
@click.option(
    "--access-log/--no-access-log", default=True, help="JSON access log on stderr (no text)."
)
@engine_options
@handle_errors
def serve(
    host: str,
    port: int,
    db: str | None,
    model: str | None,
    backend_urls: tuple[str, ...],
    slot_save_path: str | None,
    swap_disk_mb: float,
    slots: int,
    api_keys: Path | None,
    model_id: str | None,
    max_body_bytes: int,
    max_message_chars: int,
    max_messages: int,
    max_concurrent_turns: int,
    request_timeout: float,
    conversation_wait: float,
    drain_timeout: float,
    access_log: bool,
    n_ctx: int | None,
    n_gpu_layers: int | None,
    chat_format: str | None,
) -> None:
    """Serve OpenAI's chat completions API, remembering conversations.

    A request with "conversation": "<id>" (the OpenAI client: extra_body) sends only the new
    message: the server keeps the history, fits it to the budget and keeps the KV cache
    warm. The live cache page is at /, metrics at /metrics. SIGTERM drains: replies in
    flight finish (or are stored as partial at --drain-timeout), then the server exits 0.
    """
    try:
        from chatctx.serve import build_config_from, load_api_keys
        from chatctx.serve import serve as run
    except ImportError as exc:
        raise ConfigError(
            f"chatctx serve needs the 'serve' extra (pip install 'chatctx[serve]'): {exc}"
        ) from exc
    options = build_engine_options(n_ctx, n_gpu_layers, chat_format)
    options["slots"] = slots
    config = build_config_from(
        host=host,
        port=port,
        db=db,
        model=model,
        backend_urls=list(backend_urls),
        slot_save_path=slot_save_path,
        swap_disk_mb=swap_disk_mb,
        engine_options=options,
        model_id=model_id,
        api_keys=load_api_keys(api_keys),
        limits={
            "max_body_bytes": max_body_bytes,
            "max_message_chars": max_message_chars,
            "max_messages": max_messages,
            "max_concurrent_turns": max_concurrent_turns,
            "request_timeout_s": request_timeout,
            "conversation_wait_s": conversation_wait,
            "drain_timeout_s": drain_timeout,
        },
    )
    _logging(access_log)
    run(config)
