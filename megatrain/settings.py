"""Typed settings from text and from TOML: the one grammar of `--set key=value` for every command.

    parse_setting("buffers", "3", int)              -> 3
    parse_setting("compile_layers", "on", bool)     -> True      (true/false, 1/0, yes/no, on/off)
    parse_setting("lr", "3e-4", float)              -> 0.0003    (1_000 is 1000)
    parse_setting("state_buffers", "none", int | None) -> None   (optional settings: none / unset)
    parse_setting("layers", "[0, 7]", tuple[int, ...]) -> (0, 7) (or "0,7")
    check_setting("buffers", 3, int)                -> 3         (a TOML value; ints are accepted for floats)

Errors are `SettingError` (a ValueError) naming the key and the expected type; callers re-raise them as their own
error type (ScheduleError, ConfigError) so the CLI prints one line.
"""
from __future__ import annotations

import math
import types
import typing
from typing import Any
import dataclasses
import json


class SettingError(ValueError):
    """A setting's value does not have the setting's type."""


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_NONE = ("none", "unset")


def _parts(t: Any) -> tuple[Any, bool]:
    """(the base type, whether None is allowed) of `T` or `T | None`."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(t))
    return t, False


def type_name(t: Any) -> str:
    base, optional = _parts(t)
    if typing.get_origin(base) in (tuple, list):
        name = f"a list of {type_name(typing.get_args(base)[0]).split(' ', 1)[1]}s"
    else:
        name = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}[base]
    return name + (" (or none)" if optional else "")


def parse_setting(key: str, text: str, t: Any) -> Any:
    """The value of `--set key=text` for a setting of type `t`."""
    text = text.strip()
    base, optional = _parts(t)
    if optional and text.lower() in _NONE:
        return None
    if typing.get_origin(base) in (tuple, list):
        inner = text[1:-1] if text[:1] == "[" and text[-1:] == "]" else text
        item = typing.get_args(base)[0]
        return tuple(parse_setting(key, part, item) for part in inner.split(",") if part.strip())
    if base is str:
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]
        return text
    if base is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    else:
        try:
            value = base(text.replace("_", ""))
            if base is float and not math.isfinite(value):
                raise ValueError(text)
            return value
        except ValueError:
            pass
    raise SettingError(f"{key} must be {type_name(t)}, got {text!r}")


def check_setting(key: str, value: Any, t: Any) -> Any:
    """A value read from TOML (or JSON) as type `t`: integers are accepted for floats, lists for tuples, nothing
    else is converted."""
    base, optional = _parts(t)
    if value is None and optional:
        return None
    if typing.get_origin(base) in (tuple, list) and isinstance(value, (list, tuple)):
        return tuple(check_setting(key, v, typing.get_args(base)[0]) for v in value)
    ok = isinstance(value, base) if isinstance(base, type) else False
    ok = ok and not (base in (int, float) and isinstance(value, bool))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise SettingError(f"{key} must be {type_name(t)}, got {value!r} ({type(value).__name__})")
    if base is float and not math.isfinite(value):
        raise SettingError(f"{key} must be finite, got {value}")
    return value


def toml_value(v: Any) -> str:
    """A scalar setting as TOML text (the inverse of reading it back with `tomllib`)."""

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # a TOML basic string: JSON's escapes are valid TOML escapes


def field_types(cls) -> dict[str, Any]:
    """{field name: resolved type} of a dataclass (annotations may be strings under `from __future__`)."""

    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
