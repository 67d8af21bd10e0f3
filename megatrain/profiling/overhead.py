"""The runtime's own cost per task: how long after its last dependency finished a task actually starts.

A task is *ready* when the task before it on its stream and every task it waits for have finished. Between that
moment and its start the runtime spends time of its own: the issuing thread wakes up (threads hand over the GIL;
a host task polls a device event with a back-off), checks its waits, records the start event. The simulator
starts a task at its ready time and charges `task_overhead_s` (of its kind, else of its stream) inside the task;
measuring those gaps on real steps gives that parameter.

`megatrain profile` runs a few real training steps of a cut of the model (its first layers, so the host store is
small) with the StreamedTrainer and averages the gaps per stream; `ready_times` is also what `megatrain compare`
uses to compare each task's time from ready to done, predicted against measured.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from megatrain.exec.backend import Backend
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.ir.program import Program
from megatrain.ir.streams import COPY_STREAMS
from megatrain.model.spec import ModelSpec
from megatrain.data.batches import synthetic_batches
from megatrain.engine.trainer import StreamedTrainer
from megatrain.exec.optim import AdamWConfig


def ready_times(step: pd.DataFrame, program: Program) -> dict[str, float]:
    """{task: the time it became ready} in one step of a Timeline: the latest end of its stream predecessor
    and of its waits (the step's start, the earliest start, for a task with neither)."""
    return {t: r for t, (r, _) in _ready_and_binding(step, program).items()}


def _ready_and_binding(step: pd.DataFrame, program: Program) -> dict[str, tuple[float, str]]:
    """{task: (ready time, "stream" | "wait" | "start")}: what it became ready by (its stream predecessor, a task
    of another stream, or the step's start)."""
    end = dict(zip(step["task"], step["end_s"]))
    t0 = float(step["start_s"].min())
    out = {}
    for queue in program.streams.values():
        prev = None
        for tid in queue:
            deps = [(end[w], "wait") for w in program.tasks[tid].waits if w in end]
            if prev is not None and prev in end:
                deps.append((end[prev], "stream"))
            # Ties go to the cross-stream wait, as in analysis._StepIndex.binding.
            out[tid] = max(deps, key=lambda d: (d[0], d[1] == "wait")) if deps else (t0, "start")
            prev = tid
    return out


def with_spans(step: pd.DataFrame, program: Program) -> pd.DataFrame:
    """One step of a Timeline with `ready_s`, `ready_by` (what made the task ready: "stream", "wait", "start"),
    `gap_s` (start - ready, >= 0), `dur_s` (end - start) and `span_s` (end - ready: what the simulator's duration
    of the task stands for)."""
    rb = _ready_and_binding(step, program)
    out = step.copy()
    out["ready_s"] = out["task"].map(lambda t: rb[t][0])
    out["ready_by"] = out["task"].map(lambda t: rb[t][1])
    out["gap_s"] = (out["start_s"] - out["ready_s"]).clip(lower=0.0)
    out["dur_s"] = out["end_s"] - out["start_s"]
    out["span_s"] = out["gap_s"] + out["dur_s"]
    return out


CUT_LAYERS = 2  # the decoder layers of the model cut that the profile runs real steps and the runtime's objects on


def profile_cut(spec: ModelSpec, knobs: ScheduleKnobs) -> tuple[ModelSpec, ScheduleKnobs]:
    """The model cut to at most CUT_LAYERS layers and the knobs that run on it: `resident_layers` (layers
    0..r-1 live on the GPU) keeps at least one layer streamed, so the cut has a PREFETCH, an OFFLOAD and a host
    update of a layer to measure (a run's r=4 on a 2-layer cut is r=1; the measured layer is layer r)."""
    cut = spec.with_layers(min(spec.num_layers, CUT_LAYERS))
    resident = min(knobs.resident_layers, cut.num_layers - 1)
    return cut, (knobs if resident == knobs.resident_layers else replace(knobs, resident_layers=resident))


def measure_runtime_gaps(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: Backend,
                         steps: int, cpu_threads: int | None = None) -> dict:
    """Run `steps` real steps of `spec` cut to at most 2 layers (`profile_cut`); return the gaps by stream and
    kind (steps after the first), the global norm's ready-to-done time, and the measured timelines."""

    cut, knobs = profile_cut(spec, knobs)
    optim = AdamWConfig(lr=1e-5)
    trainer = StreamedTrainer(cut, knobs, optim=optim, backend=backend, seed=0,
                              cpu_threads=cpu_threads)
    batches = synthetic_batches(cut, batch, seq)
    timelines = [trainer.step(*next(batches)).timeline for _ in range(max(2, steps))]
    program = trainer.program(batch, seq)
    rows = pd.concat([with_spans(t, program) for t in timelines[1:]])
    by_stream = rows.groupby("stream")["gap_s"].mean().to_dict()
    by_kind = rows.groupby("kind")["gap_s"].mean().to_dict()
    # A task released by its own stream's predecessor continues in the same thread; one released by another
    # stream's task needs its thread woken up. The simulator has one overhead per stream (the mean of the two).
    by_release = {f"{s}/{r}": float(g.mean()) for (s, r), g in rows.groupby(["stream", "ready_by"])["gap_s"]}
    norm = rows[rows["kind"] == "N"]
    step_s = [float(t["end_s"].max() - t["start_s"].min()) for t in timelines]
    del trainer
    return {"model": cut.name, "layers": cut.num_layers, "batch": batch, "seq": seq, "steps": len(timelines),
            "step_s": step_s, "gap_by_stream_s": by_stream, "gap_by_kind_s": by_kind,
            "gap_by_stream_and_release_s": by_release,
            "norm_span_s": float(norm["span_s"].mean()) if len(norm) else 0.0,
            "timelines": timelines, "program": program}


def _intervals(step: pd.DataFrame, stream: str) -> list[tuple[float, float]]:
    rows = step[step["stream"] == stream]
    return sorted(zip(rows["start_s"], rows["end_s"]))


def copy_intervals(step: pd.DataFrame) -> tuple[list[tuple[float, float]], ...]:
    """Each copy stream's busy intervals in a step (COPY_STREAMS order), for `copy_overlap_s`."""
    return tuple(_intervals(step, s) for s in COPY_STREAMS)


def copy_overlap_s(start: float, end: float, copies: tuple[list[tuple[float, float]], ...]) -> tuple[float, float]:
    """Seconds of [start, end) during which one copy direction moved bytes, and during which both did (`copies`:
    `copy_intervals`, one in-order stream per direction)."""
    on_h2d, on_d2h = (_overlap((start, end), spans) for spans in copies)
    both = sum(hi - lo for piece in on_h2d for lo, hi in _overlap(piece, on_d2h))
    return sum(hi - lo for lo, hi in on_h2d) + sum(hi - lo for lo, hi in on_d2h) - 2 * both, both


def _overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of interval `a` covered by `spans` (disjoint: one in-order stream's tasks)."""
    out = []
    for s, e in spans:
        lo, hi = max(a[0], s), min(a[1], e)
        if hi > lo:
            out.append((lo, hi))
    return out


def cpu_update_samples(timelines: list[pd.DataFrame], program: Program) -> list[dict]:
    """Every host AdamW update (U on the cpu stream) of real steps: its parameters, its duration and how much of
    that duration 0, 1 or 2 copy directions were moving bytes (`t0_s`, `t1_s`, `t2_s`): the in-step rate, with
    the contention it ran under, that `assemble` turns into the profile's CPU update rate."""
    samples = []
    for step in timelines:
        copies = copy_intervals(step)
        for task, start, end in zip(step["task"], step["start_s"], step["end_s"]):
            t = program.tasks.get(task)
            if t is None or t.kind != "U" or t.stream != "cpu" or end <= start:
                continue
            one, both = copy_overlap_s(start, end, copies)
            dur = end - start
            samples.append({"task": task, "params": t.params, "dur_s": dur, "t0_s": max(dur - one - both, 0.0),
                            "t1_s": one, "t2_s": both})
    return samples
