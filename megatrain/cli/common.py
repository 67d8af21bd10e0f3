"""Subcommands of the `megatrain` CLI, one module each (see megatrain/cli/__init__.py)."""
from __future__ import annotations

from pathlib import Path

from megatrain.compile.knobs import DEFAULT_SCHEDULE

__all__ = ["DEFAULT_SCHEDULE", "add_run_arguments"]


def add_run_arguments(p, model: str, batch: int, seq: int,
                      schedule_help: str = "named schedule or TOML file ([schedule] table of knobs)") -> None:
    """--model, --batch, --seq, --schedule and --set: what every command that builds a Program takes."""
    p.add_argument("--model", default=model, help="preset name or HF model dir / config.json")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, help=schedule_help)
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="override a schedule knob")


def gpu_budget_bytes(gib: float | None) -> int:
    """The GPU memory `--schedule auto` may plan for: `--gpu-budget-gib`, or this GPU's free memory less 10%."""
    from megatrain.cli import UserError

    if gib is not None:
        return int(gib * 2**30)
    if Path("/proc/driver/nvidia").exists():
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0] * 0.9)
    raise UserError("--schedule auto needs a GPU memory budget and there is no GPU here to measure: give "
                    "--gpu-budget-gib (e.g. 16)")


def write_schedule_file(path: Path, knobs) -> Path:
    """A schedule file (`[schedule]` table: name plus every knob) that reproduces `knobs`."""
    from megatrain.settings import toml_value

    lines = ["[schedule]", 'name = "overlap"  # the base; every knob is set below']
    lines += [f"{key} = {toml_value(value)}" for key, value in knobs.to_dict().items() if value is not None]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
