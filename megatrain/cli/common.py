"""Subcommands of the `megatrain` CLI, one module each (see megatrain/cli/__init__.py)."""
from __future__ import annotations

from ..ir.knobs import DEFAULT_SCHEDULE


def add_run_arguments(p, model: str, batch: int, seq: int,
                      schedule_help: str = "named schedule or TOML file ([schedule] table of knobs)") -> None:
    """--model, --batch, --seq, --schedule and --set: what every command that builds a Program takes."""
    p.add_argument("--model", default=model, help="preset name or HF model dir / config.json")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, help=schedule_help)
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="override a schedule knob")
