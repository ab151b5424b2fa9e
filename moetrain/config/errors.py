"""The error every config check raises, and the two helpers each section's ``validate()``
uses to raise it: every message starts with the key it is about."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or impossible. The message names the key."""


def _fail(key: str, msg: str) -> None:
    raise ConfigError(f"{key}: {msg}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            _fail(f"{section}.{name}", f"must be > 0, got {value}")
