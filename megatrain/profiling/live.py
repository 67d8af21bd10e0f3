"""Live calibration: fit a hardware profile's rates to a run's own measured steps, and say how far off it was.

    cal = calibrate_run(program, profile, timelines, warmup=1)    # measured Timelines of the same Program
    cal.profile.save(run_dir / "profile_calibrated.json"); print("\\n".join(cal.lines()))

A profile is a measurement of one machine on one day (shared/DESIGN.md section 4); a run is a better measurement of
itself. After its warm-up steps, the run's timelines give, task by task, the time from *ready* to *done* (the
quantity `compare` compares, `compare.task_table`) and the runtime's gap before each task (`overhead.with_spans`).
What is fitted, and from what: profiling/fit.py (overheads, compute tables, the flows' rates by a fixed point
through the simulator itself).

The fit changes only rates and times, never the model: a prediction that is still off after calibration points at
something the simulator does not model (the per-group table of `compare` says where).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from megatrain.ir.facts import StepFacts
from megatrain.ir.program import Program
from megatrain.ir.tasks import TaskKind
from megatrain.sim import HardwareProfile, SimResult, simulate
from megatrain.profiling.compare import task_table
from megatrain.profiling.fit import fit_profile, step_clips
from megatrain.profiling.machine import this_machine


def group_name(group: str) -> str:
    """A task group of `compare.task_group` ("B", "UE", "FH") in words, from its kind's label (ir/tasks.py)."""
    if group == "FH":
        return "head (forward + loss + backward)"  # the head's forward task is all three, fused
    try:
        kind = TaskKind(group[0])
    except ValueError:
        return group
    where = {"E": "embedding ", "H": "head "}.get(group[1:], "")
    return f"{where}{kind.label}"


@dataclass
class LiveCalibration:
    """The profile fitted to a run, and the predictions before and after beside the measurement."""

    profile: HardwareProfile  # the calibrated profile
    before: SimResult  # the prediction with the profile the run started with
    after: SimResult  # the prediction with the calibrated profile
    measured_step_s: float  # median step time of the measured steps after the warm-up
    steps: int  # measured steps the fit used
    groups: pd.DataFrame  # per task group: summed ready-to-done time predicted before and measured, per step
    step_range: tuple[int, int] | None = None  # the first and last step measured (the run's step numbers)
    kinds: pd.DataFrame | None = None  # per task kind and stream: summed time per step, calibrated and measured

    @property
    def error_before(self) -> float:
        """(predicted - measured) / measured step time, with the profile the run started with (the mean over the
        run's clipping and other steps, `SimResult.mean_step_s`)."""
        return self.before.mean_step_s / self.measured_step_s - 1.0

    @property
    def error_after(self) -> float:
        return self.after.mean_step_s / self.measured_step_s - 1.0

    def reason(self, top: int = 2) -> str:
        """The task groups whose summed time the uncalibrated profile missed most, as "B 3.1x, U 0.6x"."""
        g = self.groups.reindex((self.groups["meas_s"] - self.groups["pred_s"]).abs()
                                .sort_values(ascending=False).index).head(top)
        parts = [(f"{group_name(r.group)} ({r.group}) took {r.meas_s / r.pred_s:.2f}x the "
                  f"profile's time") if r.pred_s > 0 else f"{r.group} took {r.meas_s * 1e3:.1f} ms, unpredicted"
                 for r in g.itertuples()]
        return "; ".join(parts)

    def lines(self, profile_name: str | None = None) -> list[str]:
        """What the run prints: both predictions beside the measurement, and one line of how far off and why."""
        name = profile_name or self.before.profile.name
        m = self.measured_step_s
        slow_fast = "fast" if self.error_before < 0 else "slow"
        # Its own steps and measure, said so: the summary's time/step above is a median over other steps (the
        # session's, the first left out) of the wall time of a whole step (train/outputs.py report_lines).
        which = (f"steps {self.step_range[0]}-{self.step_range[1]}" if self.step_range
                 else f"{self.steps} measured steps")
        first = (f"live calibration on {which} (after the warm-up): step time predicted "
                 f"{self.before.mean_step_s:.3f} s ({name} profile, {100 * self.error_before:+.0f}%) -> "
                 f"{self.after.mean_step_s:.3f} s (calibrated, in-sample, {100 * self.error_after:+.0f}%); measured "
                 f"{m:.3f} s (median over {which} of the first task's start to the last task's end)")
        if self.before.program.placement.speculative_clip:  # priced: clipping steps redo or defer their updates
            first += f"; {100 * self.before.facts.clip_share:.0f}% of these steps clipped, and are priced so"
        return [first,
                (f"the {name} profile predicted this run {_times(self.before.mean_step_s, m)} too {slow_fast}, mainly "
                 f"because {self.reason()} (a profile measures one machine on one day; the calibrated profile "
                 f"refits its rates to this run)")]

    def save(self, directory: str | Path) -> Path:
        """Write `profile_calibrated.json` (loadable by `load_profile` / `--profile`) into `directory`."""
        path = Path(directory) / "profile_calibrated.json"
        self.profile.save(path)
        return path


