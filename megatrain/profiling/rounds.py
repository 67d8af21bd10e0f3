"""Many schedules measured in one process on one host store, each schedule warmed and timed in turn, interleaved
over rounds.

    from megatrain.profiling.rounds import measure_rounds
    rows = measure_rounds(spec, {"arrival": knobs_for("arrival"), "lean": knobs_for("lean")}, batch=8, seq=2048,
                          rounds=3, device="cuda", predict={"quick": "my-profile.json"})

Why: a separate process per measured configuration spends most of its time building the host store (15-40 s of a
45-75 s run for a 3 B model on the GPU machine) and starting torch; the schedules take turns on one store
(`StreamedTrainer.switch_schedule`): one of the same host layout (`compile.resolve.resolve_host_layout`: wires,
GPU-updated units, a gradient ring) costs its warm-up and timed steps only, one of another layout also takes the
store over in place (`HostStore.relayout`: the master and moments are kept, the rest rebuilt; its time is in the
row's `switch_s`).

Interleaving: round r measures every schedule once, in the same order, before round r+1 starts. A machine's load
drifts over seconds and minutes (page cache, clocks, other tenants); interleaving exposes every schedule to the
same drift, so medians over rounds compare schedules and not moments. Every schedule interleaves with every other,
whatever its layout (until issue 24's layout takeover, only schedules of one layout could, a store per layout one
after the other); each row still says its layout (`layout_group`, in first-seen order).

The weights keep training across schedules (each switch applies the pending update first, as a checkpoint does):
the step time of a schedule does not depend on the values of the weights, and the clipping share of every row is
measured and recorded (`clip_share`), since speculative clipping's redo does depend on whether a step clips.

Each row carries what ran (`ProgramRecord`: knobs, shape, Program hash), the measured step times (median of the
timed steps, min, max), the share of steps that clipped, the wall time the switch and warm-up cost, the peak GPU
memory, and, for each profile of `predict`, the simulator's step time for the same Program with the measured clip
share (`StepFacts`), and its error. The timeline of the median step is kept on the row object (`MeasuredRow.
timeline`) for calibration and task-level comparison; `MeasuredRow.to_dict()` is the JSON line.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pandas as pd
import torch

from megatrain.analysis.summary import summarize
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.compile.record import ProgramRecord
from megatrain.compile.resolve import resolve_host_layout
from megatrain.data.batches import synthetic_batches
from megatrain.engine.trainer import StepResult, StreamedTrainer
from megatrain.exec.optim import AdamWConfig
from megatrain.ir.facts import StepFacts
from megatrain.ir.program import Program
from megatrain.model.spec import ModelSpec
from megatrain.profiling.compare import step_time_s
from megatrain.sim import HardwareProfile, load_profile, simulate
from megatrain.units import GiB


@dataclass
class MeasuredRow:
    """One schedule measured once (one round): what ran, its timed steps, and the predictions for it."""

    config: str  # the caller's name for the schedule
    round: int
    layout_group: int  # the host layout it ran with (first-seen order): schedules of one group share its store as is
    program: Program
    step_s: list[float]  # wall time of each timed step (StreamedTrainer.step's time_s)
    clip_share: float  # share of timed steps whose update was clipped (clip coefficient < 1)
    losses: list[float]
    switch_s: float  # wall time of the switch to this schedule and its warm-up steps
    peak_gpu_bytes: int  # over the warm-up and timed steps (0 on the CPU backend)
    timelines: list[pd.DataFrame] = field(repr=False, default_factory=list)  # every timed step's, in step_s order
    predicted_step_s: dict[str, float] = field(default_factory=dict)  # profile label -> simulated step (mean)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def timeline(self) -> pd.DataFrame:
        """The measured Timeline of the median timed step (the upper median of an even count)."""
        order = sorted(range(len(self.step_s)), key=self.step_s.__getitem__)
        return self.timelines[order[len(order) // 2]]

    @property
    def tokens_per_s(self) -> float:
        p = self.program.placement
        return p.batch * p.seq * p.world / self.median_step_s

    def error(self, label: str) -> float:
        """(predicted - measured) / measured of the step time, with the profile `label` of `predict`."""
        return self.predicted_step_s[label] / self.median_step_s - 1.0

    def to_dict(self) -> dict:
        """The JSON line of this row: seconds throughout, errors as fractions."""
        summary = summarize(self.timeline, self.program)
        record = ProgramRecord.of(self.program)
        out = {"config": self.config, "round": self.round, "layout_group": self.layout_group,
               "model": record.model, "batch": record.batch, "seq": record.seq,
               "program_hash": record.program_hash, "median_step_s": round(self.median_step_s, 5),
               "min_step_s": round(min(self.step_s), 5), "max_step_s": round(max(self.step_s), 5),
               "steps": len(self.step_s), "tokens_per_s": round(self.tokens_per_s, 1),
               # the timelines' first start to last end (what the simulator predicts), beside the wall clock
               "median_span_s": round(statistics.median(step_time_s(t) for t in self.timelines), 5)
               if self.timelines else None,
               "gpu_idle_pct": round(100 * summary.gpu_idle_frac, 2), "clip_share": self.clip_share,
               "switch_s": round(self.switch_s, 2), "peak_gpu_GiB": round(self.peak_gpu_bytes / GiB, 3),
               "loss_last": round(self.losses[-1], 4)}
        for label, pred in self.predicted_step_s.items():
            out[f"predicted_step_s[{label}]"] = round(pred, 5)
            out[f"error[{label}]"] = round(self.error(label), 4)
        out["record"] = record.to_dict()
        return out


def layout_groups(spec: ModelSpec, schedules: dict[str, ScheduleKnobs]) -> list[dict[str, ScheduleKnobs]]:
    """The schedules grouped by the host layout their store needs, in first-seen order."""
    groups: dict[object, dict[str, ScheduleKnobs]] = {}
    for name, knobs in schedules.items():
        groups.setdefault(resolve_host_layout(spec, knobs), {})[name] = knobs
    return list(groups.values())


def measure_on(trainer: StreamedTrainer, name: str, knobs: ScheduleKnobs, batches: Iterator[tuple], *,
               warmup: int, steps: int, batch: int, seq: int) -> tuple[Program, list[StepResult], float, int]:
    """Switch `trainer` to `knobs` (same host layout), run `warmup` untimed and `steps` timed steps on `batches`.
    Returns the Program, the timed StepResults, the wall time of the switch and warm-up, and the peak GPU bytes."""
    cuda = trainer.backend.device.type == "cuda"
    t0 = time.perf_counter()
    trainer.switch_schedule(knobs, batch, seq, name)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        trainer.step(*next(batches))
    switch_s = time.perf_counter() - t0
    timed = [trainer.step(*next(batches)) for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return trainer.program(batch, seq), timed, switch_s, peak


def measure_rounds(spec: ModelSpec, schedules: dict[str, ScheduleKnobs], batch: int, seq: int, *, rounds: int = 3,
                   warmup: int = 2, steps: int = 3, device: str = "auto", seed: int = 0,
                   predict: dict[str, HardwareProfile | str] | None = None, timeout_s: float = 300.0,
                   on_row: Callable[[MeasuredRow], None] | None = None,
                   log: Callable[[str], None] | None = None,
                   skip: set[tuple[str, int]] = frozenset()) -> list[MeasuredRow]:
    """Measure every schedule of `schedules` ({name: knobs}) `rounds` times at (batch, seq) on one host store
    (module docstring). `predict` ({label: profile}) adds the simulator's step time per row; `on_row` sees
    each row as it is measured (write it out: an interrupted run keeps what it measured). Returns every row, in
    the order measured. `skip` holds (name, round) pairs measured before (a resumed measurement): not measured
    again."""
    if rounds < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds}, steps={steps}, warmup={warmup}: give rounds and steps >= 1, warmup >= 0")
    if not schedules:
        raise ValueError("no schedules to measure")
    profiles = {label: load_profile(p) for label, p in (predict or {}).items()}
    say = log or (lambda _line: None)
    rows: list[MeasuredRow] = []
    group_of = {name: g for g, group in enumerate(layout_groups(spec, schedules)) for name in group}
    first = next(iter(schedules.values()))
    t0 = time.perf_counter()
    trainer = StreamedTrainer(spec, first, optim=AdamWConfig(lr=1e-5), backend=device, seed=seed, timeout_s=timeout_s)
    say(f"{len(schedules)} schedule(s) of {len(set(group_of.values()))} host layout(s); host store built in "
        f"{time.perf_counter() - t0:.1f} s (another layout takes it over in place: HostStore.relayout)")
    batches = synthetic_batches(spec, batch, seq, seed)
    try:
        for r in range(rounds):
            for name, knobs in schedules.items():
                if (name, r) in skip:
                    continue
                program, timed, switch_s, peak = measure_on(trainer, name, knobs, batches, warmup=warmup,
                                                            steps=steps, batch=batch, seq=seq)
                row = MeasuredRow(name, r, group_of[name], program, [t.time_s for t in timed],
                                  sum(t.clipped for t in timed) / len(timed), [t.loss for t in timed],
                                  switch_s, peak, [t.timeline for t in timed])
                facts = StepFacts(clip_share=row.clip_share)
                for label, profile in profiles.items():
                    row.predicted_step_s[label] = simulate(program, profile, facts).mean_step_s
                say(f"  round {r} {name}: {row.median_step_s * 1e3:,.1f} ms/step "
                    f"({row.tokens_per_s:,.0f} tok/s; switch + warm-up {switch_s:.1f} s)"
                    + "".join(f"; {label} {row.error(label):+.1%}" for label in profiles))
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    finally:
        trainer.flush()
        del trainer
        gc.collect()  # the store's pinned pages go back now, not at the caller's next collection
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def median_table(rows: list[MeasuredRow], labels: list[str] | None = None) -> pd.DataFrame:
    """One line per schedule: the median over rounds of each row's median step, with min-max over rounds, tokens/s,
    and per profile label the prediction (median over rounds) and its error against the measured median."""
    by: dict[str, list[MeasuredRow]] = {}
    for row in rows:
        by.setdefault(row.config, []).append(row)
    labels = labels if labels is not None else sorted({k for r in rows for k in r.predicted_step_s})
    out = []
    for name, rs in by.items():
        meds = [r.median_step_s for r in rs]
        measured = statistics.median(meds)
        line = {"config": name, "rounds": len(rs), "step_s": measured, "min_s": min(meds), "max_s": max(meds),
                "tokens_per_s": rs[0].tokens_per_s * rs[0].median_step_s / measured,
                "clip_share": statistics.median(r.clip_share for r in rs),
                "program_hash": rs[0].program.fingerprint()}
        for label in labels:
            pred = statistics.median(r.predicted_step_s[label] for r in rs if label in r.predicted_step_s)
            line[f"pred_s[{label}]"] = pred
            line[f"error[{label}]"] = pred / measured - 1.0
        out.append(line)
    return pd.DataFrame(out)
