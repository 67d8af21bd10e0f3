"""What a training run returns: `RunSummary`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunSummary:
    """What `run_training` did."""

    run_dir: Path
    start_step: int  # steps done before this session (0 for a fresh run)
    steps: int  # steps done at the end of this session
    losses: list[float] = field(default_factory=list)  # training loss of each step of this session
    eval_losses: dict[int, float] = field(default_factory=dict)  # {step: held-out loss}
    tokens: int = 0  # target tokens trained on in this session
    elapsed_s: float = 0.0
    measured_step_s: float | None = None  # median step time (the first step of the session left out)
    measured_idle_pct: float | None = None  # median GPU idle %
    predicted: object | None = field(default=None, repr=False)  # megatrain.sim.SimResult (run.simulate)
    checkpoint: Path | None = None  # the newest checkpoint
    export_dir: Path | None = None
    stopped_early: bool = False  # stop_at_step or a signal ended the session before run.steps
    stop_signal: str | None = None  # "SIGTERM" / "SIGINT" when a signal ended the session
    skipped_steps: list[int] = field(default_factory=list)  # steps whose update was skipped, wholly or in part
    calibration: object | None = field(default=None, repr=False)  # megatrain.profiling.live.LiveCalibration
