"""What ``chatctx serve`` is told: where to listen, what to run, keys and limits."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatctx.errors import ConfigError

# A tenant name is a prefix of the stored conversation id (``tenant:id``): it may not hold
# the separator, so one tenant's ids can never be spelled as another's.
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
KEYS_ENV = "CHATCTX_API_KEYS"  # the JSON object itself
KEYS_FILE_ENV = "CHATCTX_API_KEYS_FILE"  # or a file holding it


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Model):
    """What one request, one tenant and one conversation may take."""

    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest request body.")
    max_message_chars: int = Field(
        32_000, ge=1, description="Longest message content, in characters."
    )
    max_messages: int = Field(64, ge=1, description="Most messages in one request.")
    max_concurrent_turns: int = Field(
        8,
        ge=1,
        description="Turns one tenant may have in flight at once; more get 429 with Retry-After.",
    )
    request_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A turn still running after this is cut: the reply so far is stored as "
        "partial and returned (finish_reason length); before any token, 504.",
    )
    conversation_wait_s: float = Field(
        30.0,
        ge=0,
        description="How long a turn waits for an earlier turn of the same conversation "
        "before 409.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long in-flight replies may go on before they are cut "
        "(stored as partial).",
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429 and 503.")


class ServeConfig(_Model):
    """Everything ``create_app`` and ``serve`` need; the CLI builds one from its options."""

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port (0 picks a free one).")
    db: str | None = Field(None, description="SQLAlchemy URL; None = CHATCTX_DB / default.")
    model: str | None = Field(None, description="GGUF path; None = CHATCTX_MODEL / embedded.")
    backend_urls: list[str] = Field(
        default_factory=list, description="llama-server URLs instead of a local model."
    )
    slot_save_path: str | None = Field(
        None,
        description="The llama-servers' --slot-save-path (the same path on each): a slot "
        "given to another conversation is saved there and restored when its conversation "
        "comes back. None: no swap (the server's own host-RAM prompt cache still works).",
    )
    swap_disk_mb: float = Field(
        4096.0, gt=0, description="With slot_save_path: the most its swap files may take."
    )
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="Engine.load options (n_ctx, slots, ...)."
    )
    model_id: str | None = Field(
        None, description="Name in /v1/models and responses; None = the model file's name."
    )
    api_keys: dict[str, str] | None = Field(
        None, description="Bearer key -> tenant; None = no keys (loopback only)."
    )
    limits: Limits = Field(default_factory=Limits)
    max_open_sessions: int = Field(
        256, ge=1, description="Conversations whose ChatSession is kept open between turns."
    )


def load_api_keys(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, str] | None:
    """Keys from ``path`` (a JSON object ``{"<key>": "<tenant>"}``), else from the
    environment (``CHATCTX_API_KEYS`` holding the object, or ``CHATCTX_API_KEYS_FILE``
    naming a file); None when none is configured. Malformed keys are a ``ConfigError``."""
    env = os.environ if env is None else env
    source: str
    if path is not None:
        source = str(path)
        text = _read(Path(path))
    elif env.get(KEYS_ENV):
        source, text = KEYS_ENV, env[KEYS_ENV]
    elif env.get(KEYS_FILE_ENV):
        source = env[KEYS_FILE_ENV]
        text = _read(Path(source))
    else:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: API keys are not JSON: {exc}") from exc
    if not isinstance(data, dict) or not data:
        raise ConfigError(f'{source}: expected a non-empty JSON object {{"<key>": "<tenant>"}}')
    for key, tenant in data.items():
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"{source}: an API key is empty or holds whitespace")
        if not isinstance(tenant, str) or not TENANT_PATTERN.match(tenant):
            raise ConfigError(
                f"{source}: tenant {tenant!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
    return dict(data)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read API keys from {path}: {exc.strerror or exc}") from exc


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(config: ServeConfig) -> None:
    """Refuse to listen beyond loopback without keys: anyone could read every conversation."""
    if not config.api_keys and not is_loopback(config.host):
        raise ConfigError(
            f"refusing to listen on {config.host} without API keys: give --api-keys FILE "
            f"(or {KEYS_ENV}), or listen on 127.0.0.1"
        )


def build_config_from(**values: Any) -> ServeConfig:
    """A ``ServeConfig`` from keyword values; invalid ones are a ``ConfigError``."""
    try:
        return ServeConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"invalid serve settings: {exc}") from exc