def _times(pred: float, meas: float) -> str:
    r = max(pred, meas) / min(pred, meas)
    return f"{r:.1f}x" if r >= 1.5 else f"{100 * abs(pred / meas - 1):.0f}%"


def calibrate_run(program: Program, profile: HardwareProfile, timelines: list[pd.DataFrame],
                  warmup: int = 1, clipped: list[bool] | None = None) -> LiveCalibration:
    """Fit `profile` to measured Timelines of `program` (the first `warmup` are left out; see the module
    docstring); returns the LiveCalibration. Needs at least one step after the warm-up. `clipped`: whether each
    timeline's step clipped (default: what the timelines record, `step_clips`); the predictions before and after
    are of the run's share of clipping steps (`StepFacts.clip_share`)."""
    flags = step_clips(program, timelines, clipped)[warmup:]
    steps = [_one_step(t) for t in timelines[warmup:]]
    if not steps:
        raise ValueError(f"live calibration needs a measured step after the {warmup} warm-up step(s)")
    facts = StepFacts(clip_share=sum(flags) / len(flags))
    before = simulate(program, profile, facts)
    fitted, kinds, measured = fit_profile(program, profile, steps, flags, with_kinds=True)
    after = simulate(program, fitted, facts)
    shown = facts.clip_share >= 1.0  # the step before.timeline is of (engine.simulate)
    tasks = task_table(program, before.timeline, [s for s, f in zip(steps, flags) if f == shown] or steps)
    groups = tasks.groupby("group", sort=False).agg(pred_s=("pred_span_s", "sum"), meas_s=("meas_span_s", "sum"))
    groups = groups.reset_index()
    return LiveCalibration(fitted, before, after, measured, len(steps), groups, kinds=kinds)


def _one_step(timeline: pd.DataFrame) -> pd.DataFrame:
    return timeline.reset_index(drop=True)


WARMUP_STEPS = 2  # the first step allocates and selects kernels (and with `overlap` its updates are no-ops)
MIN_STEPS = 2  # measured steps after the warm-up that a fit needs


def calibrate_training_run(run_dir: Path, program: Program, predicted: SimResult, profile_name: str | None,
                           timelines: list[pd.DataFrame], session_start: int, log) -> LiveCalibration | None:
    """The hook `megatrain train` calls at the end of a session: fit the run's profile to its measured steps
    after the session's warm-up (`timelines` carry their `step`), write `profile_calibrated.json` into the run
    directory and log the predictions before and after beside the measurement. Returns None (and says why) when
    the session measured too few steps."""
    steps = [t for t in timelines if int(t["step"].iloc[0]) > session_start + WARMUP_STEPS]
    if len(steps) < MIN_STEPS:
        log(f"live calibration skipped: it needs {MIN_STEPS} steps after {WARMUP_STEPS} warm-up steps; this session "
            f"kept {len(steps)}")
        return None
    cal = calibrate_run(program, predicted.profile, steps, warmup=0)
    # fitted to steps measured here: it records this machine, so a resume here starts from it (profiling/store.py)
    cal = replace(cal, step_range=(int(steps[0]["step"].iloc[0]), int(steps[-1]["step"].iloc[0])),
                  profile=replace(cal.profile, machine=this_machine()))
    path = cal.save(run_dir)
    for line in cal.lines(profile_name):
        log(line)
    log(f"calibrated profile: {path} (a resume of this run starts from it; elsewhere --set run.profile={path} or "
        f"`megatrain simulate --profile {path}`)")
    return cal
