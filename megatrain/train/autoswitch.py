"""`--schedule auto` for a run on this machine: choose before the run, check the choice against the run's own steps
after the warm-up, and choose again once. The choice itself is megatrain/tune/auto.py's (the one `auto`, with the
one budget rule); this module adds what needs the machine and the running trainer.

    auto = choose_before_run(spec, batch, seq, knobs, "cuda")                # budget, profile, choice (printed)
    decision = auto.recheck(program, profile, timelines, log)                 # after WARMUP + MIN_STEPS steps
    if decision.knobs is not None: program, applied = switch_trainer(trainer, batch, seq, decision.knobs, label)

The choice was made with a profile (shared/DESIGN.md section 4: one machine on one day). When the measured step
time is more than `TOLERANCE` from the prediction, the profile is refitted to the measured steps (live
calibration, profiling/live.py) and every candidate is simulated again with the calibrated profile. The run
switches when another candidate is now predicted at least `SWITCH_GAIN` faster than the running schedule (whose
calibrated prediction is compared, not its stale one; a smaller gain is within what the fit can tell apart and
does not pay for new GPU buffers and a second warm-up). It happens at most once per run.

Only candidates with the running schedule's host layout are considered (weight and gradient wires, GPU-updated
units: `ir.resolve.resolve_host_layout`): the host store was built for that layout and holds the only copy of the
master weights and AdamW moments. Switching to another layout would mean a second store of the same size (a
7 B model's ~112 GiB twice) or converting it in place; a Program on the same store is what `use_program` supports
and costs nothing but new GPU buffers. The candidates keep the run's numerics (`tune.auto_candidates`: clipping,
dtypes, kernel, loss chunk, micro-batches), so a switch changes speed, never the numbers computed.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.compile.lower import lower
from megatrain.compile.resolve import resolve_host_layout
from megatrain.ir.dag import ScheduleError
from megatrain.model.spec import ModelSpec
from megatrain.profiling.calibrate import ProfileRequest, measure_profile, profile_host_reserve
from megatrain.profiling.compare import step_time_s
from megatrain.profiling.live import MIN_STEPS, WARMUP_STEPS, calibrate_run
from megatrain.profiling.store import ProfileChoice, reprofile_command, resolve_profile, save_measured
from megatrain.sim import estimate_line, load_profile, simulate
from megatrain.sim.profile import model_signature
from megatrain.train.fit import check_fits
from megatrain.tune.auto import AutoBudget, auto_budget, choose_auto, choose_schedule

TOLERANCE = 0.10  # |measured / predicted - 1| above this recalibrates and chooses again
SWITCH_GAIN = 0.03  # a switch (new GPU buffers, warm-up again) needs a candidate predicted at least this much faster


@dataclass
class Decision:
    """What the re-check found: the knobs to switch to (None: keep) and the calibration it used."""

    knobs: ScheduleKnobs | None
    label: str | None
    calibration: object | None  # profiling.live.LiveCalibration, None when within tolerance


@dataclass
class AutoChoice:
    """What `--schedule auto` chose before the run, and what it needs to choose again."""

    spec: ModelSpec
    batch: int
    seq: int
    knobs: ScheduleKnobs  # the chosen knobs as the trainer runs them (step knobs)
    gpu_bytes: int
    host_bytes: int | None
    label: str
    done: bool = False

    @classmethod
    def of(cls, spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, budget: AutoBudget,
           label: str) -> AutoChoice:
        """The choice `label` (`knobs`) made within `budget`, to be re-checked within the same budget."""
        return cls(spec, batch, seq, knobs, budget.gpu_bytes, budget.host_bytes, label)

    def recheck(self, program, profile, timelines: list, log) -> Decision:
        """Compare the measured steps (`timelines`, after the warm-up) with the prediction of `profile`; beyond
        TOLERANCE, calibrate, choose again among candidates with this host layout, and log why and what changed."""
        self.done = True
        measured = statistics.median(step_time_s(t.reset_index(drop=True)) for t in timelines)
        predicted = simulate(program, profile).step_s
        err = predicted / measured - 1.0
        head = (f"auto: {self.label} measured {measured:.3f} s/step over {len(timelines)} steps after the warm-up, "
                f"predicted {predicted:.3f} s ({profile.name} profile, {100 * err:+.0f}%)")
        if abs(err) <= TOLERANCE:
            log(f"{head}: within {100 * TOLERANCE:.0f}%, the choice stands")
            return Decision(None, None, None)
        cal = calibrate_run(program, profile, timelines, warmup=0)
        log(f"{head}: more than {100 * TOLERANCE:.0f}% off, so auto recalibrates and chooses again (once); "
            f"{cal.reason()}")
        try:
            best = choose_schedule(self.spec, self.batch, self.seq, self.knobs, cal.profile, self.gpu_bytes,
                                   self.host_bytes, same_host_layout=True)
        except ScheduleError as e:
            log(f"auto: no candidate to choose again from ({e}); keeping {self.label}")
            return Decision(None, None, cal)
        now = cal.after.step_s
        log(f"auto: with the calibrated profile {self.label} predicts {now:.3f} s/step; the fastest of "
            f"{len(best.table)} candidates with this host layout:")
        for row in best.table.head(3).itertuples():
            log(f"  {row.schedule}: {row.step_s:.3f} s/step predicted")
        label = best.table.schedule[0]
        if best.knobs == self.knobs or best.result.step_s > now * (1 - SWITCH_GAIN):
            log(f"auto: {self.label} stays (no candidate is predicted more than {100 * SWITCH_GAIN:.0f}% faster after "
                "calibration)")
            return Decision(None, None, cal)
        log(f"auto: switching {self.label} -> {label} ({now:.3f} -> {best.result.step_s:.3f} s/step predicted, "
            f"{100 * (best.result.step_s / now - 1):+.0f}%); same host store, same numerics")
        return Decision(best.knobs, label, cal)


def choose_before_run(spec: ModelSpec, batch: int, seq: int, base: ScheduleKnobs, backend: str, run_dir=None,
                      profile: str | None = None, gpu_gib: float | None = None, log=print,
                      resumed: bool = False) -> tuple[AutoChoice, str]:
    """`--schedule auto` before a run on this machine (`train`, scripts/bench_megatrain.py): the budget by the one
    rule (`tune.auto.auto_budget`, GPU and host), `profile` when given, else this machine's (`machine_profile`:
    profiling/store.py's precedence; `run_dir` and `resumed`: a resumed run's own calibrated profile comes first),
    the choice (`tune.auto.choose_auto`), logged with the next best. Returns the AutoChoice that re-checks it after
    the warm-up and the profile it was made with. ScheduleError when nothing fits, BudgetError without a budget."""
    budget = auto_budget(backend, gpu_gib)
    if not profile:
        profile = machine_profile(spec, batch, seq, base, backend, log, run_dir, resumed).profile
    pick = choose_auto(spec, batch, seq, base, profile, budget)
    log(f"--schedule auto ({budget.gpu_bytes / 2**30:.1f} GiB budget, profile {pick.profile}): fastest of "
        f"{len(pick.table)} that fit:")
    for row in pick.table.head(3).itertuples():
        log(f"  {row.schedule}: {row.step_s * 1e3:,.1f} ms/step predicted, {row.gpu_peak_gib:.2f} GiB")
    if estimate_line(pick.predicted):  # the ranking rests on FLOP estimates: say so (sim/estimates.py)
        log(estimate_line(pick.predicted))
    return AutoChoice.of(spec, batch, seq, pick.knobs, budget, pick.label), profile


def covers(profile, spec: ModelSpec, seq: int, dtype: str) -> bool:
    """Whether `profile` has measured compute tables of `spec`'s shape at `seq` in `dtype`."""
    sig = model_signature(spec)
    return any(t.model == sig and t.seq == seq and t.dtype == dtype for t in profile.compute_tables)


