"""Choosing a knob by simulation: the GPU share of the optimizer that minimizes the predicted step.

With exact clipping no update can start before the global norm at the end of the backward, and the next forward
needs every layer's update, so the forward phase lasts as long as the slowest of: the forward compute, the host
threads' updates, and the PCIe bytes of the GPU's share (16 B/param in and 14 B/param out per GPU-updated layer,
12 + 12 when its gradients stay on the GPU). `best_gpu_fraction` sweeps the number of GPU-updated layers through
the simulator and returns the fastest variant that fits the GPU memory given:

    from megatrain.tune.search import best_gpu_fraction
    best = best_gpu_fraction(spec, 8, 2048, knobs_for("overlap-split"), "h200", gpu_bytes=16 * 2**30)
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
                             gpu_idle_pct=100 * res.summary.gpu_idle_frac, gpu_peak_gib=peak / 2**30))
    if not rows:
        raise ScheduleError(f"no variant of {knobs.optimizer!r} fits a GPU peak of {gpu_bytes / 2**30:.2f} GiB; "
                            "see `megatrain plan` for what takes the memory")
    table = pd.DataFrame(rows)
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["step_s"], rows[i]["gpu_layers"]))
    best_knobs, best_result = results[order[0]]
    return TuneResult(best_knobs, best_result, table.iloc[order].reset_index(drop=True))


# ---- --schedule auto --------------------------------------------------------------------------------------------
# Knobs that decide the numbers training computes: `auto` keeps the user's, and searches only where and when work
# runs (placement, buffers, resident units, kept gradients, wires of the weights, checkpoint offload).
NUMERICS_KNOBS = ("clip", "compute_dtype", "grad_wire", "compile_layers", "loss_chunk_tokens", "mlp_tile_tokens",
                  "micro_batches", "state_dtype")


def auto_candidates(spec: ModelSpec, base: ScheduleKnobs) -> dict[str, ScheduleKnobs]:
    """Schedules `auto` tries: every named schedule with the base's numerics (its clipping included), 2 or 3 weight buffers, and for the arrival placements resident units in a few sizes."""
    from dataclasses import fields as dc_fields

    from megatrain.compile.knobs import NAMED_SCHEDULES

    keep = {f.name: getattr(base, f.name) for f in dc_fields(ScheduleKnobs) if f.name in NUMERICS_KNOBS}
    L = spec.num_layers
    out: dict[str, ScheduleKnobs] = {}
    for name, named in NAMED_SCHEDULES.items():
        timing = OPTIMIZER_PRESETS[named.optimizer][0].value  # arrival clips speculatively, still exactly
        for buffers in sorted({2, 3} & set(range(1, max(L, 1) + 1))):
            knobs = replace(named, **keep, buffers=buffers)
            out[f"{name}[buffers={buffers}]"] = knobs
            if timing == "arrival" and not spec.tie_word_embeddings:
                for r in sorted({0, 2, 4, 8, L // 2} & set(range(L + 1))):
                    out[f"{name}[buffers={buffers},resident_embeddings,resident_layers={r}]"] = replace(
                        knobs, resident_embeddings=True, resident_layers=r)  # a clash with GPU layers: refused
    return out


def choose_schedule(spec: ModelSpec, batch: int, seq: int, base: ScheduleKnobs,
                    profile: HardwareProfile | str, gpu_bytes: int, host_bytes: int | None = None,
                    same_host_layout: bool = False, world: int = 1) -> TuneResult:
    """The fastest predicted schedule for (spec, batch, seq) that fits `gpu_bytes` of planned GPU peak and keeps
    the numerics of `base` (its clipping, compute dtype, gradient wire, layer kernel, loss chunk, micro-batches), and
    whose host plan fits `host_bytes` when given. same_host_layout: only candidates whose host store has the
    layout of `base`'s (a running trainer can switch to them without rebuilding its store: `use_program`).
    world: data-parallel ranks (schedules that data parallelism refuses are left out; the step is one rank's).
    `table` lists every candidate that fits, fastest first; a candidate the resolver refuses is left out."""
    from megatrain.compile.resolve import resolve_host_layout

    profile = load_profile(profile)
    layout = resolve_host_layout(spec, base) if same_host_layout else None
    rows, results = [], []
    for label, knobs in auto_candidates(spec, base).items():
        try:
            if layout is not None and resolve_host_layout(spec, knobs) != layout:
                continue
            plan = plan_memory(spec, batch, seq, knobs)
            peak = plan.gpu.peak_bytes
            if peak > gpu_bytes or (host_bytes is not None and plan.host.total_bytes > host_bytes):
                continue
            res = simulate(lower(build_schedule(spec, batch, seq, knobs, world=world)), profile)
        except ScheduleError:
            continue
        results.append((knobs, res))
        rows.append(dict(schedule=label, step_s=res.step_s, tokens_per_s=res.summary.tokens_per_s,
                         gpu_idle_pct=100 * res.summary.gpu_idle_frac, gpu_peak_gib=peak / 2**30))
    if not rows:
        host = f" and {host_bytes / 2**30:.1f} GiB of host memory" if host_bytes is not None else ""
        same = " with the same host layout" if layout is not None else ""
        raise ScheduleError(f"no schedule{same} keeps these numerics and fits a GPU peak of {gpu_bytes / 2**30:.2f} GiB"
                            f"{host}; see `megatrain plan` for what takes the memory, or raise the budget")
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["step_s"], rows[i]["schedule"]))
    knobs, result = results[order[0]]
    return TuneResult(knobs, result, pd.DataFrame(rows).iloc[order].reset_index(drop=True))
