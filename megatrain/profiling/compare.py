"""Predicted vs measured: simulate the Program of measured steps, compare them task by task.

    from megatrain.profiling.rounds import measure_rounds
    from megatrain.profiling.compare import compare
    row, = measure_rounds(PRESETS["debug"], {"overlap": knobs_for("overlap", compute_dtype="fp32")}, 4, 64,
                          rounds=1, warmup=1, steps=5, device="cpu")
    c = compare(row.program, row.timelines, "my-profile.json", warmup=0)  # measure_rounds kept the timed steps only
    print(c.report()); c.write("runs/compare")        # CSVs, trace.json (both stacked), gantt.png (side by side)

The first `warmup` measured steps (default 1: allocation, kernel selection; with the "overlap" placement its
updates have no gradients yet) are left out. Step-level numbers (step time, GPU idle %, tokens/s) come from the
measured step of median step time; per-task numbers are medians over all steps after the warm-up. The prediction
is of the measured share of clipping steps (`StepFacts.clip_share`, what `live.calibrate_run` prices).

Per task the comparison is on the time from *ready* (its stream predecessor and its waits finished) to *done*:
the simulator starts a task at its ready time and charges the runtime's launch/sync overhead inside it
(`task_overhead_s`), while a measured task shows that overhead as a gap before its start event. Comparing
ready-to-done on both sides compares like with like; `dur` (start to done) is kept in the table too.

Every comparison also fits the profile to the measured steps (`live.calibrate_run`, as `megatrain train` does):
`Comparison.calibration` holds the fitted profile and its prediction, the report prints the prediction before and
after calibration beside the measurement, and `write` saves `profile_calibrated.json`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from megatrain.analysis.summary import StepSummary, summarize
from megatrain.compile.record import ProgramRecord
from megatrain.ir.program import Program
from megatrain.sim import HardwareProfile, estimate_line, load_profile
from megatrain.model.spec import EMBED, HEAD
from megatrain.profiling.overhead import with_spans
from megatrain.analysis.viz import gantt, write_chrome_trace


def task_group(kind: str, unit) -> str:
    """Error groups: the kind for layer (and unit-less) tasks, kind + E / H for the embedding / head ("FH", "UE")."""
    if unit is None or pd.isna(unit) or int(unit) >= 0:
        return kind
    return kind + ("E" if int(unit) == EMBED else "H" if int(unit) == HEAD else "")


def step_time_s(timeline: pd.DataFrame) -> float:
    """The step time as `summarize` counts it: first start to last end."""
    return float(timeline["end_s"].max() - timeline["start_s"].min())


@dataclass
class Comparison:
    """A predicted step and measured steps of one Program, with per-task errors (see the module docstring)."""

    program: Program
    profile: HardwareProfile
    predicted: pd.DataFrame  # the simulated step
    measured: pd.DataFrame  # the measured step of median step time (warm-up steps excluded)
    measured_steps_s: list[float]  # step time of every measured step after the warm-up
    tasks: pd.DataFrame  # one row per task: predicted and measured (median) times, errors
    by_group: pd.DataFrame  # error distribution by task group
    pred_summary: StepSummary
    meas_summary: StepSummary
    extra: dict = field(default_factory=dict)

    @property
    def calibration(self):
        """The profile fitted to these measured steps (profiling.live.LiveCalibration)."""
        return self.extra.get("calibration")

    @property
    def bound(self):
        """The physical bound of the step on the profile (sim/bound.py StepBound)."""
        return self.extra["bound"]

    @property
    def step_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return (self.pred_summary.step_s - self.meas_summary.step_s) / self.meas_summary.step_s

    def worst(self, n: int = 8) -> pd.DataFrame:
        """The tasks with the largest absolute error of their ready-to-done time."""
        return self.tasks.reindex(self.tasks["abs_err_s"].sort_values(ascending=False).index).head(n)

    def headline(self) -> dict:
        p, m = self.pred_summary, self.meas_summary
        return {"schedule": self.program.name, "pred_step_s": p.step_s, "meas_step_s": m.step_s,
                "step_err_pct": 100 * self.step_error, "pred_tokens_per_s": p.tokens_per_s,
                "meas_tokens_per_s": m.tokens_per_s, "pred_gpu_idle_pct": 100 * p.gpu_idle_frac,
                "meas_gpu_idle_pct": 100 * m.gpu_idle_frac,
                "task_err_median_pct": 100 * float(self.tasks["rel_err"].median()),
                "task_err_p90_pct": 100 * float(self.tasks["rel_err"].quantile(0.9)),
                **self.bound.to_dict(), "pred_efficiency": self.bound.efficiency(p.step_s),
                "meas_efficiency": self.bound.efficiency(m.step_s), "estimated_tasks": self.extra["estimated_tasks"],
                **({"calibrated_pred_step_s": self.calibration.after.step_s,
                    "calibrated_step_err_pct": 100 * (self.calibration.after.step_s / m.step_s - 1)}
                   if self.calibration is not None else {})}

    def report(self, worst: int = 8) -> str:
        p, m, prog = self.pred_summary, self.meas_summary, self.program
        ms = sorted(self.measured_steps_s)
        lines = [
            f"{prog.model.name}, batch {prog.batch} x seq {prog.seq}, schedule {prog.name}, "
            f"profile {self.profile.name}",
            f"{'':24}{'predicted':>12}{'measured':>12}{'error':>9}",
            _row("step time (ms)", p.step_s * 1e3, m.step_s * 1e3, "{:.2f}"),
            _row("tokens/s", p.tokens_per_s, m.tokens_per_s, "{:,.0f}"),
            _row("GPU idle %", 100 * p.gpu_idle_frac, 100 * m.gpu_idle_frac, "{:.1f}", relative=False),
        ]
        for c in p.wait_s:
            lines.append(_row(f"  GPU waits on {c} (ms)", p.wait_s[c] * 1e3, m.wait_s[c] * 1e3, "{:.2f}",
                              relative=False))
        warm = self.extra.get("warmup", 1)
        which = f"{warm} warm-up excluded" if warm else "timed, after their warm-up"
        lines.append(f"measured step times over {len(ms)} steps ({which}): median {m.step_s * 1e3:.2f} ms, "
                     f"min {ms[0] * 1e3:.2f}, max {ms[-1] * 1e3:.2f}")
        b = self.bound
        lines.append(f"limit: {b.describe()}; efficiency (bound / step) predicted {100 * b.efficiency(p.step_s):.0f}%, "
                     f"measured {100 * b.efficiency(m.step_s):.0f}%")
        if self.extra.get("estimate_line"):  # compute tasks priced from FLOPs: never silent
            lines.append(self.extra["estimate_line"])
        lines.append("per-task error of the ready-to-done time, |pred - meas| / meas, by task group:")
        lines.append(_table(self.by_group, {"group": "{}", "n": "{}", "pred_ms": "{:.3f}", "meas_ms": "{:.3f}",
                                            "median_err_pct": "{:.1f}", "p90_err_pct": "{:.1f}",
                                            "bias_pct": "{:+.1f}"}))
        t = self.tasks
        lines.append(f"all {len(t)} tasks: median error {100 * t['rel_err'].median():.1f}%, "
                     f"p90 {100 * t['rel_err'].quantile(0.9):.1f}%")
        lines.append(f"largest errors (of {len(t)} tasks):")
        w = self.worst(worst).assign(pred_ms=lambda d: d["pred_span_s"] * 1e3, meas_ms=lambda d: d["meas_span_s"] * 1e3,
                                     err_ms=lambda d: (d["pred_span_s"] - d["meas_span_s"]) * 1e3,
                                     err_pct=lambda d: 100 * (d["pred_span_s"] - d["meas_span_s"]) / d["meas_span_s"])
        lines.append(_table(w, {"task": "{}", "stream": "{}", "pred_ms": "{:.3f}", "meas_ms": "{:.3f}",
                                "err_ms": "{:+.3f}", "err_pct": "{:+.1f}"}))
        if self.calibration is not None:
            lines += self.calibration.lines(self.profile.name)
        return "\n".join(lines)

    def write(self, directory: str | Path, plots: bool = True) -> dict[str, Path]:
        """timeline_sim.csv, timeline_measured.csv (every step), tasks.csv, by_group.csv, compare.json,
        trace.json (predicted and measured stacked, one process each) and gantt.png (side by side)."""

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        paths = {"timeline_sim": d / "timeline_sim.csv", "timeline_measured": d / "timeline_measured.csv",
                 "tasks": d / "tasks.csv", "by_group": d / "by_group.csv", "summary": d / "compare.json",
                 "trace": d / "trace.json"}
        self.predicted.to_csv(paths["timeline_sim"], index=False)
        self.extra.get("all_measured", self.measured).to_csv(paths["timeline_measured"], index=False)
        self.tasks.to_csv(paths["tasks"], index=False)
        self.by_group.to_csv(paths["by_group"], index=False)
        summary = {"headline": self.headline(), "measured_steps_s": self.measured_steps_s,
                   "predicted": self.pred_summary.to_dict(), "measured": self.meas_summary.to_dict(),
                   "profile": self.profile.name, "knobs": self.program.knobs,
                   "model": self.program.model.name, "batch": self.program.batch, "seq": self.program.seq}
        if self.program.knobs is not None:  # what ran, rebuildable (compile/record.py)
            summary["record"] = ProgramRecord.of(self.program).to_dict()
        paths["summary"].write_text(json.dumps(summary, indent=1, default=float) + "\n")
        if self.calibration is not None:
            paths["profile_calibrated"] = self.calibration.save(d)
        pair = {"predicted": self.predicted, "measured": _shifted(self.measured)}
        write_chrome_trace(paths["trace"], pair, self.program)
        if plots:
            paths["gantt"] = d / "gantt.png"
            gantt(pair, paths["gantt"], layout="side",
                  title=f"{self.program.name}: predicted {self.pred_summary.step_s * 1e3:.1f} ms, measured "
                        f"{self.meas_summary.step_s * 1e3:.1f} ms")
        return paths


def _shifted(step: pd.DataFrame) -> pd.DataFrame:
    out = step.copy()
    t0 = out["start_s"].min()
    out["start_s"] -= t0
    out["end_s"] -= t0
    return out


def _row(label: str, pred: float, meas: float, fmt: str, relative: bool = True) -> str:
    if relative:
        err = f"{100 * (pred - meas) / meas:+.1f}%" if meas else "-"
    else:
        err = f"{pred - meas:+.1f}" if "%" in label else f"{pred - meas:+.2f}"
    return f"{label:24}{fmt.format(pred):>12}{fmt.format(meas):>12}{err:>9}"


def _table(df: pd.DataFrame, cols: dict[str, str]) -> str:
    cells = [[fmt.format(v) for v in df[c]] for c, fmt in cols.items()]
    widths = [max(len(c), *(len(x) for x in col)) if len(col) else len(c) for c, col in zip(cols, cells)]
    out = ["  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    for i in range(len(df)):
        out.append("  " + "  ".join(col[i].rjust(w) for col, w in zip(cells, widths)))
    return "\n".join(out)


def task_table(program: Program, predicted: pd.DataFrame, measured_steps: list[pd.DataFrame]) -> pd.DataFrame:
    """Per task: predicted and measured (median over steps) start, duration and ready-to-done span, and the
    error of the span."""
    pred = with_spans(_shifted(predicted), program).set_index("task")
    meas = pd.concat([with_spans(_shifted(s), program) for s in measured_steps])
    med = meas.groupby("task")[["start_s", "dur_s", "span_s", "gap_s"]].median()
    rows = []
    for tid, t in program.tasks.items():
        rows.append({"task": tid, "kind": t.kind, "group": task_group(t.kind, t.unit), "stream": t.stream,
                     "pred_start_s": pred.at[tid, "start_s"], "meas_start_s": med.at[tid, "start_s"],
                     "pred_dur_s": pred.at[tid, "dur_s"], "meas_dur_s": med.at[tid, "dur_s"],
                     "meas_gap_s": med.at[tid, "gap_s"],
                     "pred_span_s": pred.at[tid, "span_s"], "meas_span_s": med.at[tid, "span_s"]})
    df = pd.DataFrame(rows)
    df["abs_err_s"] = (df["pred_span_s"] - df["meas_span_s"]).abs()
    df["rel_err"] = df["abs_err_s"] / df["meas_span_s"].clip(lower=1e-9)
    return df


def error_by_group(tasks: pd.DataFrame) -> pd.DataFrame:
    """Per task group: count, median predicted / measured ms, median and p90 of the relative error, and the
    median signed error (bias: + = predicted too slow)."""
    rows = []
    for g, part in tasks.groupby("group", sort=False):
        signed = (part["pred_span_s"] - part["meas_span_s"]) / part["meas_span_s"].clip(lower=1e-9)
        rows.append({"group": g, "n": len(part), "pred_ms": 1e3 * part["pred_span_s"].median(),
                     "meas_ms": 1e3 * part["meas_span_s"].median(),
                     "median_err_pct": 100 * part["rel_err"].median(),
                     "p90_err_pct": 100 * part["rel_err"].quantile(0.9), "bias_pct": 100 * signed.median()})
    order = {k: i for i, k in enumerate("PFRBOUNSWXY")}
    df = pd.DataFrame(rows)
    return df.sort_values("group", key=lambda s: s.map(lambda g: (order.get(g[0], 99), g))).reset_index(drop=True)


def compare(program: Program, measured_steps: list[pd.DataFrame], profile, warmup: int = 1) -> Comparison:
    """Simulate `program` on `profile` (a HardwareProfile, shipped name or path) and compare it with measured steps
    of the same Program; the first `warmup` steps are left out (1: `StreamedTrainer` steps from the start; 0: the
    timed steps of `rounds.measure_rounds`, which ran its warm-up apart)."""
    if warmup < 0 or len(measured_steps) < warmup + 1:
        raise ValueError(f"compare needs a measured step after the {warmup} warm-up step(s); got "
                         f"{len(measured_steps)} step(s)")
    profile = load_profile(profile)
    from megatrain.profiling.live import calibrate_run  # live.py builds on this module's task table

    calibration = calibrate_run(program, profile, measured_steps, warmup=warmup)
    sim = calibration.before  # the profile's prediction, of the measured share of clipping steps
    steps = measured_steps[warmup:]
    times = [step_time_s(s) for s in steps]
    order = sorted(range(len(steps)), key=lambda i: times[i])
    rep = steps[order[(len(order) - 1) // 2]]  # the median step (lower median)
    tasks = task_table(program, sim.timeline, steps)
    extra = {"all_measured": pd.concat(measured_steps), "calibration": calibration,
             "bound": sim.bound, "estimate_line": estimate_line(sim), "estimated_tasks": sum(sim.estimated.values()),
             "warmup": warmup}
    return Comparison(program=program, profile=profile, predicted=sim.timeline, measured=rep, measured_steps_s=times,
                      tasks=tasks, by_group=error_by_group(tasks), pred_summary=sim.summary,
                      meas_summary=summarize(rep, program), extra=extra)


def ranking(comparisons: dict[str, Comparison]) -> pd.DataFrame:
    """Variants ranked by predicted and by measured step time (1 = fastest); `agree` when the ranks match."""
    rows = [{"variant": k, "pred_step_s": c.pred_summary.step_s, "meas_step_s": c.meas_summary.step_s,
             "step_err_pct": 100 * c.step_error} for k, c in comparisons.items()]
    df = pd.DataFrame(rows)
    df["pred_rank"] = df["pred_step_s"].rank(method="min").astype(int)
    df["meas_rank"] = df["meas_step_s"].rank(method="min").astype(int)
    return df


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's rank correlation of two equally long lists (1 = same order, -1 = reversed); ties count 0."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            s += (x > 0) - (x < 0) if y > 0 else -((x > 0) - (x < 0)) if y < 0 else 0
    pairs = n * (n - 1) / 2
    return s / pairs if pairs else 1.0


def kendall_tau_b(xs: list[float], ys: list[float]) -> float | None:
    """Kendall's tau-b of two rankings (None with fewer than two items or no untied pair): ties in either ranking
    are left out of the count and scale the denominator (scripts/bench.py, scripts/calibration_transfer.py)."""
    n, conc, disc, tx, ty = len(xs), 0, 0, 0, 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom else None
