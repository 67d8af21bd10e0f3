"""The checks a hardware profile's fields pass when it loads, and the error that names the field that fails.

A profile is user input (a JSON file `megatrain profile` wrote, maybe edited or truncated since). A wrong number in
it must be refused when the profile loads, naming the field, not found later by the simulator (simpy's "Negative
delay" after a minute of simulation, a ZeroDivisionError, a comparison of a str with an int). Every numeric field
of sim/profile.py goes through `number`; a mapping of numbers (by dtype, thread count, stream...) through `numbers`.

The vocabulary of the bounds:
    rate     > 0, `inf` allowed (inf bandwidth or rate: the resource is free)
    time     >= 0 and finite (a latency, an overhead, a measured duration)
    size     > 0 and finite (message sizes of a collectives table)
    count    a positive integer (copy sizes in bytes, tokens, threads)
    fraction in (0, 1]
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from megatrain.ir.tasks import Collective

RATE, TIME, SIZE, COUNT, FRACTION = "rate", "time", "size", "count", "fraction"
_MEANING = {RATE: "a number > 0 (inf: free)", TIME: "a finite number >= 0", SIZE: "a finite number > 0",
            COUNT: "a positive integer",
            FRACTION: "a number in (0, 1]"}


class ProfileError(ValueError):
    """A profile the simulator cannot use; the message says which field and what to do."""


def number(where: str, value, bound: str, at_least: float | None = None) -> float | int:
    """`value` as a float (an int for COUNT) if it is a number within `bound` (and >= `at_least` if given), else a
    ProfileError naming `where`. bool and numeric strings are refused: JSON has numbers, a string is a mistake."""
    need = _MEANING[bound] + (f" and >= {at_least:g}" if at_least is not None else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where} must be {need}, got {value!r}")
    ok = not math.isnan(value)
    if ok and bound == RATE:
        ok = value > 0
    elif ok and bound == TIME:
        ok = math.isfinite(value) and value >= 0
    elif ok and bound == SIZE:
        ok = math.isfinite(value) and value > 0
    elif ok and bound == COUNT:
        ok = math.isfinite(value) and value > 0 and value == int(value)
    elif ok and bound == FRACTION:
        ok = 0 < value <= 1
    if ok and at_least is not None:
        ok = value >= at_least
    if not ok:
        raise ProfileError(f"{where} must be {need}, got {value!r}")
    return int(value) if bound == COUNT else float(value)


def numbers(where: str, values, bound: str, *, int_keys: bool = False, at_least: float | None = None) -> dict:
    """A mapping whose every value passes `number` (keys: str, or positive integers written as JSON strings when
    `int_keys`), checked and converted."""
    if not isinstance(values, Mapping):
        raise ProfileError(f"{where} must be a JSON object (key: value), got {values!r}")
    out = {}
    for key, value in values.items():
        if int_keys:
            try:
                k = int(key)
            except (TypeError, ValueError):
                raise ProfileError(f"{where}: key {key!r} must be a positive integer") from None
            if k <= 0 or isinstance(key, bool):
                raise ProfileError(f"{where}: key {key!r} must be a positive integer")
        elif not isinstance(key, str):
            raise ProfileError(f"{where}: key {key!r} must be a string")
        else:
            k = key
        out[k] = number(f"{where}[{key!r}]", value, bound, at_least)
    return out


def sequence(where: str, values, bound: str) -> tuple:
    """A non-empty JSON list whose every item passes `number`."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        raise ProfileError(f"{where} must be a list of numbers, got {values!r}")
    out = tuple(number(f"{where}[{i}]", v, bound) for i, v in enumerate(values))
    if not out:
        raise ProfileError(f"{where} must hold at least one value")
    return out


def increasing(where: str, values: tuple) -> None:
    """Refuse a table axis that is not strictly increasing (interpolation needs it)."""
    if list(values) != sorted(set(values)):
        raise ProfileError(f"{where} must be strictly increasing, got {list(values)}")


def text(where: str, value) -> str:
    if not isinstance(value, str):
        raise ProfileError(f"{where} must be a string, got {value!r}")
    return value


def collectives(where: str, tables) -> dict[str, dict]:
    """The `collectives` field: per collective letter ("G", "Z", "A") a latency, increasing message sizes, a bus
    bandwidth at each, and optionally a cap (sim/collectives.py reads them so)."""
    if not isinstance(tables, Mapping):
        raise ProfileError(f"{where} must be a JSON object keyed by collective letter, got {tables!r}")
    letters = [c.value for c in Collective]
    out = {}
    for kind, t in tables.items():
        at = f"{where}[{kind!r}]"
        if kind not in letters:
            raise ProfileError(f"{where}: unknown collective {kind!r}; use one of {letters}")
        if not isinstance(t, Mapping) or set(t) - {"latency_s", "sizes", "bus_Bps", "cap_Bps"} \
                or not {"latency_s", "sizes", "bus_Bps"} <= set(t):
            raise ProfileError(f"{at} must hold latency_s, sizes and bus_Bps (and optionally cap_Bps), got {t!r}")
        sizes = sequence(f"{at}.sizes", t["sizes"], SIZE)
        increasing(f"{at}.sizes", sizes)
        rates = sequence(f"{at}.bus_Bps", t["bus_Bps"], RATE)
        if len(sizes) != len(rates):
            raise ProfileError(f"{at}: sizes and bus_Bps must have the same length")
        out[kind] = dict(t, latency_s=number(f"{at}.latency_s", t["latency_s"], TIME), sizes=list(sizes),
                         bus_Bps=list(rates))
        if "cap_Bps" in t:
            out[kind]["cap_Bps"] = number(f"{at}.cap_Bps", t["cap_Bps"], RATE)
    return out
