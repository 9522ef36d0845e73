"""``chatctx serve``: the OpenAI-compatible service (``chatctx.serve``) on uvicorn."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from chatctx.cli._common import (
    build_engine_options,
    db_option,
    engine_options,
    handle_errors,
    model_option,
)
from chatctx.cli._options import field_option
from chatctx.errors import ConfigError
from chatctx.settings import Limits, ServeConfig, load_api_keys


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
@field_option(ServeConfig, "host")
@field_option(ServeConfig, "port")
@db_option
@model_option
@field_option(
    ServeConfig, "backend_urls", "--backend", "backend_urls", multiple=True, metavar="URL"
)
@field_option(ServeConfig, "slot_save_path", metavar="DIR")
@field_option(ServeConfig, "swap_disk_mb")
@field_option(ServeConfig, "summary_slot")
@field_option(ServeConfig, "slots")
@click.option(
    "--api-keys",
    "api_keys",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help='JSON file {"<key>": "<tenant>"} (or CHATCTX_API_KEYS / CHATCTX_API_KEYS_FILE). '
    "Without keys the server only listens on loopback.",
)
@field_option(ServeConfig, "model_id")
@field_option(Limits, "max_body_bytes")
@field_option(Limits, "max_message_chars")
@field_option(Limits, "max_messages")
@field_option(Limits, "max_concurrent_turns")
@field_option(Limits, "request_timeout_s", "--request-timeout")
@field_option(Limits, "conversation_wait_s", "--conversation-wait")
@field_option(Limits, "drain_timeout_s", "--drain-timeout")
@click.option(
    "--access-log/--no-access-log", default=True, help="JSON access log on stderr (no text)."
)
@engine_options
@handle_errors
def serve(
    db: str | None,
    model: str | None,
    backend_urls: tuple[str, ...],
    api_keys: Path | None,
    access_log: bool,
    n_ctx: int | None,
    n_gpu_layers: int | None,
    chat_format: str | None,
    **fields: Any,
) -> None:
    """Serve OpenAI's chat completions API, remembering conversations.

    A request with "conversation": "<id>" (the OpenAI client: extra_body) sends only the new
    message: the server keeps the history, fits it to the budget and keeps the KV cache
    warm. The live cache page is at /, metrics at /metrics. SIGTERM drains: replies in
    flight finish (or are stored as partial at --drain-timeout), then the server exits 0.
    """
    try:
        from chatctx.serve import serve as run
    except ImportError as exc:
        raise ConfigError(
            f"chatctx serve needs the 'serve' extra (pip install 'chatctx[serve]'): {exc}"
        ) from exc
    limits = {name: fields.pop(name) for name in Limits.model_fields if name in fields}
    config = ServeConfig(
        db=db,
        model=model,
        backend_urls=list(backend_urls),
        engine_options=build_engine_options(n_ctx, n_gpu_layers, chat_format),
        api_keys=load_api_keys(api_keys),
        limits=limits,
        **fields,
    )
    _logging(access_log)
    run(config)
