"""Subcommands of the `megatrain` CLI, one module each (see megatrain/cli/__init__.py)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from megatrain.compile.knobs import DEFAULT_SCHEDULE

__all__ = ["DEFAULT_SCHEDULE", "add_run_arguments", "positive_float", "positive_int"]


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a memory size, a budget); nan, inf and negatives are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number > 0")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count of GPUs, hosts, steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return value


def add_run_arguments(p, model: str, batch: int, seq: int,
                      schedule_help: str = "named schedule or TOML file ([schedule] table of knobs)") -> None:
    """--model, --batch, --seq, --schedule and --set: what every command that builds a Program takes."""
    p.add_argument("--model", default=model, help="preset name or HF model dir / config.json")
    # Each command has the default shape of its own job (a debug run, a 3B benchmark): --help says which, and the
    # command prints the shape it used in its first line (tests/test_shape_defaults.py).
    p.add_argument("--batch", type=int, default=batch, help=f"sequences per step (default {batch}; the first line "
                                                            "of the output says which shape ran)")
    p.add_argument("--seq", type=int, default=seq, help=f"tokens per sequence (default {seq})")
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, help=schedule_help)
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="override a schedule knob")


def write_schedule_file(path: Path, knobs) -> Path:
    """A schedule file (`[schedule]` table: name plus every knob) that reproduces `knobs`."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.settings import toml_value

    lines = ["[schedule]", 'name = "overlap"  # the base; every knob is set below']
    lines += [f"{key} = {toml_value(value)}" for key, value in knobs.to_dict().items() if value is not None]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
