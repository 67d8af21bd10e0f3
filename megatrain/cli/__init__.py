"""The `megatrain` command: one subcommand per module of this package (`register(subparsers)` each)."""
from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
COMMANDS = ("plan", "train", "simulate", "profile", "compare")


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatrain",
        description="Stream LLM training from host memory to one GPU; simulate schedules before running them.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"megatrain.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..ir.dag import ScheduleError
    from ..spec import SpecError
    from ..training.checkpoint import CheckpointError
    from ..training.config import ConfigError
    from ..training.data import DataError
    from ..training.errors import TrainingError
    from ..training.safetensors_io import SafetensorsFormatError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, SpecError, ScheduleError, ConfigError, DataError, CheckpointError, SafetensorsFormatError) as e:
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
