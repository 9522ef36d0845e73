"""Shared CLI plumbing: options, error translation, output helpers."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from pydantic import ValidationError
from rich.console import Console

from chatctx.cli._options import FLASH_CHOICE, field_option
from chatctx.errors import ChatctxError
from chatctx.settings import EngineConfig, Settings

F = TypeVar("F", bound=Callable[..., Any])

# Wide enough for the per-turn tables when output goes to a file or a pipe.
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False)


def settings() -> Settings:
    try:
        return Settings.from_env()
    except ChatctxError as exc:
        raise click.ClickException(str(exc)) from exc


def db_option(func: F) -> F:
    return click.option(
        "--db",
        "db",
        metavar="URL",
        default=None,
        help="SQLAlchemy database URL (default: CHATCTX_DB or ~/.local/share/chatctx).",
    )(func)


def model_option(func: F) -> F:
    return click.option(
        "--model",
        "-m",
        "model",
        metavar="GGUF",
        default=None,
        help="GGUF model file (default: CHATCTX_MODEL or the embedded SmolLM2).",
    )(func)


def json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(func)


def resolve_db(db: str | None) -> str:
    return db or settings().db


def handle_errors(func: F) -> F:
    """Turn chatctx errors into a one-line message and exit status 1, and a value a settings
    model refuses into a usage error naming the option (exit status 2), never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ChatctxError as exc:
            raise click.ClickException(str(exc)) from exc
        except ValidationError as exc:
            raise click.UsageError(invalid_options(exc)) from exc

    return wrapper  # type: ignore[return-value]


def invalid_options(exc: ValidationError) -> str:
    """One line for a settings model's refusal: each field as its option, with the reason
    and the value given (``--low: Input should be less than or equal to 1 (got 1.5)``)."""
    parts = []
    for error in exc.errors(include_url=False):
        names = [str(part) for part in error["loc"] if not isinstance(part, int)]
        reason = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        if not names or isinstance(given, dict):  # a check of several fields together
            parts.append(reason)
        else:
            parts.append(f"--{names[-1].replace('_', '-')}: {reason} (got {given!r})")
    return "; ".join(parts)


def print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def is_tty() -> bool:
    return sys.stdout.isatty()


# Options that only shape the llama.cpp context: collected here and merged by
# ``build_engine_options``, so commands need no parameter for each.
_CACHE_OPTIONS = ("type_k", "type_v", "flash_attn", "rope_scaling", "rope_freq_scale", "kv_unified")


def engine_options(func: F) -> F:
    """How the model is loaded: --n-ctx, --n-gpu-layers, --chat-format, KV cache and RoPE."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cache = {key: kwargs.pop(key) for key in _CACHE_OPTIONS}
        click.get_current_context().meta["chatctx.backends.engine"] = {
            key: value for key, value in cache.items() if value is not None
        }
        return func(*args, **kwargs)

    command: Any = wrapper
    for decorator in (
        field_option(EngineConfig, "kv_unified"),
        field_option(EngineConfig, "rope_freq_scale"),
        field_option(EngineConfig, "rope_scaling"),
        field_option(EngineConfig, "flash_attn", type=FLASH_CHOICE),
        field_option(EngineConfig, "type_v"),
        field_option(EngineConfig, "type_k"),
        field_option(EngineConfig, "chat_format"),
        field_option(
            EngineConfig, "n_gpu_layers", default=None, help_after="Default: CHATCTX_N_GPU_LAYERS."
        ),
        field_option(EngineConfig, "n_ctx", default=None, help_after="Default: CHATCTX_N_CTX."),
    ):
        command = decorator(command)
    return command  # type: ignore[no-any-return]


def build_engine_options(
    n_ctx: int | None, n_gpu_layers: int | None, chat_format: str | None
) -> dict[str, Any]:
    env = settings()
    options: dict[str, Any] = {
        "n_ctx": n_ctx or env.n_ctx,
        "n_gpu_layers": env.n_gpu_layers if n_gpu_layers is None else n_gpu_layers,
    }
    if chat_format:
        options["chat_format"] = chat_format
    context = click.get_current_context(silent=True)
    if context is not None:
        options.update(context.meta.get("chatctx.backends.engine", {}))
    return options


def turn_figures(reply: Any) -> str:
    """One line of per-turn token and timing figures."""
    u, t = reply.usage, reply.timings
    ttft = f"{t.ttft_ms:.0f} ms" if t.ttft_ms is not None else "-"
    tps = f"{t.decode_tokens_per_s:.1f} tok/s" if t.decode_tokens_per_s else "-"
    return (
        f"prompt {u.prompt_tokens} tok (reused {u.reused_tokens}, evaluated "
        f"{u.evaluated_tokens}) · generated {u.generated_tokens} · TTFT {ttft} · {tps} · "
        f"{reply.stop_reason}"
    )
