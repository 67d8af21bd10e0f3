"""What a run leaves at its end besides checkpoints and the export (export.py): the timelines (CSV, Chrome trace,
Gantt chart), the summary lines (loss, skipped updates, predicted against measured) and the profile fitted to the
run; `report_after_run` writes them all after a session's last step.

These outputs are written after training, when the checkpoint and the metrics already hold what matters: one that
cannot be written (a full or read-only disk) is a one-line warning, never a failed run, and leaves no empty or
partial file behind (each is written under a hidden temporary name and renamed into place when complete).
"""
from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from megatrain.analysis.summary import one_step
from megatrain.analysis.viz import gantt, write_chrome_trace
from megatrain.io.checkpoint import explain_os_error
from megatrain.profiling.live import calibrate_training_run
from megatrain.train.result import RunSummary


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _write_each(run_dir: Path, writers: dict[str, Callable[[Path], object]], log: Callable[[str], None]) -> None:
    """Write each output `name` of `run_dir` with `writers[name](temporary path)`, renamed into place when
    complete; those that fail (OSError) are removed and named in one warning line."""
    failed: list[str] = []
    reason = ""
    for name, write in writers.items():
        tmp = run_dir / f".tmp-{os.getpid()}-{name}"  # the suffix stays: matplotlib picks the format from it
        try:
            write(tmp)
            os.replace(tmp, run_dir / name)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            failed.append(name)
            reason = reason or explain_os_error(e, run_dir / name, "writing")
    if failed:
        log(f"WARNING: could not write {', '.join(failed)} ({reason}); the training finished and its checkpoints "
            "and metrics are kept")


def written_after_training(log: Callable[[str], None], outputs: list[Path], write: Callable[[], object]):
    """`write()`'s result, or None (with one warning line, and the files `outputs` it may have left half written
    removed) when it fails with an OSError: for an output written after training (e.g. the calibrated profile)."""
    try:
        return write()
    except OSError as e:
        for p in outputs:
            p.unlink(missing_ok=True)
        log(f"WARNING: could not write {', '.join(p.name for p in outputs)} "
            f"({explain_os_error(e, outputs[0], 'writing')}); the training finished and its checkpoints and metrics "
            "are kept")
        return None


def write_timelines(run_dir: Path, timelines: list, predicted, profile_name: str | None, program, title: str,
                    log: Callable[[str], None] = _stderr) -> None:
    """timeline_measured.csv (the kept steps), timeline_sim.csv, trace.json and gantt.png of the last step; any
    that cannot be written is named in one warning line (`log`)."""

    measured = pd.concat(timelines, ignore_index=True)
    last = int(measured["step"].max())
    pair = {f"measured (step {last})": one_step(measured, last)}
    writers: dict[str, Callable[[Path], object]] = {
        "timeline_measured.csv": lambda p: measured.to_csv(p, index=False)}
    if predicted is not None:
        writers["timeline_sim.csv"] = lambda p: predicted.timeline.to_csv(p, index=False)
        pair = {f"predicted ({profile_name})": predicted.timeline, **pair}
    writers["trace.json"] = lambda p: write_chrome_trace(p, pair, program)
    writers["gantt.png"] = lambda p: gantt(pair, p, title=title)
    _write_each(run_dir, writers, log)


def report_lines(s, profile_name: str | None, skipped_unit_updates: int = 0,
                 measured_steps: tuple[int, int] | None = None) -> list[str]:
    """The end-of-run summary: steps, loss, skipped updates, and predicted against measured step time;
    `measured_steps`: the first and last step the measured medians cover (named under the table, since the live
    calibration's line measures other steps its own way)."""
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
    if measured_steps is not None:
        a, b = measured_steps
        lines.append(f"measured: the median over steps {a}-{b} of a step's wall time"
                     + (" (the session's first step, which allocates, left out)" if a > s.start_step + 1 else ""))
    lines.append(f"run directory: {s.run_dir}")
    return lines


def report_after_run(summary: RunSummary, run_dir: Path, since: int, timelines: list, step_times: list[float],
                     idles: list[float], predicted, profile_name: str | None, program, title: str,
                     skipped_unit_updates: int, log: Callable[[str], None]) -> RunSummary:
    """What a session leaves after its last step (and its final checkpoint and export): `summary` given the measured
    step time and GPU idle (medians of `step_times` and `idles`, the first left out) of the Program that ran last
    (`since`: the step before its first; the session's start, or `--schedule auto`'s switch), the timelines
    (`write_timelines`, titled `title`), the report (`report_lines`, each line to `log`) and, with a prediction,
    the profile fitted to the run (profile_calibrated.json, profiling/live.py). Returns `summary`."""
    warm = step_times[1:] or step_times
    if warm:
        summary.measured_step_s = statistics.median(warm)
        summary.measured_idle_pct = statistics.median(idles[1:] or idles)
    if timelines:
        write_timelines(run_dir, timelines, predicted, profile_name, program, title, log=log)
    # step_times holds steps since+1.. (since: the session's start, or auto's switch); the median leaves the first out
    measured_steps = (since + (2 if len(step_times) > 1 else 1), summary.steps) if warm else None
    for line in report_lines(summary, profile_name, skipped_unit_updates, measured_steps):
        log(line)
    if predicted is not None and timelines:  # fit the profile to this run (profiling/live.py)
        summary.calibration = written_after_training(  # a full disk now does not fail the finished run
            log, [run_dir / "profile_calibrated.json"],
            lambda: calibrate_training_run(run_dir, program, predicted, profile_name, timelines, since, log))
    return summary
