"""`--schedule auto` for a run on this machine: choose by simulation before the run, then measure the few best
candidates on the run's first steps and train with the fastest measured. The ranking is megatrain/tune/auto.py's
(the one `auto`, with the one budget rule); this module adds what needs the machine and the running trainer
(the profile it ranks with when none is given: train/autoprofile.py).

    auto = choose_before_run(spec, batch, seq, knobs, "cuda", measure=3)      # budget, profile, ranking (printed)
    auto.start(steps_left, log)                                               # before the first step
    switch = auto.before_step()     # a Candidate to switch the trainer to before this step (switch_trainer), or None
    auto.after_step(result)         # the StepResult of the step

Measuring (`measure` = K, `--auto-measure K`, default 3; and every candidate predicted within `band`, 10%, of the
best, up to MAX_MEASURE: the simulator cannot tell those apart): the best predicted candidate runs first (the trainer
was built with it); each candidate runs `UNTIMED_STEPS` step after its switch (new GPU buffers, a compile of the
layer) and `TIMED_STEPS` timed steps. Then the next candidate is the fastest predicted one not measured yet, until
that many are measured. A run-off follows when others measured within `RUNOFF_BAND` (5%) of the fastest: those
(`MAX_RUNOFF` at most, the fastest measured) run again, in the reverse of the order they were first measured, so
that a drift of the machine over the run's first minute does not favour the one measured first; a candidate's
measured step time is the median of all its timed steps. Why: two timed steps are a noisy measure. On llama-4.5b
4 x 4096 on an H200 (docs/runs/24-auto/h200-run2), the first pass alone chose `lean` in two of three processes, which
trained at 0.91x and 0.95x of the best named schedule (`arrival-resident`), measured within 4.4% of `lean`. The run
switches to the fastest measured and trains with it, and one line per candidate says its prediction, its measured
time, the error and which was chosen.
These are the run's own training steps, on its batches, counted, logged and checkpointed as any other: a schedule
changes the speed, never the numbers computed (the candidates keep the run's numerics, `tune.auto_candidates`; a
switch first applies the pending update, as a checkpoint does), so nothing is wasted but the slower steps.
K = 0 trains with the best predicted candidate, measuring nothing. A run with fewer steps than K candidates need
measures as many as its steps allow.

The last measured slot goes to the host hedge (`tune.auto.host_hedge`) when the K best predicted do not include it:
of the candidates predicted within the band, the fastest should this host's CPU update run at half the profile's
rate. Candidates that tie on the profile differ most in how much of the update they leave to the host, and that
rate is what moves between machine starts: on the H200 start of issue 25's first table, with a 48 GiB budget, the six
best predicted on the shipped profile are predicted at 14,334-19,720 tokens/s and the hedge at 23,429, out of sample
by that start's profile fitted to its 4-layer runs (docs/runs/25-peers/h200-table1/auto_hedge.md). Run on the
next start (docs/peers.md, start 2): auto chose the hedge (21 resident layers, 21,920 tokens/s, 1.29x the
all-on-GPU row), with 14 resident layers, also among the measured, within 0.03% of it in the trial.

Clipping is priced by the share of clipping steps (`StepFacts.clip_share`; speculative clipping redoes a clipping
step's updates): before the run at `assumed` (0, a run that never clips, unless the caller gives a share), and once
steps have run at the share measured on every step so far (`StepResult.clipped`): each candidate with
speculative clipping is simulated again before the next one is picked (`tune.auto.reprice`), and the predictions
printed beside the measured times are at the measured share.

Candidates of every host layout are measured (weight and gradient wires, GPU-updated units, a gradient ring:
`compile.resolve.resolve_host_layout`). A candidate of the running layout costs new GPU buffers; one of another
layout also takes the host store over in place (`StreamedTrainer.switch_schedule` -> `HostStore.relayout`: the
master weights and AdamW moments, the only copy of the run's state, are kept; the landing space and streaming copy
are rebuilt, the old freed first), which is refused before anything changes when the larger layout would not fit
the host (`HostMemoryShort`: listed as not measured with its reason). Measured on an H200 (docs/accuracy.md): with
only the first layout's candidates measured, auto trained at 0.88-0.92x of the best named schedule (a schedule of
another layout, or one ranked just outside the K, was the fastest); with the band and every layout (takeovers of
2-10.5 s), at 0.98x on bench-3b, 0.95x on llama-4.5b (before the run-off) and 1.04x on llama3-8b (with it).

The compiled layer (`compile_layers`) is a candidate knob (`varies_compile`): it computes the same math with other
rounding. It is varied unless the user set it (config or --set), and not on the CPU backend, where compiling the
layer takes about a minute per candidate.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from megatrain.compile.knobs import ScheduleKnobs
from megatrain.engine.trainer import HostMemoryShort, StepResult
from megatrain.ir.dag import ScheduleError
from megatrain.ir.facts import StepFacts
from megatrain.model.spec import ModelSpec
from megatrain.sim import estimate_line, load_profile
from megatrain.sim.profile import HardwareProfile
from megatrain.train.autoprofile import machine_profile
from megatrain.tune.auto import HEDGE_CPU_RATE, Candidate, auto_budget, choose_auto, host_hedge, reprice
from megatrain.units import GiB

DEFAULT_MEASURE = 3  # candidates `--schedule auto` measures (--auto-measure K; 0: none, the best predicted runs)
# Beyond K, every candidate predicted within this fraction of the best is measured too, up to MAX_MEASURE: the
# simulator cannot tell such candidates apart (docs/accuracy.md: predicted from a quick profile, errors up to 13.5%
# on an H200 and 17.1% on an H100; out of sample, a profile calibrated on another run, up to 12.5% on the H200 and
# 25.9% on the H100 before the copy-beside-update rule, 9.9% and 22.5% with it).
# Measured on an H200, bench-3b 8 x 2048 at 16 GiB: the best named schedule was predicted 6.5% behind auto's pick,
# level with its third candidate and ranked after it, and so never measured; auto trained 0.92x its speed.
DEFAULT_BAND = 0.10
MAX_MEASURE = 6
UNTIMED_STEPS = 1  # after a switch: new GPU buffers, a compile of the layer, the first pending update
TIMED_STEPS = 2  # timed steps per candidate and pass (the first, and the run-off)
RUNOFF_BAND = 0.05  # measured within this fraction of the fastest measured: run again (module docstring)
MAX_RUNOFF = 3


class BandError(ScheduleError):
    """A band outside [0, 1): it is a fraction of the best predicted step time."""


def check_band(band: float) -> None:
    """BandError unless 0 <= band < 1 (0: measure exactly `measure` candidates)."""
    if not 0 <= band < 1:
        raise BandError(f"band {band}: give a fraction of the best predicted step time, 0 (measure exactly `measure` "
                        "candidates) up to below 1")


def varies_compile(explicit: bool, backend: str) -> bool:
    """Whether `auto` tries the compiled layer both ways: not when the user set `compile_layers` (`explicit`), and
    not on the CPU backend (a compile there takes about a minute per candidate measured)."""
    return not explicit and backend == "cuda"


@dataclass
class AutoChoice:
    """What `--schedule auto` chose before the run (`label`, `knobs`: the best predicted), every candidate it ranked
    (`ranked`, fastest predicted first), the profile it ranked with, and the measuring of the K best on the run's
    first steps (module docstring)."""

    spec: ModelSpec
    batch: int
    seq: int
    knobs: ScheduleKnobs  # the chosen knobs as the trainer runs them (step knobs)
    label: str
    ranked: list[Candidate]
    profile: HardwareProfile
    measure: int = DEFAULT_MEASURE
    assumed: StepFacts = field(default_factory=StepFacts)
    band: float = DEFAULT_BAND  # also measure every candidate predicted within this fraction of the best
    # measuring state (start .. done)
    pool: list[Candidate] = field(default_factory=list)  # `ranked` less those whose switch failed, fastest first
    running: Candidate | None = None
    times: dict[str, list[float]] = field(default_factory=dict)  # label -> timed step seconds
    clipped: list[bool] = field(default_factory=list)  # every step since the start: did its update clip
    limit: int = 0  # candidates to measure (K, or fewer when the run is short)
    steps_left: int = 0  # steps the run has from `start`
    runoff: list[Candidate] = field(default_factory=list)  # still to run again in the run-off, next first
    in_runoff: bool = False
    steps_on_running: int = 0
    pending: Candidate | None = None
    previous: Candidate | None = None  # the one that ran before `running` (its Program is restored when a switch fails)
    unstarted: dict[str, str] = field(default_factory=dict)  # label -> why its switch failed (never measured)
    hedge: str = ""  # the host hedge's label (`tune.host_hedge`): measured in the last slot if not before
    chosen: Candidate | None = None
    done: bool = False

    def __post_init__(self) -> None:
        check_band(self.band)

    def start(self, steps_left: int, log) -> None:
        """Before the run's first step, on a trainer built with `knobs`: `steps_left` steps will run; logs what
        will be measured."""
        self.log = log
        self.steps_left = steps_left
        self.pool = list(self.ranked)  # every host layout (module docstring)
        self.running = next(c for c in self.pool if c.label == self.label)
        per = UNTIMED_STEPS + TIMED_STEPS
        if self.measure <= 0:
            self.done = True
            log(f"auto: not measuring (--auto-measure 0): training with the best predicted, {self.label}")
            return
        close = sum(c.step_s <= self.running.step_s * (1 + self.band) for c in self.pool)
        want = min(max(self.measure, min(close, MAX_MEASURE)), len(self.pool))
        self.limit = min(want, max(steps_left, 0) // per)
        if self.limit < want:
            log(f"auto: {steps_left} steps measure {self.limit} candidate(s), not {want} "
                f"({UNTIMED_STEPS} untimed + {TIMED_STEPS} timed steps each)")
        if self.limit == 0:
            self.done = True
            return
        hedge = host_hedge(self.pool, self.profile, self.band) if self.limit >= 2 else None
        if hedge is not None and hedge.label not in [c.label for c in self.pool[:self.limit]]:
            self.hedge = hedge.label
            log(f"auto: the last of the {self.limit} measured is {hedge.label} (predicted "
                f"{hedge.step_s * 1e3:,.1f} ms/step): of those predicted within {100 * self.band:.0f}% of the best, "
                f"the fastest should this host's CPU update run at {HEDGE_CPU_RATE:.0%} of the profile's rate")
        why = (f", every one predicted within {100 * self.band:.0f}% of the best (at most {MAX_MEASURE})"
               if want > self.measure else "")
        log(f"auto: measuring the {self.limit} fastest predicted on the run's first steps "
            f"({UNTIMED_STEPS} untimed + {TIMED_STEPS} timed steps each{why}; then a run-off of those measured within "
            f"{100 * RUNOFF_BAND:.0f}% of the fastest), first {self.label}: predicted "
            f"{self.running.step_s * 1e3:,.1f} ms/step")

    def before_step(self) -> Candidate | None:
        """The candidate to switch the trainer to before the next step (`switch_trainer`), or None: stay."""
        switch, self.pending = self.pending, None
        return switch

    def after_step(self, result: StepResult) -> None:
        """Count the step that ran on the running candidate; after its timed steps, pick the next or choose."""
        if self.done:
            return
        self.clipped.append(result.clipped)
        self.steps_on_running += 1
        if self.steps_on_running <= UNTIMED_STEPS:
            return
        self.times.setdefault(self.running.label, []).append(result.time_s)
        if self.steps_on_running < UNTIMED_STEPS + TIMED_STEPS:
            return
        facts = StepFacts(clip_share=sum(self.clipped) / len(self.clipped))
        self.pool = reprice(self.pool, self.profile, facts)  # clipping priced at the measured share
        if not self.in_runoff and len(self.times) < self.limit:
            nxt = self._next_to_measure()
            if nxt is not None:
                self.log(f"auto: measuring {nxt.label} ({len(self.times) + 1} of {self.limit}): predicted "
                         f"{nxt.step_s * 1e3:,.1f} ms/step")
                self._run(nxt)
                return
        if not self.in_runoff:
            self._start_runoff()
        in_pool = {c.label for c in self.pool}
        self.runoff = [c for c in self.runoff if c.label in in_pool]  # less any whose switch failed meanwhile
        if self.runoff:
            nxt = self.runoff.pop(0)
            if nxt.label == self.running.label:  # no switch: its next steps are timed at once
                self.steps_on_running = UNTIMED_STEPS
            else:
                self._run(nxt)
            return
        self._finish(facts)

    def _next_to_measure(self) -> Candidate | None:
        """The fastest predicted not measured yet; the last slot goes to the host hedge when it is still unmeasured
        (and still in the pool: its switch may have failed)."""
        left = [c for c in self.pool if c.label not in self.times]
        if self.hedge and len(self.times) == self.limit - 1:
            hedge = next((c for c in left if c.label == self.hedge), None)
            if hedge is not None:
                return hedge
        return left[0] if left else None

    def _start_runoff(self) -> None:
        """After the first pass: queue the run-off (module docstring) of the candidates measured within RUNOFF_BAND
        of the fastest, as many as the run's steps allow, in the reverse of their first pass's order."""
        self.in_runoff = True
        by_label = {c.label: c for c in self.pool}
        best = min(self.measured_s(label) for label in self.times if label in by_label)
        close = sorted((label for label in self.times
                        if label in by_label and self.measured_s(label) <= best * (1 + RUNOFF_BAND)),
                       key=self.measured_s)[:MAX_RUNOFF]
        # as many of the fastest as the run's steps allow (the one running, which goes first, needs no untimed step)
        spare = self.steps_left - len(self.clipped)
        while close and len(close) * (UNTIMED_STEPS + TIMED_STEPS) - UNTIMED_STEPS * (self.running.label in close) \
                > spare:
            close.pop()  # the slowest measured leaves first
        if len(close) < 2:
            return
        order = list(self.times)  # first-pass order (dicts keep insertion order)
        close.sort(key=order.index, reverse=True)
        self.runoff = [by_label[label] for label in close]
        self.log(f"auto: run-off: {len(close)} measured within {100 * RUNOFF_BAND:.0f}% of the fastest run again, "
                 f"in the reverse of their first order ({TIMED_STEPS} timed steps each; a candidate's measured time "
                 f"is the median of all its timed steps): {', '.join(close)}")

    def _run(self, candidate: Candidate) -> None:
        self.previous = self.running
        self.pending, self.running, self.steps_on_running = candidate, candidate, 0

    def could_not_start(self, candidate: Candidate, why: str) -> None:
        """`candidate`'s switch failed (out of GPU memory: its buffers did not fit beside what the process holds;
        the caller has put the previous Program back): it leaves the pool, is not measured (if it was not yet) nor
        chosen, and the previous candidate runs on; the next is picked after its next step, as after any measured
        step. When it was the fastest measured (the switch after measuring), the previous one becomes `chosen`: it
        is what the run trains with."""
        self.unstarted[candidate.label] = why
        self.pool = [c for c in self.pool if c.label != candidate.label]
        self.limit = min(self.limit, len(self.pool))
        # its restored Program starts over: one untimed step (new buffers), then timed ones again
        self.running, self.pending, self.steps_on_running = self.previous, None, 0
        if self.chosen is not None and self.chosen.label == candidate.label:
            self.chosen = self.running
        measured = "" if candidate.label in self.times else "not measured, "
        self.log(f"auto: {candidate.label} could not start ({why}); {measured}{self.running.label} runs on")

    def measured_s(self, label: str) -> float:
        """The measured step time of a candidate: the median of its timed steps (both passes, after a run-off)."""
        return statistics.median(self.times[label])

    def _finish(self, facts: StepFacts) -> None:
        """Choose the fastest measured; one line per candidate measured and per one whose switch failed."""
        self.done = True
        by_label = {c.label: c for c in self.pool}
        # a candidate whose switch failed in the run-off keeps its first-pass times but cannot be chosen
        measured = sorted((label for label in self.times if label in by_label),
                          key=lambda label: (self.measured_s(label), label))
        self.chosen = by_label[measured[0]]
        share = f"{100 * facts.clip_share:.0f}% of the {len(self.clipped)} steps clipped"
        self.log(f"auto: measured {len(measured)} candidate(s); predictions with clipping priced at the measured "
                 f"share ({share}); profile {self.profile.name}:")
        for label in sorted(measured, key=lambda label: by_label[label].step_s):
            pred, meas = by_label[label].step_s, self.measured_s(label)
            times = self.times[label]
            # every timed step, in the order run: how far apart one candidate's steps are is the host's noise
            steps = " ".join(f"{t * 1e3:,.0f}" for t in times)
            median_of = f"median of {len(times)} steps: " if len(times) > TIMED_STEPS else "steps "
            self.log(f"  {label}: predicted {pred * 1e3:,.1f} ms/step, measured {meas * 1e3:,.1f} ms/step "
                     f"(error {pred / meas - 1:+.1%}; {median_of}{steps})"
                     + ("  <- chosen" if label == self.chosen.label else ""))
        for c in self.ranked:
            if c.label in self.unstarted:
                first = (f"measured {self.measured_s(c.label) * 1e3:,.1f} ms/step in the first pass, then could not "
                         "start again (not chosen): " if c.label in self.times else "not measured: ")
                self.log(f"  {c.label}: predicted {c.step_s * 1e3:,.1f} ms/step, {first}{self.unstarted[c.label]}")
        if self.chosen.label != self.running.label:
            self.log(f"auto: switching to {self.chosen.label}, the fastest measured")
        else:
            self.log(f"auto: {self.chosen.label}, the fastest measured, runs on")
        self._run(self.chosen)  # switched to, or (the one running) its prediction at the measured share taken


def choose_before_run(spec: ModelSpec, batch: int, seq: int, base: ScheduleKnobs, backend: str, run_dir=None,
                      profile: str | None = None, gpu_gib: float | None = None, log=print,
                      resumed: bool = False, *, measure: int = DEFAULT_MEASURE, vary_compile: bool = False,
                      assumed: StepFacts = StepFacts(), band: float = DEFAULT_BAND) -> tuple[AutoChoice, str]:
    """`--schedule auto` before a run on this machine (`train`, scripts/bench_megatrain.py): the budget by the one
    rule (`tune.auto.auto_budget`, GPU and host), `profile` when given, else this machine's (`machine_profile`:
    profiling/store.py's precedence; `run_dir` and `resumed`: a resumed run's own calibrated profile comes first),
    the ranking (`tune.auto.choose_auto`, clipping priced at `assumed`, the compiled layer tried both ways with
    `vary_compile`), logged with the next best. Returns the AutoChoice that measures the `measure` best (and every
    one predicted within `band` of the best) on the run's first steps and the profile it ranked with. ScheduleError
    when nothing fits (BandError, one, for a band outside [0, 1), before anything is measured), BudgetError without
    a budget."""
    check_band(band)
    budget = auto_budget(backend, gpu_gib)
    if not profile:
        knobs = replace(base, compile_layers=True) if vary_compile else base  # both kernels' tables
        profile = machine_profile(spec, batch, seq, knobs, backend, log, run_dir, resumed).profile
    loaded = load_profile(profile)
    pick = choose_auto(spec, batch, seq, base, loaded, budget, vary_compile=vary_compile, facts=assumed)
    compiled = ", the compiled layer tried both ways" if vary_compile else ""
    log(f"--schedule auto ({budget.gpu_bytes / GiB:.1f} GiB budget, profile {pick.profile}, clipping priced at "
        f"{100 * assumed.clip_share:.0f}% of steps{compiled}): fastest predicted of {len(pick.table)} that fit:")
    for row in pick.table.head(max(3, measure)).itertuples():
        log(f"  {row.schedule}: {row.step_s * 1e3:,.1f} ms/step predicted, {row.gpu_peak_gib:.2f} GiB")
    if estimate_line(pick.predicted):  # the ranking rests on FLOP estimates: say so (sim/estimates.py)
        log(estimate_line(pick.predicted))
    return AutoChoice(spec, batch, seq, pick.knobs, pick.label, pick.ranked, loaded, measure, assumed, band), profile


def switch_trainer(trainer, batch: int, seq: int, knobs: ScheduleKnobs, name: str, log=print):
    """Run `knobs` on `trainer` from the next step (`StreamedTrainer.switch_schedule`: the pending update is applied
    first with the old Program, as a checkpoint does, then the new Program takes the host store, relaid in place
    for another layout). Returns the new Program and the update plan the flush applied (None if none was
    pending)."""
    t0, store = time.perf_counter(), trainer.store
    out = trainer.switch_schedule(replace(knobs), batch, seq, name)
    if trainer.store is not store:  # another layout: switch_schedule relaid the store
        log(f"auto: {name} has another host layout: the store was taken over in place in "
            f"{time.perf_counter() - t0:.1f} s")
    return out


def schedule_overrides(knobs, micro_batches: int) -> list[str]:
    """Config overrides that set every schedule knob of `knobs` (step knobs: micro-batches as configured)."""
    knobs = replace(knobs, micro_batches=micro_batches)  # the loop multiplies it by grad_accum
    return ["schedule.name=overlap"] + [f"schedule.{k}={v}" for k, v in knobs.to_dict().items() if v is not None]


def measure_candidates(auto: AutoChoice, trainer, step: Callable[[], StepResult], log=print) -> Candidate:
    """`auto`'s measuring on `trainer` outside the training loop (scripts/bench_megatrain.py; the loop calls
    `before_step` / `after_step` itself, `auto_before_step`): `step()` runs one training step; returns the
    candidate the trainer runs afterwards (the fastest measured, or the one that ran before it when the switch to it
    failed; the best predicted with `measure` 0)."""
    auto.start(2**62, log)  # as many steps as it takes
    while True:
        cand = auto.before_step()
        if cand is not None and cand.knobs != trainer.knobs:
            _switch_or_skip(auto, trainer, trainer.program(auto.batch, auto.seq), auto.batch, auto.seq, cand)
        if auto.done:
            return auto.running  # the fastest measured, unless its switch failed; the best predicted with K = 0
        auto.after_step(step())


def _switch_or_skip(auto: AutoChoice, trainer, program, batch: int, seq: int, cand: Candidate):
    """Switch `trainer` to `cand` (`switch_trainer`); returns the new Program, or None when the switch failed
    (`auto.could_not_start`): out of GPU memory (`program`, the one that ran, takes its buffers back) or a host
    layout that would not fit (refused before anything changed)."""
    try:
        return switch_trainer(trainer, batch, seq, cand.knobs, cand.label, auto.log)[0]
    except torch.cuda.OutOfMemoryError as e:
        auto.could_not_start(cand, _restore(trainer, program, e))
    except HostMemoryShort as e:  # refused before anything changed: the Program that ran runs on
        auto.could_not_start(cand, f"its host layout would not fit: {e}")
    return None


def _restore(trainer, program, error: Exception) -> str:
    """After a switch that ran out of GPU memory: the Program that ran before takes its buffers back (the failed
    one's are freed first); returns the one-line reason."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trainer.use_program(program)
    return "out of GPU memory at its switch: " + str(error).splitlines()[0][:160]


def auto_before_step(run) -> bool | None:
    """`--schedule auto` before a step of `run` (a train/loop._Training): switch its trainer to the next candidate
    to measure or to the fastest measured (the run takes the Program, its prediction and knobs through its public
    `switch_schedule`). True: a new Program runs from this step; False: the same one, its prediction repriced at the
    measured clip share; None: nothing changed."""
    cand = run.auto.before_step()
    if cand is None:
        return None
    if cand.knobs == run.trainer.knobs:  # the fastest measured is the one running
        run.switch_schedule(cand.knobs, run.program, cand.result, None)
        return False
    applied = run.trainer.flush()  # here, so that a switch that fails below loses no applied update's bookkeeping
    program = _switch_or_skip(run.auto, run.trainer, run.program, run.batch, run.seq, cand)
    if program is None:  # the Program that ran runs on
        run.switch_schedule(run.trainer.knobs, run.program, run.predicted, applied)
        return False
    run.switch_schedule(cand.knobs, program, cand.result, applied)
    return True
