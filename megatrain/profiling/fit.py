"""Fitting a hardware profile to measured steps of a Program: what live calibration (live.py) computes.

    fitted = fit_profile(program, profile, timelines, clipped=[False, True, ...])

What is fitted, and from what (each kind of step, clipping or not, simulated with its facts and weighed by its
share of the steps, `step_classes`):

- `task_overhead_s` by stream: the mean gap before a task's start on that stream (as `megatrain profile` measures
  it on its real steps); `N` is the norm's whole ready-to-done time;
- `compute_tables`: each compute task kind and unit class at the run's token counts (a table for this model's
  signature, seq and dtype replaces the profile's; others are kept), each task's measured duration taken back to
  its time alone by the profile's `compute_beside_copy` and the fraction of it a copy overlapped (`copied`), since
  the simulator slows it again wherever copies run beside it;
- the rates of the flows the simulator shares (host CPU AdamW and conversion, GPU AdamW and its clipping redo, each
  copy direction's curve): scaled until the simulated ready-to-done times of their tasks add up to the measured
  ones. This is a fixed-point iteration through the simulator itself, so contention the simulator models (host
  memory, PCIe duplex) is not counted twice: the rate that comes out is the rate *alone* that reproduces the run.
  An update faster than simulated also raises the host-memory budget (`_scaled`: under max-min sharing its ceiling
  alone cannot make it faster).

`fit_update_rate` is the one-number fit for runs that kept only their step times.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, replace

import pandas as pd

from megatrain.engine.trainer import CLIPPED
from megatrain.ir.facts import StepFacts
from megatrain.ir.program import Program
from megatrain.ir.streams import COPY_STREAMS
from megatrain.ir.tasks import TaskKind
from megatrain.profiling.compare import step_time_s
from megatrain.profiling.overhead import copy_intervals, copy_overlap_s, with_spans
from megatrain.sim import CopyCurve, ComputeTable, HardwareProfile, model_signature, simulate
from megatrain.sim.profile import COMPUTE_KINDS, unit_class

FIT_ITERATIONS = 6


def step_clips(program: Program, timelines: list[pd.DataFrame], clipped: list[bool] | None = None) -> list[bool]:
    """Whether each measured step clipped, as the simulator prices it: only speculative clipping changes a step's
    work (a step that clips defers its host updates to CLIP_REDO and undoes and redoes its GPU updates), so every
    step of another Program counts as not clipping. A host unit's redo runs in the step after the one it fixes,
    so a step's class is exact where clipping persists (a step after one that clipped defers its host updates) and
    approximate at a change, which shifts one step's host work into its neighbour. `clipped` overrides what the
    timelines say
    (`timeline.attrs[CLIPPED]`, recorded by StreamedTrainer.step); raises ValueError when neither says."""
    if not program.placement.speculative_clip:
        return [False] * len(timelines)
    if clipped is None:
        clipped = [t.attrs.get(CLIPPED) for t in timelines]
        if any(c is None for c in clipped):
            raise ValueError(f"{program.name or 'this Program'} clips speculatively (a step that clips defers or "
                             "redoes its updates), but its measured timelines do not say which steps clipped: pass "
                             "clipped=[...] (one bool per timeline), or measure with StreamedTrainer.step, which "
                             f"records timeline.attrs[{CLIPPED!r}]")
    if len(clipped) != len(timelines):
        raise ValueError(f"clipped has {len(clipped)} entries for {len(timelines)} timelines: give one per timeline")
    return [bool(c) for c in clipped]


@dataclass
class StepClass:
    """The measured steps of one kind (clipping or not): their share of the steps, the facts that simulate such a
    step, its median step time, and per task the mean over the middle steps (`step_classes`) of gap, duration and
    span."""

    facts: StepFacts
    weight: float
    step_s: float
    med: pd.DataFrame  # index task; columns gap_s, dur_s, span_s, copied_s (seconds of dur_s beside a copy)


def copied(step: pd.DataFrame) -> pd.DataFrame:
    """`step` with a column "copied": the fraction of each task's duration during which a copy (either direction)
    was in flight (`overhead.copy_overlap_s`: what slows a compute task, `compute_beside_copy`)."""
    copies = copy_intervals(step)
    fractions = []
    for start, end in zip(step["start_s"], step["end_s"]):
        one, both = copy_overlap_s(start, end, copies)
        fractions.append((one + both) / (end - start) if end > start else 0.0)
    return step.assign(copied=fractions)


def step_classes(program: Program, steps: list[pd.DataFrame], flags: list[bool]) -> list[StepClass]:
    """The steps split by whether they clipped. Per task the mean over the class's middle steps by step time (the
    fastest and slowest third left out, at least one each from 3 steps on: a step slowed by another process on a
    shared machine; with a quarter left out, 3 timed steps kept their outlier, and an in-sample fit landed at the
    mean of all three, off the median step time it is compared with); a mean, not
    a median, because the fit matches sums of task times to a step's time, and a median of each task undercounts a
    sum of right-skewed times. Every fitted number below is a sum or mean of these, so overheads, durations and
    spans agree with one another."""
    out = []
    for clips in (False, True):
        mine = sorted((s for s, f in zip(steps, flags) if f == clips), key=step_time_s)
        if not mine:
            continue
        cut = len(mine) // 3
        rows = pd.concat([copied(with_spans(s, program)) for s in mine[cut:len(mine) - cut]], ignore_index=True)
        rows["copied_s"] = rows["copied"] * rows["dur_s"]  # averaged as a product, not as two means multiplied
        med = rows.groupby("task")[["gap_s", "dur_s", "span_s", "copied_s"]].mean()
        out.append(StepClass(StepFacts(clip_share=1.0 if clips else 0.0), len(mine) / len(steps),
                          statistics.median(step_time_s(s) for s in mine), med))
    return out


def fit_profile(program: Program, profile: HardwareProfile, steps: list[pd.DataFrame],
                clipped: list[bool] | None = None, with_kinds: bool = False):
    """The calibrated profile (module docstring): overheads and compute tables measured, flow rates fitted, each
    kind of step (clipping or not, `step_clips`) simulated with its facts and weighed by its share of the steps.
    With `with_kinds`, also the per-kind table of predicted against measured time (`kind_table`) and the measured
    step time (each kind's median step time weighed by its share)."""
    classes = step_classes(program, steps, step_clips(program, steps, clipped))
    p = replace(profile, task_overhead_s=_overheads(program, classes),
                # the norm's whole measured time is its "N" overhead
                compute_tables=_tables(program, profile, classes), clip_norm_params_per_s=math.inf)
    groups = _flow_groups(program)
    measured = _measured(p, program, classes, groups)
    p = _seeded(p, program, groups, measured)
    for _ in range(FIT_ITERATIONS):
        spans = [with_spans(simulate(program, p, c.facts).timeline, program).set_index("task")["span_s"]
                 for c in classes]
        factors = {}
        for flow, tasks in groups.items():
            over, meas = measured[flow]
            sim = 0.0
            for c, span in zip(classes, spans):
                if _counts(flow, c):
                    sim += c.weight * (sum(span[t] for t in tasks) - over)
            if meas > 0 and sim > 0:
                factors[flow] = min(10.0, max(0.1, meas / sim))  # > 1: the flow must go slower
        if all(abs(f - 1.0) < 1e-3 for f in factors.values()):
            break
        p = _scaled(p, factors)
    share = sum(c.weight for c in classes if c.facts.clip_share >= 1.0)
    notes = {**p.notes, "live calibration": (
        f"fitted to {len(steps)} measured steps of {program.model.name} (batch {program.batch} x seq "
        f"{program.seq}, {program.placement.weight_wire} weight wire"
        + (f", {100 * share:.0f}% of them clipping" if program.placement.speculative_clip else "")
        + ") by megatrain.profiling.fit: task_overhead_s from the runtime's gaps, compute tables from the measured "
        "durations, CPU/GPU AdamW (U and V tasks: one update per unit and step), the GPU clip redo and copy rates "
        "scaled until the simulated ready-to-done times of their tasks add up to the measured ones, each kind of "
        "step simulated with its facts")}
    fitted = replace(p, name=f"{profile.name}-calibrated", notes=notes,
                     description=f"{profile.description} Calibrated to a run of {program.model.name}.")
    if not with_kinds:
        return fitted
    return fitted, kind_table(program, fitted, classes), sum(c.weight * c.step_s for c in classes)


def kind_table(program: Program, profile: HardwareProfile, classes: list[StepClass]) -> pd.DataFrame:
    """Per task kind and stream: tasks, and their summed ready-to-done seconds per step, predicted by `profile` and
    measured (each kind of step weighed by its share): a kind the fit leaves unpriced shows here."""
    rows: dict[tuple[str, str], dict] = {}
    for c in classes:
        span = with_spans(simulate(program, profile, c.facts).timeline, program).set_index("task")["span_s"]
        for tid, t in program.tasks.items():
            r = rows.setdefault((t.kind, t.stream), {"kind": t.kind, "stream": t.stream, "n": 0, "pred_s": 0.0,
                                                      "meas_s": 0.0})
            r["pred_s"] += c.weight * float(span[tid])
            r["meas_s"] += c.weight * float(c.med.at[tid, "span_s"])
    n = Counter((t.kind, t.stream) for t in program.tasks.values())
    for k, r in rows.items():
        r["n"] = n[k]
    return pd.DataFrame(list(rows.values())).sort_values(["kind", "stream"]).reset_index(drop=True)


def _overheads(program: Program, classes: list[StepClass]) -> dict[str, float]:
    """Per stream the mean over its tasks (the norm's left out) of their gap before the start; the norm's
    ready-to-done time as its kind's (each kind of step weighed by its share)."""
    out: dict[str, float] = {}
    streams: dict[str, list[str]] = {}
    for tid, t in program.tasks.items():
        if t.kind != "N":  # the norm has its own entry: its gap would skew its stream's
            streams.setdefault(t.stream, []).append(tid)
    norm = [t for t, task in program.tasks.items() if task.kind == "N"]
    for c in classes:
        for s, tids in streams.items():
            out[s] = out.get(s, 0.0) + c.weight * float(c.med.loc[tids, "gap_s"].mean())
        if norm:
            out["N"] = out.get("N", 0.0) + c.weight * float(c.med.loc[norm, "span_s"].median())
    return out


def _tables(program: Program, profile: HardwareProfile, classes: list[StepClass]) -> tuple[ComputeTable, ...]:
    """Compute tables of this model at the run's token counts: per task kind, unit class and tokens, the mean over
    its tasks of their mean measured duration (`step_classes`) taken back to alone (module docstring), so that the
    simulated sum is the measured one (they replace the profile's tables for the same key and seq; the layer's are
    of the compiled layer when the Program compiles)."""
    sig, dtype = model_signature(program.model), program.placement.compute_dtype
    compiled = program.placement.compiled_layers
    tasks: dict[tuple[str, str], dict[int, list[str]]] = {}
    for tid, t in program.tasks.items():
        if t.stream != "compute" or t.kind not in COMPUTE_KINDS or t.tokens <= 0:
            continue
        tasks.setdefault((t.kind, unit_class(t.unit)), {}).setdefault(t.tokens, []).append(tid)
    # A backward that did other work than the table's kind (the tiled MLP's recompute, a layer that kept its
    # forward's graph: sim/costs.py scales the table by the FLOPs) is taken back to the table's work the same way.
    spec, seq = program.model, program.seq
    per_table = {tid: (spec.task_flops(t.kind, t.unit, t.tokens / seq, seq) / t.flops
                       if t.kind == TaskKind.BACKWARD and t.unit >= 0 and t.flops > 0 else 1.0)
                 for tid, t in program.tasks.items()}
    new = []
    for (kind, uclass), by_tokens in sorted(tasks.items()):
        toks = sorted(by_tokens)
        # back to alone: a task that spent s of its measured d beside copies at 1/k of its speed did d - s (1 - 1/k)
        # of work
        lost = 1.0 - 1.0 / profile.compute_beside_copy.get(kind, 1.0)

        def alone_s(c: StepClass, ids: list[str]) -> float:
            m = c.med.loc[ids]
            return float(((m["dur_s"] - lost * m["copied_s"]) * [per_table[i] for i in ids]).mean())

        durs = tuple(max(0.0, sum(c.weight * alone_s(c, by_tokens[n]) for c in classes)) for n in toks)
        new.append(ComputeTable(sig, kind, uclass, program.seq, tuple(toks), durs, dtype,
                                compiled and uclass == "layer"))
    replaced = {(t.key, t.seq) for t in new}
    return tuple(t for t in profile.compute_tables if (t.key, t.seq) not in replaced) + tuple(new)


def _flow_groups(program: Program) -> dict[str, list[str]]:
    """The tasks whose time each fitted rate sets: host updates (U and V on the cpu stream: a unit's update runs
    in its U, or in its V when speculative clipping deferred it), device updates (U on the compute stream, and its
    V there where a step that clips defers it: `placement.redo_next_step`, as the simulator prices it), the
    device's clip redo (V there otherwise: undo and update again), each copy direction's curve."""
    groups: dict[str, list[str]] = {}
    device_defers = program.placement.redo_next_step
    for tid, t in program.tasks.items():
        if t.kind in (TaskKind.OPTIMIZER, TaskKind.CLIP_REDO) and t.stream == "cpu":
            groups.setdefault("cpu_update", []).append(tid)
        elif t.kind == TaskKind.OPTIMIZER or (t.kind == TaskKind.CLIP_REDO and device_defers):
            groups.setdefault("gpu_update", []).append(tid)
        elif t.kind == TaskKind.CLIP_REDO:
            groups.setdefault("gpu_redo", []).append(tid)
        elif t.stream in COPY_STREAMS and t.bytes > 0:
            groups.setdefault(TaskKind(t.kind).copy, []).append(tid)
    return groups


def _counts(flow: str, c: StepClass) -> bool:
    """Whether a kind of step counts in a flow's fit: a redo does nothing in a step that does not clip."""
    return flow != "gpu_redo" or c.facts.clip_share >= 1.0


def _measured(p: HardwareProfile, program: Program, classes: list[StepClass],
              groups: dict[str, list[str]]) -> dict[str, tuple[float, float]]:
    """Per fitted flow (`_flow_groups`): its tasks' launch overheads, and their measured ready-to-done seconds
    beyond those overheads per step (each kind of step that counts, `_counts`, weighed by its share). Neither
    changes while the fit scales the rates."""
    out = {}
    for flow, tasks in groups.items():
        over = sum(p.overhead(program.tasks[t].stream, program.tasks[t].kind) for t in tasks)
        meas = 0.0
        for c in classes:
            if _counts(flow, c):
                meas += c.weight * (sum(c.med.at[t, "span_s"] for t in tasks) - over)
        out[flow] = (over, meas)
    return out


def _seeded(p: HardwareProfile, program: Program, groups: dict[str, list[str]],
            measured: dict[str, tuple[float, float]]) -> HardwareProfile:
    """Finite starting rates where the profile has none (inf = free) but the run measured time (`_measured`): the
    fixed point can only scale a rate that costs something."""
    work = {flow: meas for flow, (_, meas) in measured.items()}  # seconds beyond the launch overheads, per step
    changes = {}
    if "gpu_update" in groups and math.isinf(p.gpu_adam_params_per_s) and work["gpu_update"] > 0:
        changes["gpu_adam_params_per_s"] = (sum(program.tasks[t].params for t in groups["gpu_update"])
                                            / work["gpu_update"])
    for d in COPY_STREAMS:
        c = getattr(p, d)
        if d in groups and not all(math.isfinite(b) for b in c.Bps) and work[d] > 0:
            rate = sum(program.tasks[t].bytes for t in groups[d]) / work[d]
            changes[d] = CopyCurve.constant(rate, c.latency_s)
    return replace(p, **changes)


def _scaled(p: HardwareProfile, factors: dict[str, float]) -> HardwareProfile:
    """`p` with each fitted flow's rate divided by its factor (> 1: slower)."""
    changes = {}
    if "cpu_update" in factors:
        f = factors["cpu_update"]
        changes["cpu_adam_params_per_s"] = p.with_cpu_adam_times(1 / f).cpu_adam_params_per_s
        if math.isfinite(p.cpu_convert_params_per_s):
            changes["cpu_convert_params_per_s"] = p.cpu_convert_params_per_s / f
        if f < 1.0 and p.host_memory_Bps is not None and math.isfinite(p.host_memory_Bps):
            # Faster than simulated: an update that shares host memory with copies runs at what the budget leaves
            # it (sim/hostmem.py, max-min), not at its ceiling, so a faster ceiling alone cannot make it faster;
            # the budget grows with it (measured on one H100: lean and arrival-resident, whose fp32 weight copies
            # draw twice the bytes, stayed +11-24% slow in sample with the ceiling alone)
            changes["host_memory_Bps"] = p.host_memory_Bps / f
    if "gpu_update" in factors and math.isfinite(p.gpu_adam_params_per_s):
        changes["gpu_adam_params_per_s"] = p.gpu_adam_params_per_s / factors["gpu_update"]
    if "gpu_redo" in factors:  # in updates of the (just fitted) GPU rate
        changes["clip_redo_updates"] = p.clip_redo_updates * factors["gpu_redo"] / factors.get("gpu_update", 1.0)
    for d in COPY_STREAMS:
        if d in factors:
            c = getattr(p, d)
            if all(math.isfinite(b) for b in c.Bps):
                changes[d] = CopyCurve(c.sizes_bytes, tuple(b / factors[d] for b in c.Bps), c.latency_s)
    return replace(p, **changes)


def fit_update_rate(program: Program, profile: HardwareProfile, step_s: float, tol: float = 1e-4,
                    facts: StepFacts = StepFacts()) -> HardwareProfile:
    """`profile` with its CPU update rate scaled so that `program` simulates in `step_s`: a one-number fit for runs
    that kept only their step times (no timelines to `calibrate_run` on). The CPU update is the rate the H200 runs'
    calibrations found off (docs/benchmarks.md, run 18), and the only one scaled; raises ValueError when no rate
    between 1/20 and 20 times the profile's reaches `step_s` (then something else is off). `facts`: the run's share of
    clipping steps (a speculative Program's clipping steps defer or redo their updates)."""
    def step_at(k: float) -> float:
        return simulate(program, profile.with_cpu_adam_times(k), facts).mean_step_s

    lo, hi = 0.05, 20.0  # slower update -> longer step: step_at falls as k rises
    if not step_at(hi) <= step_s <= step_at(lo):
        raise ValueError(f"no CPU update rate within 1/20-20x of the profile's simulates {step_s:.3f} s "
                         f"(from {step_at(hi):.3f} to {step_at(lo):.3f} s): the difference is not the update")
    while hi / lo > 1 + tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if step_at(mid) > step_s else (lo, mid)
    k = math.sqrt(lo * hi)
    return replace(profile.with_cpu_adam_times(k), name=f"{profile.name}-update-fitted",
                   notes=dict(profile.notes, cpu_adam_params_per_s=f"scaled x{k:.3f} so that a measured step of "
                              f"{step_s:.4f} s simulates (profiling/fit.fit_update_rate)"))
