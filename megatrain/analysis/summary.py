"""Summaries of a step from ANY Timeline (predicted or measured) and the Program it ran.

- step time, tokens/s, model TFLOP/s (6·N·tokens / step, as BENCHMARKS.md counts);
- GPU compute busy / idle share, PCIe busy share and average GB/s each way, CPU busy share;
- GPU wait time by cause: every idle stretch of the compute stream is walked back along the chain of tasks that
  held it up (each task's *binding* dependency is whichever of its stream predecessor and its waits finished
  last), and each piece of the stretch is charged to the wait cause of the task running on that chain at the time
  (each TaskKind names its own, ir/tasks.py):
      weights     = PREFETCH / ACT_PREFETCH / ACT_OFFLOAD (P, Y, X)
      optimizer   = OPTIMIZER / CLIP_NORM / CLIP_REDO (U, N, V)
      gradients   = OFFLOAD / STATE_PREFETCH / STATE_OFFLOAD (O, S, W)
      collectives = ALL_GATHER / REDUCE_SCATTER (G, Z)
  except that a copy held back by a CPU task that finished inside the same stretch is charged to that task (it
  would have been hidden otherwise), so a CPU optimizer slower than the forward it overlaps shows up as GPU time
  waiting on "optimizer", copies included;
- the critical path: the same walk from the task that ends last back to the start of the step;
- the GPU bytes in use over time, a model of what the memory plan allocates (for trace counters).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import pandas as pd

from megatrain.ir.program import Program
from megatrain.ir.streams import COPY_STREAMS, HOST_STREAMS, STREAMS
from megatrain.ir.tasks import WAIT_CAUSES, TaskKind
from megatrain.units import GiB

# Derived from TaskKind, keyed by the letter a Timeline carries.
CAUSE_OF_KIND = {k.value: k.cause for k in TaskKind}
_EPS = 1e-12


@dataclass
class StepSummary:
    """Numbers of one step; `report()` prints them, `to_dict()` for tables and JSON."""

    name: str
    source: str
    step_s: float
    tokens: int
    tokens_per_s: float
    model_tflops: float
    gpu_busy_s: float
    gpu_busy_frac: float
    gpu_idle_frac: float
    h2d_busy_frac: float
    d2h_busy_frac: float
    h2d_GBps: float
    d2h_GBps: float
    cpu_busy_frac: float
    wait_s: dict[str, float]  # GPU idle seconds by cause (WAIT_CAUSES)
    critical_path: list[str]  # task ids, first to last
    critical_path_s: dict[str, float]  # seconds of the critical path spent on each stream
    gpu_peak_bytes: int  # from the Program's memory plan

    def to_dict(self) -> dict:
        return asdict(self)

    def row(self) -> dict:
        """The flat numbers of a comparison table."""
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "model_tflops": self.model_tflops,
                "gpu_idle_pct": 100 * self.gpu_idle_frac, **{f"wait_{c}_s": v for c, v in self.wait_s.items()},
                "h2d_busy_pct": 100 * self.h2d_busy_frac, "d2h_busy_pct": 100 * self.d2h_busy_frac,
                "gpu_peak_gib": self.gpu_peak_bytes / GiB}

    def report(self) -> str:
        waits = ", ".join(f"{c} {v * 1e3:.1f} ms" for c, v in self.wait_s.items() if v > 0) or "none"
        path = self.critical_path
        shown = " ".join(path) if len(path) <= 12 else " ".join(path[:6]) + " ... " + " ".join(path[-5:])
        on_path = ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in self.critical_path_s.items() if v > 0)
        return "\n".join([
            f"{self.name} ({self.source}): step {self.step_s * 1e3:.2f} ms, {self.tokens_per_s:,.0f} tokens/s, "
            f"{self.model_tflops:.1f} model TFLOP/s",
            f"  GPU compute busy {100 * self.gpu_busy_frac:.1f}%, idle {100 * self.gpu_idle_frac:.1f}%; "
            f"GPU waited on: {waits}",
            f"  PCIe h2d busy {100 * self.h2d_busy_frac:.1f}% ({self.h2d_GBps:.1f} GB/s avg), d2h busy "
            f"{100 * self.d2h_busy_frac:.1f}% ({self.d2h_GBps:.1f} GB/s avg); CPU busy {100 * self.cpu_busy_frac:.1f}%",
            f"  critical path ({len(path)} tasks; {on_path}): {shown}",
            f"  GPU peak (plan) {self.gpu_peak_bytes / GiB:.2f} GiB",
        ])


def one_step(timeline: pd.DataFrame, step: int | None = None) -> pd.DataFrame:
    """The rows of one step (the last one when `step` is None), times shifted so that it starts at 0."""
    steps = sorted(timeline["step"].unique())
    if not steps:
        raise ValueError("the timeline is empty")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"the timeline has no step {step}; it has steps {steps}")
    df = timeline[timeline["step"] == step].copy()
    t0 = df["start_s"].min()
    df["start_s"] -= t0
    df["end_s"] -= t0
    return df


class _StepIndex:
    """Start / end / stream of each task of one step, and each task's binding dependency."""

    def __init__(self, df: pd.DataFrame, program: Program):
        self.program = program
        self.start = dict(zip(df["task"], df["start_s"]))
        self.end = dict(zip(df["task"], df["end_s"]))
        self.stream = dict(zip(df["task"], df["stream"]))
        self.kind = dict(zip(df["task"], df["kind"]))
        self._pred = {}
        for q in program.streams.values():
            for a, b in zip(q, q[1:]):
                self._pred[b] = a

    def binding(self, tid: str) -> str | None:
        """The dependency that finished last before `tid` started (ties: a cross-stream wait wins)."""
        task = self.program.tasks.get(tid)
        if task is None:
            return None
        cands = [w for w in task.waits if w in self.end]
        pred = self._pred.get(tid)
        if pred in self.end:
            cands.append(pred)
        if not cands:
            return None
        latest = max(self.end[c] for c in cands)
        return next(c for c in cands if self.end[c] >= latest - _EPS)

    def walk(self, tid: str | None, lo: float, hi: float) -> list[tuple[str | None, float, float]]:
        """Cover [lo, hi] with the chain of binding dependencies that ends at `tid` (the latest first)."""
        segments, cur, t_hi = [], tid, hi
        while cur is not None and t_hi > lo + _EPS:
            seg_lo = max(lo, self.start[cur])
            if t_hi > seg_lo:
                segments.append((cur, seg_lo, t_hi))
            t_hi = min(t_hi, seg_lo)
            cur = self.binding(cur)
        if t_hi > lo + _EPS:
            segments.append((None, lo, t_hi))
        return segments

    def causes(self, segments) -> list[tuple[float, float, str | None, str]]:
        """(start, end, task, cause) of a walk's segments, earliest first.

        A segment is charged to its task's kind, except a copy that could start only once a CPU task (an
        optimizer update, the norm) finished inside the same idle stretch: the copy was held back by that task
        and would have been hidden behind compute otherwise, so it is charged to the CPU task's cause.
        """
        out = []
        for tid, lo, hi in reversed(segments):
            cause = CAUSE_OF_KIND.get(self.kind.get(tid), "other")
            if out and self.stream.get(tid) in COPY_STREAMS:
                prev_tid, prev_cause = out[-1][2], out[-1][3]
                if prev_tid is not None and self.stream[prev_tid] in HOST_STREAMS:
                    cause = prev_cause
            out.append((lo, hi, tid, cause))
        return out


