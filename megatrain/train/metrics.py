"""Training metrics: one record per step, written as JSONL (the same keys every step), optionally to
TensorBoard event files (`run.tensorboard`; megatrain/train/tensorboard.py writes them, no package needed) and to any tracker passed to `run_training(..., trackers=[fn])` (each `fn` is
called with every step's record), and shown as one log line every `run.log_every` steps.

    logger = MetricsLogger(run_dir / "metrics.jsonl", tensorboard_dir=None)
    logger.write(record)          # record: a dict with exactly METRIC_KEYS
    print(format_step_line(record, total_steps=200))

Keys (units in the names; null where a value does not exist for the step, e.g. `eval_loss` between
evaluations, `grad_norm` without a global norm, `gpu_mem_gib` on the CPU backend):

    step            1-based number of the optimizer step just finished
    loss            mean training loss over the step's target tokens
    eval_loss       mean loss on the held-out batches, when the step evaluated
    lr              learning rate the step's update used
    grad_norm       global gradient norm before clipping
    skipped         an update settled during this step was skipped, wholly or for some units (non-finite
                    gradients); with "overlap" a unit's update of step n's gradients settles during step n+1
    skipped_units   how many unit updates were skipped (a whole skipped step counts every unit)
    tokens          target tokens of the step (all accumulated batches)
    step_s          seconds the streamed step took (the executor's measurement)
    tokens_per_s    tokens / step_s
    model_tflops    spec.model_flops_per_token() * tokens_per_s / 1e12  (6N per token, no recompute counted)
    gpu_idle_pct    share of the step the compute stream was idle, from the step's measured timeline
    host_rss_gib    resident memory of the process after the step
    gpu_mem_gib     peak GPU memory allocated during the step (CUDA; null on the CPU backend)
    elapsed_s       wall-clock seconds since the run (or its resume) started
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from megatrain.train.tensorboard import ScalarWriter
import errno
import pandas as pd
import torch

METRIC_KEYS = ("step", "loss", "eval_loss", "lr", "grad_norm", "skipped", "skipped_units", "tokens", "step_s", "tokens_per_s",
               "model_tflops", "gpu_idle_pct", "host_rss_gib", "gpu_mem_gib", "elapsed_s")


__all__ = ["METRIC_KEYS", "MetricsLogger", "format_step_line", "read_metrics",
           "gpu_peak_bytes", "reset_gpu_peak", "open_tensorboard"]


# ---- memory readings ---------------------------------------------------------------------------------------------
def gpu_peak_bytes(device) -> int | None:
    """Peak bytes torch allocated on a CUDA device since the last `reset_gpu_peak` (None for a CPU device)."""

    if getattr(device, "type", str(device)) != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device)


def reset_gpu_peak(device) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---- records -----------------------------------------------------------------------------------------------------
def _clean(value):
    """JSON has no NaN/inf: a non-finite float (a diverged loss) is written as a string, not dropped."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriteError(OSError):
    """metrics.jsonl could not be written (disk full, permissions): one line saying which step and why."""


def explain_os_error(e: OSError) -> str:
    """A short reason for a failed write: "the disk is full", "no permission", or the OS's words."""

    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"no permission to write ({e.strerror})"
    return e.strerror or str(e)


class MetricsLogger:
    """Appends one JSON line per step to `path` (flushed each time, so a crash loses at most the line being
    written) and, with `tensorboard_dir`, the numeric values as TensorBoard scalars."""

    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None, keep_until: int | None = None):
        """`keep_until`: on resume, the records of steps after this one (steps the checkpoint does not have and
        that will be run again) are removed first, so every step appears once."""
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if keep_until is not None and self.path.exists():
                self._truncate_after(keep_until)
            self._f = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise MetricsWriteError(f"could not open {self.path}: {explain_os_error(e)}") from e
        self._tb = None
        if tensorboard_dir is not None:
            self._tb = open_tensorboard(tensorboard_dir)

    def _truncate_after(self, step: int) -> None:
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and _step_of(line) is not None and _step_of(line) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)  # atomic: the old file stays complete until the new one replaces it

    def write(self, record: dict) -> None:
        """Write one step's record; it must have exactly METRIC_KEYS (missing or extra keys are a bug)."""
        if tuple(record) != METRIC_KEYS:
            missing = [k for k in METRIC_KEYS if k not in record]
            extra = [k for k in record if k not in METRIC_KEYS]
            raise ValueError(f"metrics record keys differ from METRIC_KEYS: missing {missing}, extra {extra}")
        try:
            self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            self._f.flush()
        except OSError as e:
            raise MetricsWriteError(f"could not append step {record['step']} to {self.path}: "
                                    f"{explain_os_error(e)}") from e
        if self._tb is not None:
            scalars = {("eval/" if key == "eval_loss" else "train/") + key: value for key, value in record.items()
                       if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
            self._tb.add_scalars(scalars, record["step"])

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass  # a failed flush was reported by write(); closing must not raise a second error
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a torn last line (the process was killed mid-write) is dropped


def open_tensorboard(directory: str | Path):
    """A writer of TensorBoard scalar event files in `directory` (megatrain/train/tensorboard.py)."""

    return ScalarWriter(directory)


def read_metrics(path: str | Path):
    """metrics.jsonl as a pandas DataFrame, one row per step (for notebooks and tests)."""

    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return pd.DataFrame(rows, columns=list(METRIC_KEYS))


# ---- the log line ------------------------------------------------------------------------------------------------
def _num(value, fmt: str, missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, str):  # a non-finite float, as written to JSON
        return value
    return format(value, fmt)


def format_step_line(r: dict, total_steps: int | None = None) -> str:
    """One line per `run.log_every` steps, short enough for a CI log: step, loss, lr, grad norm, s/step,
    tokens/s, model TFLOP/s, GPU idle %, host RSS, and peak GPU memory where there is a GPU."""
    width = len(str(total_steps)) if total_steps else 5
    step = f"step {r['step']:>{width}d}" + (f"/{total_steps}" if total_steps else "")
    parts = [step, f"loss {_num(r['loss'], '.4f')}"]
    if r["eval_loss"] is not None:
        parts.append(f"eval {_num(r['eval_loss'], '.4f')}")
    parts += [f"lr {_num(r['lr'], '.2e')}", f"gnorm {_num(r['grad_norm'], '.3f')}",
              f"{_num(r['step_s'], '.3f')} s/step", f"{_num(r['tokens_per_s'], ',.0f')} tok/s",
              f"{_num(r['model_tflops'], '.3g')} TFLOP/s", f"GPU idle {_num(r['gpu_idle_pct'], '.1f')}%",
              f"host {_num(r['host_rss_gib'], '.2f')} GiB"]
    if r["gpu_mem_gib"] is not None:
        parts.append(f"GPU {_num(r['gpu_mem_gib'], '.2f')} GiB")
    line = "  ".join(parts)
    if r["skipped"]:
        line += f"  SKIPPED {r['skipped_units']} unit update(s) (non-finite gradients)"
    return line
