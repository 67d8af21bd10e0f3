"""Choosing a knob by simulation: the GPU share of the optimizer that minimizes the predicted step.

With exact clipping no update can start before the global norm at the end of the backward, and the next forward
needs every layer's update, so the forward phase lasts as long as the slowest of: the forward compute, the host
threads' updates, and the PCIe bytes of the GPU's share (16 B/param in and 14 B/param out per GPU-updated layer,
12 + 12 when its gradients stay on the GPU). `best_gpu_fraction` sweeps the number of GPU-updated layers through
the simulator and returns the fastest variant that fits the GPU memory given:

    from megatrain.tune.search import best_gpu_fraction
    best = best_gpu_fraction(spec, 8, 2048, knobs_for("overlap-split"), "h200", gpu_bytes=16 * GiB)
    best.knobs.gpu_optimizer_fraction, best.result.summary.tokens_per_s
    best.table      # one row per candidate

The answer depends on the profile's CPU AdamW rate above all: measure it (`megatrain profile`) before trusting it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import pandas as pd

import megatrain.parallel  # noqa: F401  (registers the collective strategies: the search simulates world > 1)
from megatrain.compile.builders import build_schedule
from megatrain.ir.dag import ScheduleError
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.compile.advice import plan_memory
from megatrain.compile.lower import lower
from megatrain.compile.resolve import FRACTION_RULES, OPTIMIZER_PRESETS
from megatrain.sim.engine import SimResult, simulate
from megatrain.sim.profile import HardwareProfile, load_profile
from megatrain.model.spec import ModelSpec
from megatrain.units import GiB


@dataclass
class TuneResult:
    """The chosen knobs, their simulation, and every candidate tried (`table`, fastest first)."""

    knobs: ScheduleKnobs
    result: SimResult
    table: pd.DataFrame


def _max_retained(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, n_gpu: int,
                  gpu_bytes: int | None) -> int | None:
    """The most GPU-updated layers that can keep their gradients on the GPU within `gpu_bytes` (None: not even the
    variant without any fits)."""
    def fits(r: int) -> bool:
        return gpu_bytes is None or plan_memory(spec, batch, seq, replace(knobs, retain_grads=r)).gpu.peak_bytes \
            <= gpu_bytes

    if not fits(0):
        return None
    lo, hi = 0, n_gpu  # fits(lo) holds; the peak grows with r, so bisect for the last r that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def best_gpu_fraction(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs,
                      profile: HardwareProfile | str = "h200", gpu_bytes: int | None = None,
                      retain: str = "max", state_buffers: Iterable[int] | None = None) -> TuneResult:
    """The `gpu_optimizer_fraction` (0, 1/L, ..., 1) of a GPU-share placement with the shortest predicted step.

    knobs: the starting point; placement "overlap" is tuned as "overlap-split" (whose fraction 0 is "overlap"),
        "split" as itself. retain: "max" sets `retain_grads` to the most layers that fit `gpu_bytes` (all GPU-updated
        layers when no limit is given), "keep" keeps the knob's value (capped at the GPU-updated layers).
    gpu_bytes: the planned GPU peak (`program.memory.peak_bytes`) a candidate may not exceed.
    state_buffers: values of that knob to try as well (default: the knob's own).
    """
    if knobs.optimizer == "overlap":
        knobs = replace(knobs, optimizer="overlap-split")
    tunable = [name for name, (_, rule) in OPTIMIZER_PRESETS.items() if rule in FRACTION_RULES]
    if knobs.optimizer not in tunable:
        raise ScheduleError(f"optimizer={knobs.optimizer!r} has no GPU share to tune; use one of "
                            f"{', '.join(tunable)} (or 'overlap', tuned as 'overlap-split')")
    if retain not in ("max", "keep"):
        raise ValueError(f"retain={retain!r}: use 'max' or 'keep'")
    profile = load_profile(profile)
    L = spec.num_layers
    rows, results = [], {}
    for sb in sorted(set(state_buffers or [knobs.state_buffers or 2])):
        for n in range(L + 1):
            # State buffers and the lookahead exist only with GPU-updated layers (the resolver refuses them else).
            cand = replace(knobs, gpu_optimizer_fraction=n / L if L else 0.0, state_buffers=min(sb, n) or None,
                           state_lookahead=knobs.state_lookahead if n else None, retain_grads=0)
            keep = min(knobs.retain_grads, n)
            r = keep if retain == "keep" else _max_retained(spec, batch, seq, cand, n, gpu_bytes)
            if r is None:
                continue
            cand = replace(cand, retain_grads=r)
            peak = plan_memory(spec, batch, seq, cand).gpu.peak_bytes
            if gpu_bytes is not None and peak > gpu_bytes:
                continue
            res = simulate(lower(build_schedule(spec, batch, seq, cand)), profile)
            results[len(rows)] = (cand, res)
            rows.append(dict(gpu_layers=n, gpu_optimizer_fraction=cand.gpu_optimizer_fraction, state_buffers=sb,
                             retain_grads=r, step_s=res.step_s, tokens_per_s=res.summary.tokens_per_s,
                             gpu_idle_pct=100 * res.summary.gpu_idle_frac, gpu_peak_gib=peak / GiB))
    if not rows:
        raise ScheduleError(f"no variant of {knobs.optimizer!r} fits a GPU peak of {gpu_bytes / GiB:.2f} GiB; "
                            "see `megatrain plan` for what takes the memory")
    table = pd.DataFrame(rows)
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["step_s"], rows[i]["gpu_layers"]))
    best_knobs, best_result = results[order[0]]
    return TuneResult(best_knobs, best_result, table.iloc[order].reset_index(drop=True))
