"""What a run leaves at its end besides checkpoints and the export (export.py): the timelines (CSV, Chrome trace,
Gantt chart) and the summary lines (loss, skipped updates, predicted against measured)."""
from __future__ import annotations

from pathlib import Path
from megatrain.analysis.summary import one_step
from megatrain.analysis.viz import gantt, write_chrome_trace
import pandas as pd


def write_timelines(run_dir: Path, timelines: list, predicted, profile_name: str | None, program, title: str) -> None:
    """timeline_measured.csv (the kept steps), timeline_sim.csv, trace.json and gantt.png of the last step."""

    measured = pd.concat(timelines, ignore_index=True)
    measured.to_csv(run_dir / "timeline_measured.csv", index=False)
    last = int(measured["step"].max())
    pair = {f"measured (step {last})": one_step(measured, last)}
    if predicted is not None:
        predicted.timeline.to_csv(run_dir / "timeline_sim.csv", index=False)
        pair = {f"predicted ({profile_name})": predicted.timeline, **pair}
    write_chrome_trace(run_dir / "trace.json", pair, program)
    gantt(pair, run_dir / "gantt.png", title=title)


def report_lines(s, profile_name: str | None, skipped_unit_updates: int = 0) -> list[str]:
    """The end-of-run summary: steps, loss, skipped updates, and predicted against measured step time."""
    done = s.steps - s.start_step
    if not done:
        return []
    lines = [f"done: {done} steps ({s.start_step + 1}-{s.steps}) in {s.elapsed_s:.1f} s; loss {s.losses[0]:.4f} -> "
             f"{s.losses[-1]:.4f}" + (f"; eval loss {list(s.eval_losses.values())[-1]:.4f}" if s.eval_losses else "")]
    if s.skipped_steps:
        shown = ", ".join(map(str, s.skipped_steps[:10])) + (" ..." if len(s.skipped_steps) > 10 else "")
        lines.append(f"WARNING: {len(s.skipped_steps)} of {done} steps skipped their update, wholly or in part "
                     f"({skipped_unit_updates} unit updates; non-finite gradients): steps {shown}")
    tokens = s.tokens / done
    rows = [("time/step", "s", s.measured_step_s), ("tokens/s", "", tokens / s.measured_step_s),
            ("GPU idle", "%", s.measured_idle_pct)]
    pred = None
    if s.predicted is not None:
        p = s.predicted.summary
        pred = [p.step_s, p.tokens_per_s, 100 * p.gpu_idle_frac]
    lines.append(f"{'':<12}{'predicted (' + str(profile_name) + ')' if pred else '':>22}{'measured (median)':>22}")
    for i, (name, unit, value) in enumerate(rows):
        fmt = ",.0f" if name == "tokens/s" else ".3f" if unit == "s" else ".1f"
        left = f"{format(pred[i], fmt)} {unit}" if pred else ""
        lines.append(f"{name:<12}{left:>22}{format(value, fmt) + ' ' + unit:>22}")
    lines.append(f"run directory: {s.run_dir}")
    return lines
