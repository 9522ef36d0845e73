"""Checks on what ``chatctx serve`` is told (its settings are ``chatctx.settings.ServeConfig``)."""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import ValidationError

from chatctx.errors import ConfigError
from chatctx.settings import KEYS_ENV, ServeConfig


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