def machine_profile(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str, log=print,
                    run_dir=None, resumed: bool = False) -> ProfileChoice:
    """The profile `--schedule auto` chooses with when none is given: the one profiling/store.py resolves
    ($MEGATRAIN_PROFILE, a resumed run's calibrated profile, this machine's cached one). When that is only the
    shipped default, or the cached profile has no compute tables of this model at `seq`, this machine is profiled
    quickly first (as `megatrain profile --quick`, said so) and the tables are merged into the cache for the next
    run."""
    choice = resolve_profile(backend, run_dir=run_dir, resumed=resumed)
    if choice.source in ("env", "run"):  # asked for, or fitted to this very run
        log(f"--schedule auto: {choice.line()}")
        return choice
    if choice.source == "cache":
        if covers(load_profile(choice.profile), spec, seq, knobs.compute_dtype):
            log(f"--schedule auto: using this machine's profile {choice.profile}")
            return choice
        why = f"this machine's profile {choice.profile} has no compute tables of {spec.name} at seq {seq}"
    else:
        why = f"no profile of this machine: {choice.reason}"
    cmd = reprofile_command(backend, spec.name, batch, seq)
    log(f"--schedule auto: {why}; so it is profiled quickly first (as `{cmd}`)")
    check_fits(spec.with_layers(min(2, spec.num_layers)), batch, seq, knobs, backend, f"profiling {spec.name}",
               "lower --batch / --seq, or give --set run.profile=FILE", profile_host_reserve(spec, backend, True))
    t0 = time.perf_counter()
    cal = measure_profile(ProfileRequest(spec, batch=batch, seqs=[seq], device=backend,
                                         dtypes=[knobs.compute_dtype], quick=True, knobs=knobs),
                          log=lambda _line: None)
    path, _ = save_measured(cal, log=lambda line: log(f"--schedule auto: {line}"))
    del cal
    if backend == "cuda":  # the profile's buffers are gone; give their cached blocks back before the run
        gc.collect()
        torch.cuda.empty_cache()
    log(f"--schedule auto: profiled this machine in {time.perf_counter() - t0:.1f} s: {path}")
    return ProfileChoice(str(path), "this machine's profile in the cache, measured just now", "cache")


