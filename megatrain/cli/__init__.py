"""The `megatrain` command: one subcommand per module of this package (`register(subparsers)` each).

`megatrain --help` and `--version` import nothing heavy: the command modules import what they need inside their
`run` functions, and the error classes printed as one line are imported only once a command runs.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

# Each module defines `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
COMMANDS = ("plan", "train", "simulate", "profile", "compare", "export")


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose mistakes are one line (what is wrong, where to look), not the usage block: every
    error of the CLI reads the same. Subcommand parsers inherit it (argparse makes them of the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain import __version__

    parser = OneLineParser(
        prog="megatrain",
        description="Stream LLM training from host memory to one GPU; simulate schedules before running them.",
    )
    parser.add_argument("--version", action="version", version=f"megatrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"megatrain.cli.{name}").register(sub)
    return parser


def _is_user_error(e: Exception) -> bool:
    """Whether `e` is a user mistake (one line, exit 2). The error types are imported only once one was raised, the
    torch-free ones first: `plan` and `simulate` never need torch, not even to report a mistake."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.ir.dag import ScheduleError
    from megatrain.model.spec import SpecError
    from megatrain.compile.record import RecordError
    from megatrain.settings import SettingError
    from megatrain.sim.profile_checks import ProfileError
    from megatrain.train.config_values import ConfigError
    from megatrain.tune.auto import BudgetError

    if isinstance(e, (UserError, SpecError, ScheduleError, ConfigError, ProfileError, SettingError, RecordError,
                      BudgetError)):
        return True
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.io.errors import CheckpointError
    from megatrain.data.errors import DataError
    from megatrain.data.tokenization import TokenizerError
    from megatrain.io.safetensors_io import SafetensorsFormatError

    return isinstance(e, (DataError, TokenizerError, CheckpointError, SafetensorsFormatError))


def _stdout_to_devnull() -> None:
    from megatrain.train.log import stdout_to_devnull  # only once a pipe closed: the CLI loads no train/ to start

    stdout_to_devnull()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C anywhere (start-up included): one line, no traceback
        print(f"megatrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed (`megatrain plan | head`): the reader has what it wanted
        _stdout_to_devnull()  # else Python's flush at exit raises again
        print(f"megatrain {args.command}: stdout was closed; the output was cut short", file=sys.stderr)
        return 128 + signal.SIGPIPE
    except Exception as e:
        if _is_user_error(e):
            print(f"megatrain {args.command}: error: {e}", file=sys.stderr)
            return 2
        # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
        from megatrain.train.errors import TrainingError

        if isinstance(e, TrainingError):  # the run started and stopped on its own: what happened, how to go on
            print(f"megatrain {args.command}: stopped: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
