"""`--schedule auto`: the fastest predicted schedule that fits this machine and keeps the run's numerics.

The one implementation behind `megatrain simulate --schedule auto`, `megatrain train --schedule auto` (which then
measures the few best candidates on the run's first steps and keeps the fastest measured: train/autoswitch.py) and
`scripts/bench_megatrain.py --schedule auto`:

    budget = auto_budget("cuda", gpu_gib=None)                  # THE budget rule (below)
    pick = choose_auto(spec, 8, 2048, base_knobs, "h200-measured", budget)
    pick.knobs, pick.label, pick.predicted.step_s, pick.table    # the choice, its prediction, every candidate

The budget rule, the same for every caller:

    GPU   `--gpu-budget-gib` when given; else on a GPU, its free memory less 10% (`GPU_HEADROOM`: CUDA's context
          and the caching allocator's fragmentation are not in the plan); on the CPU backend, where the "GPU"
          buffers are host memory, half the usable host memory (`CPU_DEVICE_SHARE`, the other half for the store)
    host  the machine's usable host memory (megatrain/plan/machine.py: MemAvailable, the container's cgroup limit
          and the ulimits, plus what this process holds), for a run on this machine; `simulate` predicts for the
          profile's machine and checks no host memory (`with_host=False`)

Candidates (`auto_candidates`) are every named schedule with the base's numerics (the knobs `NUMERICS_KNOBS`
lists: clipping, dtypes, kernel, loss chunk, micro-batches), 2 or 3 weight buffers, and for the arrival
placements resident units in a few sizes, with a quarter to all of the resident layers keeping their forward
graph for the backward (`keep_activations`: no recompute, the same gradients) or none; each is planned, refused
when it exceeds a budget, and simulated.
`vary_compile=True` also tries each with the decoder layer compiled and eager (`compile_layers`): the compiled layer
computes the same math with other rounding, so `train --schedule auto` varies it unless the user set
`compile_layers` (train/autoswitch.py `varies_compile`); every other knob of `NUMERICS_KNOBS` is never varied.

`host_hedge` names the candidate to measure beside the best predicted ones: of those the simulator cannot tell apart,
the fastest should the host's CPU update run at half the profile's rate (the figure that differs most between
machine starts).

Clipping is priced with `facts` (ir/facts.py `StepFacts`): with speculative clipping (arrival placements) a step
that clips undoes and redoes its updates, so a candidate is ranked by `SimResult.mean_step_s` at the assumed share
of clipping steps (0 unless given); `reprice` ranks candidates again at a share measured on the run's steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import pandas as pd

from megatrain.compile.advice import plan_memory
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import NAMED_SCHEDULES, NUMERICS_KNOBS, ScheduleKnobs
from megatrain.compile.lower import lower
from megatrain.compile.resolve import OPTIMIZER_PRESETS, resolve_host_layout
from megatrain.ir.dag import ScheduleError
from megatrain.ir.facts import NO_CLIP, StepFacts
from megatrain.model.spec import ModelSpec
from megatrain.plan.machine import gpu_memory, host_memory, process_rss_bytes
from megatrain.sim.engine import SimResult, simulate
from megatrain.sim.profile import HardwareProfile, load_profile
from megatrain.tune.search import TuneResult
from megatrain.units import GiB

GPU_HEADROOM = 0.9  # share of the GPU's free memory a plan may take (CUDA context, allocator fragmentation)
CPU_DEVICE_SHARE = 0.5  # on the CPU backend: share of the usable host memory for the device working set
BUDGET_FLAG = "--gpu-budget-gib"
# The profile's CPU AdamW rate is the figure least likely to hold on the machine a run gets: fitted to the steps of
# one H200 start it was half the shipped profile's (2.9 against 5.8 G parameters/s, docs/peers.md), and a run's
# update drifts 15-43% within a process (docs/accuracy.md). `host_hedge` prices candidates at this share of it.
HEDGE_CPU_RATE = 0.5


class BudgetError(ValueError):
    """No GPU budget can be measured here and none was given; the message says which flag to give."""


@dataclass(frozen=True)
class AutoBudget:
    """What `auto` may plan for: GPU peak bytes, host bytes (None: not checked), and where the GPU figure came from
    ("given", "GPU free", "CPU backend")."""

    gpu_bytes: int
    host_bytes: int | None
    source: str


def auto_budget(backend: str, gpu_gib: float | None = None, *, with_host: bool = True) -> AutoBudget:
    """The budget rule of `--schedule auto` (see the module docstring). backend: "cuda" or "cpu" (where the run
    executes); BudgetError on "cuda" when no GPU can be measured and no `gpu_gib` is given."""
    host = host_memory(held_bytes=process_rss_bytes()).usable_bytes if (with_host or backend == "cpu") else None
    if gpu_gib is not None:
        gpu, source = int(gpu_gib * GiB), "given"
    elif backend == "cpu":
        gpu, source = int(host * CPU_DEVICE_SHARE), "CPU backend"
    else:
        measured = gpu_memory()
        if measured is None:
            raise BudgetError(f"--schedule auto needs a GPU memory budget and there is no GPU here to measure: give "
                              f"{BUDGET_FLAG} (e.g. 16)")
        gpu, source = int(measured[0] * GPU_HEADROOM), "GPU free"
    return AutoBudget(gpu, host if with_host else None, source)


@dataclass(frozen=True)
class Candidate:
    """One schedule `auto` may run: its label ("lean[buffers=3]"), knobs, simulation (`result`, at the clip share
    of `result.facts`) and planned GPU peak."""

    label: str
    knobs: ScheduleKnobs
    result: SimResult
    gpu_peak_bytes: int

    @property
    def step_s(self) -> float:
        """The predicted seconds per step over the run: steps that clip and steps that do not, by the share."""
        return self.result.mean_step_s


@dataclass
class AutoPick:
    """The schedule `auto` chose: its knobs, a label ("lean[buffers=3]"), its simulated step (`predicted`), every
    candidate that fits (`table`, fastest first: schedule, step_s, tokens_per_s, gpu_idle_pct, gpu_peak_gib; and
    `ranked`, the same as Candidates), the budget it fits and the profile's name."""

    knobs: ScheduleKnobs
    label: str
    predicted: SimResult
    table: pd.DataFrame
    budget: AutoBudget
    profile: str
    ranked: list[Candidate] = field(default_factory=list)