def _union_s(intervals) -> float:
    total, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in sorted(intervals):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    return total + (cur_hi - cur_lo if cur_hi is not None else 0.0)


def idle_gaps(timeline: pd.DataFrame, program: Program, step: int | None = None) -> pd.DataFrame:
    """Every stretch of the step in which the compute stream is idle, cut into pieces by the task that held the
    GPU up (columns: start_s, end_s, task, cause)."""
    df = one_step(timeline, step)
    return _idle_gaps(df, _StepIndex(df, program))


def _idle_gaps(df: pd.DataFrame, ix: _StepIndex) -> pd.DataFrame:
    step_end = df["end_s"].max()
    compute = df[df["stream"] == "compute"].sort_values("start_s")
    rows, prev_end = [], 0.0
    for tid, s, e in zip(compute["task"], compute["start_s"], compute["end_s"]):
        if s > prev_end + _EPS:
            rows += ix.causes(ix.walk(ix.binding(tid), prev_end, s))
        prev_end = max(prev_end, e)
    if step_end > prev_end + _EPS:  # the GPU waits for the step's last work (offloads, norm, updates)
        rows += ix.causes(ix.walk(df.loc[df["end_s"].idxmax(), "task"], prev_end, step_end))
    return pd.DataFrame(rows, columns=["start_s", "end_s", "task", "cause"])


def critical_path(timeline: pd.DataFrame, program: Program, step: int | None = None) -> pd.DataFrame:
    """The chain of binding dependencies from the step's start to its last task (columns: task, stream,
    start_s, end_s of the piece of the step each task accounts for)."""
    df = one_step(timeline, step)
    return _critical_path(df, _StepIndex(df, program))


