"""The `megatrain` command: one subcommand per module of this package (`register(subparsers)` each).

`megatrain --help` and `--version` import nothing heavy: the command modules import what they need inside their
`run` functions, and the error classes printed as one line are imported only once a command runs.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
COMMANDS = ("plan", "train", "simulate", "profile", "compare", "export")


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="megatrain",
        description="Stream LLM training from host memory to one GPU; simulate schedules before running them.",
    )
    parser.add_argument("--version", action="version", version=f"megatrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"megatrain.cli.{name}").register(sub)
    return parser


def _user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that are user mistakes (one line, exit 2), imported only when a command runs."""
    from ..ir.dag import ScheduleError
    from ..spec import SpecError
    from ..training.checkpoint import CheckpointError
    from ..training.config import ConfigError
    from ..training.data import DataError
    from ..training.safetensors_io import SafetensorsFormatError

    return UserError, SpecError, ScheduleError, ConfigError, DataError, CheckpointError, SafetensorsFormatError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    errors = _user_errors()
    from ..training.errors import TrainingError

    try:
        return int(args.func(args) or 0)
    except errors as e:
        print(f"megatrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:  # the run started and stopped on its own: what happened and how to continue
        print(f"megatrain {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C anywhere (start-up included): one line, no traceback
        print(f"megatrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
