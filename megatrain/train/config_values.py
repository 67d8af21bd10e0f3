"""Checks of single config values, with errors that name the key (`ConfigError`)."""
from __future__ import annotations

from typing import Any

from megatrain.settings import SettingError, check_setting, parse_setting


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the key and says what to do."""


def check_type(key: str, value: Any, t: Any) -> Any:
    """`value` as type `t`, or a ConfigError naming the key (megatrain/settings.py)."""
    try:
        return check_setting(key, value, t)
    except SettingError as e:
        raise ConfigError(str(e)) from None


def parse_override(key: str, text: str, t: Any) -> Any:
    """Parse the text of `--set key=text` to the field's type: the one grammar of every command."""
    try:
        return parse_setting(key, text, t)
    except SettingError as e:
        raise ConfigError(f"--set {key}={text.strip()}: {e}") from None


def one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}")


def positive(key: str, value) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be positive")


def at_least(key: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"{key}={value} must be >= {low}")