def choose_auto(spec: ModelSpec, batch: int, seq: int, base: ScheduleKnobs, profile: HardwareProfile | str,
                budget: AutoBudget, world: int = 1, *, vary_compile: bool = False,
                facts: StepFacts = NO_CLIP) -> AutoPick:
    """The fastest predicted schedule for (spec, batch, seq) within `budget` that keeps `base`'s numerics
    (`compile_layers` aside when `vary_compile`), clipping priced at `facts.clip_share`; ScheduleError (with the
    budget in it) when none fits."""
    profile = load_profile(profile)
    ranked = rank_candidates(spec, batch, seq, base, profile, budget.gpu_bytes, host_bytes=budget.host_bytes,
                             world=world, vary_compile=vary_compile, facts=facts)
    best = ranked[0]
    return AutoPick(best.knobs, best.label, best.result, candidate_table(ranked), budget, profile.name, ranked)


def auto_candidates(spec: ModelSpec, base: ScheduleKnobs, vary_compile: bool = False) -> dict[str, ScheduleKnobs]:
    """Schedules `auto` tries: every named schedule with the base's numerics (its clipping included), 2 or 3
    weight buffers, and for the arrival placements resident units in a few sizes, a quarter, half, three quarters
    or all of the resident layers keeping their forward graph (knob keep_activations) or none; with `vary_compile`
    each also with the decoder layer compiled and eager (labelled ",compiled" / ",eager"). Labels name what the
    candidate sets on top of the named schedule."""
    keep = {name: getattr(base, name) for name in NUMERICS_KNOBS}
    L = spec.num_layers
    out: dict[str, ScheduleKnobs] = {}
    for name, named in NAMED_SCHEDULES.items():
        timing = OPTIMIZER_PRESETS[named.optimizer][0].value  # arrival clips speculatively, still exactly
        for buffers in sorted({2, 3} & set(range(1, max(L, 1) + 1))):
            knobs = replace(named, **keep, buffers=buffers)
            variants = {f"{name}[buffers={buffers}": knobs}
            if timing == "arrival" and not spec.tie_word_embeddings:
                # a few small counts, then quarters up to every layer: a GPU with memory to spare keeps most of a
                # small model resident (bench-3b on an H200 host whose CPU update is slow: 0.89x all-on-GPU measured
                # at 4 layers; 1.21x at 12 predicted out of sample, docs/runs/25-peers/h200-table1/predict_next.md)
                for r in sorted({0, 2, 4, 8, L // 4, L // 2, 3 * L // 4, L} & set(range(L + 1))):
                    label = f"{name}[buffers={buffers},resident_embeddings,resident_layers={r}"
                    resident = replace(knobs, resident_embeddings=True, resident_layers=r)
                    variants[label] = resident  # a clash with GPU layers: refused
                    # a quarter to all of them keeping their forward graph (no recompute; the same gradients): the
                    # H100's best bench-3b rows, 1.44-1.49x all-on-GPU (docs/peers.md); refused where the backward
                    # would see other weights or inputs (recompute blocks, MLP tiles, data-parallel ranks)
                    for kept in sorted({r // 4, r // 2, 3 * r // 4, r} - {0}):
                        variants[f"{label},keep_activations={kept}"] = replace(resident, keep_activations=kept)
            for label, k in variants.items():
                if not vary_compile:
                    out[label + "]"] = k
                    continue
                for compiled in (True, False):  # compiled first: on a tie of the predictions, the faster kernel
                    out[label + (",compiled]" if compiled else ",eager]")] = replace(k, compile_layers=compiled)
    return out


def choose_schedule(spec: ModelSpec, batch: int, seq: int, base: ScheduleKnobs,
                    profile: HardwareProfile | str, gpu_bytes: int, host_bytes: int | None = None,
                    same_host_layout: bool = False, world: int = 1, *, vary_compile: bool = False,
                    facts: StepFacts = NO_CLIP) -> TuneResult:
    """The fastest predicted schedule for (spec, batch, seq) that fits `gpu_bytes` of planned GPU peak and keeps
    the numerics of `base` (its clipping, compute dtype, gradient wire, layer kernel, loss chunk, micro-batches), and
    whose host plan fits `host_bytes` when given: `rank_candidates`' first. `table` lists every candidate that
    fits, fastest first."""
    ranked = rank_candidates(spec, batch, seq, base, profile, gpu_bytes, host_bytes, same_host_layout, world,
                             vary_compile=vary_compile, facts=facts)
    return TuneResult(ranked[0].knobs, ranked[0].result, candidate_table(ranked))


def rank_candidates(spec: ModelSpec, batch: int, seq: int, base: ScheduleKnobs,
                    profile: HardwareProfile | str, gpu_bytes: int, host_bytes: int | None = None,
                    same_host_layout: bool = False, world: int = 1, *, vary_compile: bool = False,
                    facts: StepFacts = NO_CLIP) -> list[Candidate]:
    """Every candidate (`auto_candidates`) that fits `gpu_bytes` of planned GPU peak (and `host_bytes` of host plan
    when given), simulated with `profile` at `facts` (the share of steps that clip), fastest first (by
    `mean_step_s`, then label). same_host_layout: only candidates whose host store has the layout of `base`'s (a
    running trainer can switch to them without rebuilding its store: `use_program`). world: data-parallel ranks
    (schedules that data parallelism refuses are left out; the step is one rank's). A candidate the resolver
    refuses is left out; ScheduleError when none is left."""
    profile = load_profile(profile)
    layout = resolve_host_layout(spec, base) if same_host_layout else None
    out: list[Candidate] = []
    for label, knobs in auto_candidates(spec, base, vary_compile).items():
        try:
            if layout is not None and not layout.serves(resolve_host_layout(spec, knobs)):
                continue
            plan = plan_memory(spec, batch, seq, knobs)
            peak = plan.gpu.peak_bytes
            if peak > gpu_bytes or (host_bytes is not None and plan.host.total_bytes > host_bytes):
                continue
            res = simulate(lower(build_schedule(spec, batch, seq, knobs, world=world)), profile, facts)
        except ScheduleError:
            continue
        out.append(Candidate(label, knobs, res, peak))
    if not out:
        host = f" and {host_bytes / GiB:.1f} GiB of host memory" if host_bytes is not None else ""
        same = " with the same host layout" if layout is not None else ""
        raise ScheduleError(f"no schedule{same} keeps these numerics and fits a GPU peak of {gpu_bytes / GiB:.2f} GiB"
                            f"{host}; see `megatrain plan` for what takes the memory, or raise the budget")
    return sorted(out, key=lambda c: (c.step_s, c.label))


def reprice(candidates: list[Candidate], profile: HardwareProfile | str, facts: StepFacts) -> list[Candidate]:
    """`candidates` simulated again at `facts` (the share of clipping steps measured on a run), fastest first: only
    those with speculative clipping change (a step that clips redoes their updates); the others keep their
    simulation."""
    profile = load_profile(profile)
    out = [replace(c, result=simulate(c.result.program, profile, facts))
           if c.result.program.placement.speculative_clip and c.result.facts != facts else c for c in candidates]
    return sorted(out, key=lambda c: (c.step_s, c.label))


def host_hedge(candidates: list[Candidate], profile: HardwareProfile | str, band: float) -> Candidate | None:
    """Of `candidates` predicted within `band` of the fastest (those the simulator cannot tell apart), the one
    predicted fastest should this host's CPU AdamW run at `HEDGE_CPU_RATE` of the profile's rate; None when fewer
    than two are that close. `train --schedule auto` measures it too (train/autoswitch.py): candidates that tie on
    the profile differ most in how much of the update they leave to the host. Each keeps its own clipping facts."""
    if not candidates:
        return None
    profile = load_profile(profile)
    best = min(c.step_s for c in candidates)
    close = [c for c in candidates if c.step_s <= best * (1 + band)]
    if len(close) < 2:
        return None
    slow = profile.with_cpu_adam_times(HEDGE_CPU_RATE)
    return min(close, key=lambda c: (simulate(c.result.program, slow, c.result.facts).mean_step_s, c.step_s, c.label))


def candidate_table(ranked: list[Candidate]) -> pd.DataFrame:
    """One row per candidate, in the given order: schedule, step_s (mean over clipping and other steps),
    tokens_per_s, gpu_idle_pct, gpu_peak_gib."""
    return pd.DataFrame([dict(schedule=c.label, step_s=c.step_s, tokens_per_s=c.result.summary.tokens_per_s
                              * c.result.step_s / c.step_s, gpu_idle_pct=100 * c.result.summary.gpu_idle_frac,
                              gpu_peak_gib=c.gpu_peak_bytes / GiB) for c in ranked])