def _critical_path(df: pd.DataFrame, ix: _StepIndex) -> pd.DataFrame:
    last = df.loc[df["end_s"].idxmax(), "task"]
    segs = ix.walk(last, 0.0, df["end_s"].max())[::-1]
    return pd.DataFrame([(t, ix.stream.get(t, "-"), lo, hi) for t, lo, hi in segs],
                        columns=["task", "stream", "start_s", "end_s"])


def summarize(timeline: pd.DataFrame, program: Program, step: int | None = None) -> StepSummary:
    """The StepSummary of one step of a Timeline (the last step when `step` is None)."""
    df = one_step(timeline, step)
    step_s = float(df["end_s"].max())
    busy = {s: _union_s(zip(g["start_s"], g["end_s"])) for s, g in df.groupby("stream")}
    nbytes = df.groupby("stream")["bytes"].sum()
    frac = {s: (busy.get(s, 0.0) / step_s if step_s > 0 else 0.0) for s in STREAMS}
    ix = _StepIndex(df, program)
    gaps = _idle_gaps(df, ix)
    wait = {c: 0.0 for c in WAIT_CAUSES}
    for c, lo, hi in zip(gaps["cause"], gaps["start_s"], gaps["end_s"]):
        wait[c] += hi - lo
    path = _critical_path(df, ix)
    on_path = {s: 0.0 for s in STREAMS}
    for s, lo, hi in zip(path["stream"], path["start_s"], path["end_s"]):
        on_path[s] = on_path.get(s, 0.0) + hi - lo
    tokens = program.tokens
    return StepSummary(
        name=program.name,
        source=str(df["source"].iloc[0]),
        step_s=step_s,
        tokens=tokens,
        tokens_per_s=tokens / step_s if step_s > 0 else float("inf"),
        model_tflops=program.model.model_flops_per_token() * tokens / step_s / 1e12 if step_s > 0 else 0.0,
        gpu_busy_s=busy.get("compute", 0.0),
        gpu_busy_frac=frac["compute"],
        gpu_idle_frac=1.0 - frac["compute"],
        h2d_busy_frac=frac["h2d"],
        d2h_busy_frac=frac["d2h"],
        h2d_GBps=float(nbytes.get("h2d", 0)) / step_s / 1e9 if step_s > 0 else 0.0,
        d2h_GBps=float(nbytes.get("d2h", 0)) / step_s / 1e9 if step_s > 0 else 0.0,
        cpu_busy_frac=frac["cpu"],
        wait_s=wait,
        critical_path=[t for t in path["task"] if t is not None],
        critical_path_s=on_path,
        gpu_peak_bytes=program.memory.peak_bytes,
    )


def gpu_memory_curve(timeline: pd.DataFrame, program: Program, step: int | None = None) -> pd.DataFrame:
    """GPU bytes in use over the step (columns t_s, bytes), from the memory plan's model: the buffers all the
    time; each checkpointed block input from the forward that makes it to the backward that frees it (off the
    GPU between its ACT_OFFLOAD and ACT_PREFETCH); a backward's working set while it runs; the head's logits
    while the fused loss runs. A model of the allocations, not a measurement."""
    df = one_step(timeline, step)
    mem, placement, spec = program.memory, program.placement, program.model
    act = placement.tokens_per_micro * spec.hidden_size * placement.wire_bytes("compute_dtype")
    start, end = dict(zip(df["task"], df["start_s"])), dict(zip(df["task"], df["end_s"]))
    events = [(0.0, 1, mem.buffers_bytes + mem.rope_bytes)]  # buffers and RoPE tables: the whole step

    def at(table, tid, sign, nbytes, order):
        if tid in table:
            events.append((table[tid], order, sign * nbytes))

    for l0 in placement.checkpoint_layers:
        for m in range(placement.micro_batches):
            at(end, f"F{l0 - 1}.{m}" if l0 else f"FE.{m}", +1, act, 1)
            at(end, f"X{l0}.{m}", -1, act, 0)
            at(start, f"Y{l0}.{m}", +1, act, 1)
            at(end, f"B{l0}.{m}", -1, act, 0)
    for tid, kind in zip(df["task"], df["kind"]):
        if kind in ("B", "R"):
            at(start, tid, +1, mem.working_bytes, 1)
            at(end, tid, -1, mem.working_bytes, 0)
        elif tid.startswith("FH."):
            at(start, tid, +1, mem.logits_bytes, 1)
            at(end, tid, -1, mem.logits_bytes, 0)
    events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at the same instant
    curve = pd.DataFrame(events, columns=["t_s", "order", "delta"])
    curve["bytes"] = curve["delta"].cumsum().astype("int64")
    return curve[["t_s", "bytes"]].reset_index(drop=True)