def switch_trainer(trainer, batch: int, seq: int, knobs: ScheduleKnobs, name: str):
    """Run `knobs` on `trainer` from the next step: the pending update (overlap timing) is applied first with the
    old Program, as a checkpoint does, then the new Program takes the same host store (`use_program`). Returns the
    new Program and the update plan the flush applied (None if none was pending)."""
    if resolve_host_layout(trainer.spec, knobs) != resolve_host_layout(trainer.spec, trainer.knobs):
        raise ValueError("auto switches only between schedules with the same host layout")  # see the docstring
    applied = trainer.flush()
    sched = build_schedule(trainer.spec, batch, seq, knobs)
    sched.name = name
    program = lower(sched)
    trainer.use_program(program)
    trainer.knobs, trainer.schedule_name = replace(knobs), name
    return program, applied


def schedule_overrides(knobs, micro_batches: int) -> list[str]:
    """Config overrides that set every schedule knob of `knobs` (step knobs: micro-batches as configured)."""
    knobs = replace(knobs, micro_batches=micro_batches)  # the loop multiplies it by grad_accum
    return ["schedule.name=overlap"] + [f"schedule.{k}={v}" for k, v in knobs.to_dict().items() if v is not None]


def switch_after_warmup(run, step: int, start: int, timelines: list) -> bool:
    """`--schedule auto` after the warm-up: re-check the choice of `run` (a train/loop._Training) once, and switch
    its trainer to another schedule when the calibrated profile predicts one faster; the run takes the new Program,
    its prediction and knobs through its public `switch_schedule`. True when it switched."""
    if run.auto is None or run.auto.done or run.predicted is None or step - start < WARMUP_STEPS + MIN_STEPS:
        return False
    warm = [t for t in timelines if int(t["step"].iloc[0]) > start + WARMUP_STEPS]
    decision = run.auto.recheck(run.program, run.predicted.profile, warm, run.log)
    if decision.knobs is None:
        return False
    program, applied = switch_trainer(run.trainer, run.batch, run.seq, decision.knobs, decision.label)
    run.switch_schedule(decision.knobs, program, simulate(program, run.predicted.profile), applied)
    return True
