"""From measurements to a HardwareProfile: which measured number fills which field, and the notes that say so."""
from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import TYPE_CHECKING

from megatrain.ir.streams import ONE_GPU_STREAMS
from megatrain.sim.profile import CONVERT_BYTES_PER_PARAM, ComputeTable, CopyCurve, HardwareProfile, model_signature
from megatrain.model.spec import ModelSpec
from megatrain.profiling import copies, host, units
from megatrain.profiling.bench import median
from megatrain.units import MiB

if TYPE_CHECKING:
    from megatrain.profiling.calibrate import ProfileRequest

STREAMS = ONE_GPU_STREAMS  # a profile is measured on one GPU: no comm stream (ir/streams.py)
# Where build_profile takes the CPU update rate from (`choose_cpu_rate`). Three estimates of one rate, each biased
# its own way: the runtime's update timed alone at the operating point (least disturbed of a few rounds), the
# isolated AdamW loop, and the updates of the profiler's real steps. Each has missed the in-step rate of later runs
# by 20-40% on some H200 start where another held (docs/accuracy.md, "The CPU update rate: the median of three
# estimates"); their median, the default, drops whichever one is off.
OPERATING_POINT, IN_STEP, ISOLATED_LOOP = "operating point", "in-step", "isolated loop"
MEDIAN_OF_THREE = "median of three"
CPU_RATE_SOURCES = (MEDIAN_OF_THREE, OPERATING_POINT, IN_STEP, ISOLATED_LOOP)


def _default_name(info: dict) -> str:
    base = info.get("gpu", f"cpu-{info['cores']}core") if info["device"] == "cuda" else f"cpu-{info['cores']}core"
    return re.sub(r"[^A-Za-z0-9.-]+", "-", base).strip("-").lower() + "-measured"


def not_simulated(m: dict) -> str:
    """The measured effects the simulator has no parameter for (yet), in one line for the profile's notes."""
    cu, uu, ft = (m[k] for k in ("compute_under_update", "update_under_compute", "fresh_thread"))
    rel = m["runtime"].get("gap_by_stream_and_release_s", {})
    same = [v for k, v in rel.items() if k.endswith("/stream")]
    cross = [v for k, v in rel.items() if k.endswith("/wait")]
    wake = (f"; a task released by another stream's task starts {1e6 * sum(cross) / len(cross):.0f} us after it, one "
            f"released by its own stream's predecessor {1e6 * sum(same) / len(same):.0f} us"
            if same and cross else "")
    return (f"a layer forward takes {cu['factor']:.2f}x as long while a CPU update runs "
            f"({cu['alone_s'] * 1e3:.3f} -> {cu['with_update_s'] * 1e3:.3f} ms); a CPU update takes "
            f"{uu['factor']:.2f}x as long while the compute stream runs (its slowdown beside copies is simulated, see "
            f"host_memory_Bps); the first layer forward in a fresh issuing thread (the runtime keeps its threads, so "
            f"only its first step pays it) takes +{ft['extra_s'] * 1e3:.3f} ms{wake}.")


def sustained_factors(m: dict, tables: list[ComputeTable], spec: ModelSpec, dtype: str, seq: int, tokens: int,
                      compiled: bool) -> dict[str, float]:
    """How many times its compute table's time the profiled model's decoder layer takes back to back for seconds,
    as a step runs it: {kind: factor} for "F", "R" (F's: a recompute is a forward) and "B"; {} for measurements
    without `compute_sustained` (profiles measured before it).

    The factor is the back-to-back median (`rates.measure_compute_sustained`, at `tokens`, the variant the run
    compiles or not) over the table's time at the same tokens. Why: a table times a task in short bursts and keeps
    the least disturbed of 3 rounds (`bench.Worker.time_for`), while a step keeps the GPU busy for seconds; on an
    H100 start (2026-11-27) bench-3b's compiled layer ran F 6.2 ms and B 18.6 in steps against 5.25 and 16.9 in the
    table and 5.95 and 18.7 back to back, and the simulator priced those steps 13.8% fast (docs/accuracy.md, "The
    back-to-back compute rate"). A factor below 1 (the table is the least disturbed round: noise) is kept at 1."""
    sustained = m.get("compute_sustained")
    if not sustained:
        return {}
    sig = model_signature(spec)
    out = {}
    for kind in ("F", "B"):
        table = next((t for t in tables if t.model == sig and t.unit == "layer" and t.kind == kind
                      and t.dtype == dtype and t.seq == seq and t.compiled == compiled), None)
        if table is None or kind not in sustained:
            continue
        factor = float(sustained[kind]["sustained_s"]) / table.at(tokens)
        if math.isfinite(factor):
            out[kind] = max(1.0, factor)
    if "F" in out:
        out["R"] = out["F"]
    return out


def scale_layer_tables(tables: list[ComputeTable], model: str, dtype: str,
                       factors: dict[str, float]) -> list[ComputeTable]:
    """`tables` with model `model`'s decoder-layer tables of `dtype` (every sequence length, eager and compiled:
    the back-to-back effect is measured on one variant and taken as the GPU's under load, so that a profile prices
    the choice between them alike) multiplied by `factors[kind]`; every other table as it was."""
    return [replace(t, dur_s=tuple(d * factors[t.kind] for d in t.dur_s))
            if t.model == model and t.unit == "layer" and t.dtype == dtype and t.kind in factors else t
            for t in tables]


def _sustained_note(m: dict, factors: dict[str, float]) -> str:
    if not factors:
        return " Not scaled to a back-to-back rate (measured before the profiler timed one)."
    cs = m["compute_sustained"]
    return (" The decoder layer's tables (both variants) are scaled to the layer run back to back for seconds, a "
            "step's pattern (profiling/assemble.sustained_factors): "
            + ", ".join(f"{k} x{v:.3f}" for k, v in factors.items())
            + " (back to back " + ", ".join(f"{k} {cs[k]['sustained_s'] * 1e3:.3f} ms" for k in ("F", "B") if k in cs)
            + "; in bursts of 8 " + ", ".join(f"{k} {cs[k]['burst_s'] * 1e3:.3f}" for k in ("F", "B") if k in cs)
            + "); the unscaled tables are in the measurements' compute_tables.")


def _update_slowdown(m: dict) -> dict[int, float]:
    """Legacy `cpu_optimizer_slowdown` (how much longer a CPU update takes while 1 / 2 copy directions run), from
    the host contention measurement: one direction is the mean of h2d and d2h alone, two is both at once."""
    c = m["host_contention"]
    one = (c["update_h2d_s"] + c["update_d2h_s"]) / (2 * c["update_alone_s"])
    both = c["update_both_s"] / c["update_alone_s"]
    return {k: float(v) for k, v in ((1, one), (2, both)) if math.isfinite(v) and v > 1.0}


def in_step_cpu_rate(m: dict, slowdown: dict[int, float], convert_rate: float) -> float | None:
    """The CPU AdamW rate (params/s, alone) that reproduces the host updates of the profiler's real steps under
    the simulator's model, or None without such samples.

    The simulator runs an update as `fixed + params / rate (+ conversion passes)` of work, progressing 1/s(k) per
    second while k copy directions move bytes. A sample of duration d that spent t_k with k directions busy did
    sum(t_k / s(k)) of that work; solving for the rate gives one estimate per update, and the median is taken.
    (An isolated loop measures the rate with the cores and memory to itself, or with copies running back to back;
    inside a step neither holds, and the isolated figure has missed the in-step one by 15-20% on the H200.)"""
    samples = m.get("runtime", {}).get("cpu_update_samples") or []
    rt = m["runtime"]
    passes = (rt.get("weight_wire") == "bf16") + (rt.get("grad_wire") == "bf16")
    fixed = float(m["cpu_adam"].get("fixed_s", 0.0))
    rates = []
    for s in samples:
        work = s["t0_s"] + s["t1_s"] / slowdown.get(1, 1.0) + s["t2_s"] / slowdown.get(2, 1.0)
        adam_s = work - fixed - passes * s["params"] / convert_rate
        if adam_s > 0:
            rates.append(s["params"] / adam_s)
    return float(median(rates)) if rates else None


def operating_cpu_rate(op: dict, fixed_s: float, convert_rate: float) -> float | None:
    """The AdamW rate (params/s, alone) of the runtime's own update at the operating point: its time alone less
    the fixed cost per update (charged as the cpu stream's overhead) and its conversion passes (charged at
    cpu_convert_params_per_s), as the simulator rebuilds it. None when nothing is left (a fit gone wrong)."""
    n, c = op["params"], op["contention"]
    adam_s = c["update_alone_s"] - fixed_s - op["passes"] * n / convert_rate
    return n / adam_s if adam_s > 0.1 * c["update_alone_s"] else None


def choose_cpu_rate(sources: dict[str, float | None], rate_from: str) -> float | None:
    """The CPU update rate (params/s, alone, at the runtime's threads) a profile takes from its estimates
    (`sources`: "operating point", "isolated loop", "in-step", each None when not measured): their median
    (`MEDIAN_OF_THREE`; of two, their mean; of one, itself), or the one named, falling back to the in-step estimate
    when the operating point was not measured. None when nothing was measured."""
    if rate_from == MEDIAN_OF_THREE:
        known = [r for r in sources.values() if r]
        return float(median(known)) if known else None
    rate = sources.get(rate_from)
    return rate if rate or rate_from != OPERATING_POINT else sources.get(IN_STEP)


def operating_note(op: dict) -> str:
    """The profile note of the operating-point measurement (profiling/operating.py)."""
    c, k, g = op["copies"], op["contention"], 1e9
    return (f"the runtime's own copies and update on a 2-layer cut (profiling/operating.py): a layer's PREFETCH "
            f"{op['weight_bytes']:,} B at {c['h2d_alone_Bps'] / g:.2f} GB/s alone, {c['h2d_shared_Bps'] / g:.2f} "
            f"beside its OFFLOAD, {k['h2d_update_Bps'] / g:.2f} beside the update; OFFLOAD {op['grad_bytes']:,} B "
            f"at {c['d2h_alone_Bps'] / g:.2f}, {c['d2h_shared_Bps'] / g:.2f}, {k['d2h_update_Bps'] / g:.2f} GB/s "
            f"(these sizes are points of the h2d / d2h curves); {op['update_path']} of {op['params']:,} parameters "
            f"at {op['threads']} threads {k['update_alone_s'] * 1e3:.3f} ms alone, {k['update_both_s'] * 1e3:.3f} "
            f"ms beside both copies; the clipping redo ({op['redo_path']}: undo + update) "
            f"{op['redo_s'] * 1e3:.3f} ms, x{op['redo_over_update']:.2f} the update (not simulated yet).")


def _duplex_note(m: dict, op: dict | None) -> str:
    if op is None:
        return "measured: each direction timed while the other copies in a loop; the sum of the two rates."
    sweep = m["duplex"]
    return (f"measured at the runtime's operating point: a layer's PREFETCH copy ({op['weight_bytes']:,} B from the "
            f"store's pinned streaming tile) timed while its OFFLOAD copy ({op['grad_bytes']:,} B into the pinned "
            f"landing tile) runs in a loop, and the other way round; the sum of the two rates (the sweep's "
            f"{sweep['bytes'] / MiB:.0f} MiB buffers gave {sweep['duplex_Bps'] / 1e9:.1f} GB/s).")


def _cpu_rate_note(adam: dict, threads: int, op: dict | None, sources: dict[str, float | None],
                   rate_from: str, chosen: float | None) -> str:
    """The note of cpu_adam_params_per_s: the isolated loop, each estimate of the runtime's rate, and which was used."""
    g = 1e9
    out = (f"measured: exec.optim.adamw_update (no refresh) on {adam['params']:,}-parameter tiles; fixed cost "
           f"{adam['fixed_s'] * 1e6:.0f} us per update fitted over 3 sizes at {threads} threads (in "
           "task_overhead_s['cpu'])")
    named = {OPERATING_POINT: (f"the runtime's own update alone ({op['update_path']} on the host store's "
                                 f"{op['params']:,}-parameter layer tiles, {op['passes']} conversion passes taken "
                                 "out at cpu_convert_params_per_s)" if op else "the runtime's own update alone"),
             ISOLATED_LOOP: "the isolated loop",
             IN_STEP: "the host updates of the real steps below (through the legacy slowdown factors)"}
    known = [f"{named[k]} {v / g:.2f}" for k, v in sources.items() if v]
    if chosen is None or not known:
        return out + "."
    how = ("the median of the estimates" if rate_from == MEDIAN_OF_THREE else f"taken from {named[rate_from]}")
    return (out + f"; {chosen / g:.2f} Gparam/s at {threads} threads, {how}; the estimates of the runtime's "
            f"update rate (Gparam/s): " + "; ".join(known) + ".")


# ---- the profile ---------------------------------------------------------------------------------------------
def _efficiency(m: dict, spec: ModelSpec, tables: list[ComputeTable], dtype: str,
                compiled: bool = False) -> dict[str, float]:
    """Per unit class: analytic FLOPs / (matmul rate x measured time) of the model's measured tasks at the largest
    token count (a layer's forward and backward together, as a step mixes them; the head's fused task), so that
    the analytic fallback (shapes or dtypes without a table) is calibrated on this machine."""
    eff = {"layer": 1.0, "embed": 1.0, "head": 1.0}
    rate = m["matmul_flops_per_s"][dtype]
    sig = model_signature(spec)
    for uclass, kinds in (("layer", ("F", "B")), ("head", ("F",))):
        # the layer's tables of the variant the run asks for (a compiled run has eager tables beside them)
        # (and, with several sequence lengths, each kind's table at the longest)
        match = [t for t in tables if t.model == sig and t.unit == uclass and t.kind in kinds and t.dtype == dtype
                 and t.compiled == (compiled and uclass == "layer")]
        found = [max((t for t in match if t.kind == k), key=lambda t: t.seq) for k in kinds
                 if any(t.kind == k for t in match)]
        if len(found) != len(kinds):
            continue
        flops = sum(units.analytic_flops(spec, uclass, t.kind, t.tokens[-1] // t.seq, t.seq) for t in found)
        secs = sum(t.dur_s[-1] for t in found)
        if secs > 0:
            eff[uclass] = float(min(1.0, max(1e-4, flops / (rate * secs))))
    return eff


def compute_beside_copy(m: dict) -> dict[str, float]:
    """The profile's `compute_beside_copy` from the measurement of a layer's F and B beside copies (R, a forward,
    takes F's factor; a factor below 1, the noise of two medians, is kept at 1): {} for measurements without it."""
    r = m.get("compute_beside_copies")
    if not r:
        return {}
    f = {k: max(1.0, float(r[k]["factor"])) for k in ("F", "B")}
    return {"F": f["F"], "R": f["F"], "B": f["B"]}


def build_profile(m: dict, spec: ModelSpec, req: ProfileRequest, dtypes: list[str], threads: int,
                  info: dict, cpu_rate_from: str = MEDIAN_OF_THREE) -> HardwareProfile:
    """The HardwareProfile from the measurements (see the module docstring for which measurement fills what).
    `cpu_rate_from` (CPU_RATE_SOURCES): the median of the three estimates of the runtime's CPU update rate (the
    default), or one of them: "operating point" (`operating_cpu_rate`), "in-step" (`in_step_cpu_rate`), "isolated
    loop" (`exec.optim.adamw_update` on its own tiles by thread count); scripts/accuracy.py compares them on
    recorded runs. The curve over thread counts keeps the isolated loop's shape, scaled to the chosen rate."""
    if cpu_rate_from not in CPU_RATE_SOURCES:
        raise ValueError(f"cpu_rate_from must be one of {CPU_RATE_SOURCES}, got {cpu_rate_from!r}")
    tables = [ComputeTable(**{k: t[k] for k in ("model", "kind", "unit", "seq", "tokens", "dur_s", "dtype")},
                           compiled=t.get("compiled", False)) for t in m["compute_tables"]]
    sustained = sustained_factors(m, tables, spec, dtypes[0], req.seqs[0], req.batch * req.seqs[0],
                                  req.knobs.compile_layers)
    tables = scale_layer_tables(tables, model_signature(spec), dtypes[0], sustained)
    h2d = CopyCurve(tuple(m["h2d"]["sizes_bytes"]), tuple(m["h2d"]["Bps"]), m["h2d"]["latency_s"])
    d2h = CopyCurve(tuple(m["d2h"]["sizes_bytes"]), tuple(m["d2h"]["Bps"]), m["d2h"]["latency_s"])
    op = m.get("operating_point")  # the runtime's own copies and update (profiling/operating.py)
    duplex = float(m["duplex"]["duplex_Bps"])
    if op is not None:  # the runtime's sizes take the rates measured there; both at once is the runtime's pair
        h2d = copies.with_point(h2d, op["weight_bytes"], op["copies"]["h2d_alone_s"])
        d2h = copies.with_point(d2h, op["grad_bytes"], op["copies"]["d2h_alone_s"])
        duplex = float(op["copies"]["duplex_Bps"])
    rt, adam = m["runtime"], m["cpu_adam"]
    gaps = rt["gap_by_stream_s"]
    overhead = {s: float(gaps.get(s, 0.0)) for s in STREAMS}
    # A CPU update is `fixed + params / rate`: the fixed part of the update rides on the cpu stream's overhead
    # (the GPU placement's updates are on "compute", so they do not pick it up). The global norm (also on the
    # cpu stream) is a handful of float reads, so its measured ready-to-done time is its whole cost.
    overhead["cpu"] = float(rt["gap_by_kind_s"].get("U", gaps.get("cpu", 0.0))) + adam["fixed_s"]
    overhead["N"] = float(rt["norm_span_s"])
    hc = m["host_contention"]
    slowdown = _update_slowdown(m)
    # the conversion passes of the measured update: the runtime's (operating point), or the isolated loop's refresh
    passes = int(hc["passes"]) if "passes" in hc else int(req.knobs.weight_wire == "bf16")
    copy_draw = 1.0 if info["device"] == "cuda" else 2.0  # DMA reads or writes host memory; memcpy does both
    hfit = host.fit_host_memory(hc, hc["params"], passes, copy_draw, m["host_memory"]["Bps"])
    m["host_fit"] = hfit
    convert_rate = float(m["cpu_refresh"]["rate"])
    # the update at both weight wires (operating point): one budget, the update's bytes and the conversion pass's
    # own bytes fitted jointly, and the conversion pass's time alone is the two updates' difference
    wires, convert_from_wires = None, False
    if op is not None and "contention_other" in op:
        wires = host.fit_host_memory_wires([op["contention"], op["contention_other"]], copy_draw,
                                           m["host_memory"]["Bps"])
        m["host_fit_wires"] = wires
        lo, hi = wires["records"]  # by conversion passes, fewer first
        extra_s = (hi["update_alone_s"] - lo["update_alone_s"]) / (hi["passes"] - lo["passes"])
        if extra_s > 0:
            convert_rate, convert_from_wires = op["params"] / extra_s, True
    # the copies beside the update, as the fit above assumed them: the runtime's records (hc is the operating
    # point's own when there is one, profiling/calibrate.py), else the isolated loop's
    contention_records = [hc, op["contention_other"]] if wires is not None else [hc]
    beside = host.copy_beside_update(contention_records)
    slowed = compute_beside_copy(m)
    cpu_rates = {int(t): float(v) for t, v in adam["by_threads"].items()}
    isolated = cpu_rates.get(threads)
    sources = {OPERATING_POINT: operating_cpu_rate(op, adam["fixed_s"], convert_rate) if op is not None else None,
               ISOLATED_LOOP: isolated, IN_STEP: in_step_cpu_rate(m, slowdown, convert_rate)}
    chosen = choose_cpu_rate(sources, cpu_rate_from)
    if chosen is not None and isolated:
        cpu_rates = {t: v * chosen / isolated for t, v in cpu_rates.items()}
    what = info["gpu"] if info["device"] == "cuda" else info["cpu"]
    where = f"{info['device']} backend, {what}, {info['cores']} cores, torch {info['torch']}"
    notes = {
        "h2d": f"measured: {len(h2d.sizes_bytes)} sizes, pinned buffers (cudaHostRegister on CUDA), issued from the "
               f"h2d stream's thread; latency = smallest copy ({h2d.latency_s * 1e6:.1f} us).",
        "d2h": f"measured as h2d; latency {d2h.latency_s * 1e6:.1f} us"
               + (" (each curve has the runtime's copy of a layer as a point: see 'operating point')." if op else "."),
        "duplex_Bps": _duplex_note(m, op),
        "operating point": (operating_note(op) if op is not None else "not measured."),
        "matmul_flops_per_s": "measured: square matmuls (the analytic fallback only).",
        "efficiency": "derived: analytic FLOPs / (matmul rate x measured time) of the largest measured task.",
        "gpu_memory_Bps": "measured: device-to-device copy, read + write bytes.",
        "compute_tables": f"measured: the executor's task bodies on slot-like buffers, {'/'.join(dtypes)}, "
                          f"weight wire {req.knobs.weight_wire}, decoder layer "
                          f"{'compiled (torch.compile)' if req.knobs.compile_layers else 'eager'}, from the compute "
                          f"stream's thread." + _sustained_note(m, sustained),
        "cpu_convert_params_per_s": ("measured: the runtime's update alone at the bf16 weight wire less the same "
                                     "at the fp32 wire (the streaming copy's refresh in Updates.update; "
                                     f"HostStore.refresh_stream alone: {float(m['cpu_refresh']['rate']) / 1e9:.2f} "
                                     "Gparam/s)" if convert_from_wires
                                     else "measured: fp32 master -> bf16 streaming copy (HostStore.refresh_stream) at "
                                     "the runtime's threads")
                                    + "; charged to a CPU update once per bf16 wire (weights, gradients).",
        "cpu_adam_params_per_s": _cpu_rate_note(adam, threads, op, sources, cpu_rate_from, chosen),
        "cpu_threads": "the runtime's update threads (training.trainer.set_update_threads).",
        "gpu_adam_params_per_s": "measured: adamw_update on device tiles of one layer.",
        "clip_redo_updates": (f"measured: speculative clipping's redo of a device unit (adamw_undo + adamw_update, "
                              f"as Updates.clip_redo) on the same tiles, {m['gpu_adam']['redo_s'] * 1e3:.3f} ms = "
                              f"x{m['gpu_adam']['redo_updates']:.2f} the update" if "redo_updates" in m["gpu_adam"]
                              else "the default (2 updates), not measured"),
        "clip_norm_params_per_s": "not a rate: the norm combines per-unit norms; its time is task_overhead_s['N'].",
        "cpu_optimizer_slowdown": "legacy, not simulated: the CPU update beside one copy direction (mean of h2d "
                                  "and d2h) and both, over the update alone (host contention measurement).",
        "host_memory_Bps": "fitted (profiling/host.py): " + (
            host.wires_note(wires) + " The one-wire fit (not used): " if wires is not None else "")
            + host.host_note(hfit, hc, info["device"], threads),
        "cpu_update_bytes_per_param": ("fitted with host_memory_Bps from the update without a conversion pass (the "
                                       "fp32 weight wire)" if wires is not None else
                                       f"fitted with host_memory_Bps, less 6 per conversion pass of the measured "
                                       f"update, which the simulator adds back") + " (the implementation's count is "
                                      f"{host.update_bytes_per_param(passes):g} B/param: fused AdamW 28"
                                      f"{' + 6 per bf16 conversion pass' if passes else ''}).",
        "cpu_convert_bytes_per_param": ("fitted with host_memory_Bps: the bf16-wire update's bytes beyond the "
                                        "fp32-wire one's, per pass" if wires is not None else
                                        "6 by count (read 4 + write 2); one weight wire measured, not fitted."),
        "copy_host_bytes_per_byte": ("1: a DMA copy reads (h2d) or writes (d2h) host memory once." if copy_draw == 1
                                     else "2: on the CPU backend a copy is a memcpy, which reads and writes host "
                                          "memory."),
        "copy_beside_update": ("measured: each copy direction's rate beside the runtime's update (and beside it "
                               "and the other direction) over its rate alone, mean of "
                               f"{len(contention_records)} record(s) ("
                               + ("the operating point's update at each weight wire" if op is not None
                                  else "the isolated update loop") + "): "
                               + ", ".join(f"{k} {v:.2f}" for k, v in beside.items())
                               + "; the host fit (host_memory_Bps) assumed the copies at these rates."),
        **({"compute_beside_copy": "measured: a layer's F and B beside copies in both directions (looped, "
                                   f"{m['compute_beside_copies']['copy_bytes'] / MiB:.0f} MiB each) over alone: "
                                   + ", ".join(f"{k} {v['alone_s'] * 1e3:.3f} -> {v['beside_copies_s'] * 1e3:.3f} ms"
                                               for k, v in m["compute_beside_copies"].items() if k in ("F", "B"))
                                   + "; R takes F's; a factor below 1 (noise) is kept at 1."}
           if slowed else {}),
        "dma_factor_cpu_optimizer": f"legacy, not simulated (host_memory_Bps replaces it): h2d "
                                    f"{hc['h2d_alone_Bps'] / 1e9:.2f} GB/s alone, {hc['h2d_update_Bps'] / 1e9:.2f} "
                                    "GB/s while CPU updates run.",
        "machine": "recorded by `megatrain profile` (profiling/machine.py); train and simulate compare it with the "
                   "machine they run on.",
        "task_overhead_s": "measured: mean gap between a task's last dependency and its start in real steps of a "
                           f"{rt['layers']}-layer cut of {spec.name} (batch {rt['batch']} x {rt['seq']}); 'cpu' adds "
                           "the update's fixed cost; 'N' is the norm's whole ready-to-done time.",
        "not simulated (measured)": not_simulated(m),
    }
    return HardwareProfile(
        name=req.name or _default_name(info),
        h2d=h2d, d2h=d2h,
        duplex_Bps=duplex,
        matmul_flops_per_s={k: float(v) for k, v in m["matmul_flops_per_s"].items()},
        efficiency=_efficiency(m, spec, tables, dtypes[0], req.knobs.compile_layers),
        gpu_memory_Bps=float(m["gpu_memory_Bps"]),
        compute_tables=tuple(tables),
        cpu_adam_params_per_s=cpu_rates,
        cpu_threads=threads,
        gpu_adam_params_per_s=float(m["gpu_adam"]["rate"]),
        **({"clip_redo_updates": float(m["gpu_adam"]["redo_updates"])} if "redo_updates" in m["gpu_adam"] else {}),
        clip_norm_params_per_s=math.inf,
        dma_factor_cpu_optimizer=float(min(1.0, max(0.05, hc["h2d_update_Bps"] / hc["h2d_alone_Bps"]))),
        cpu_optimizer_slowdown=slowdown,
        cpu_convert_params_per_s=convert_rate,
        **({"host_memory_Bps": float(wires["host_memory_Bps"]),
            "cpu_update_bytes_per_param": float(wires["cpu_update_bytes_per_param"]),
            "cpu_convert_bytes_per_param": float(wires["cpu_convert_bytes_per_param"])} if wires is not None else
           # one wire measured: its update includes its conversion passes; the simulator adds 6 B/param per pass
           {"host_memory_Bps": float(hfit["host_memory_Bps"]),
            "cpu_update_bytes_per_param": float(max(1.0, hfit["cpu_update_bytes_per_param"]
                                                    - passes * CONVERT_BYTES_PER_PARAM))}),
        copy_host_bytes_per_byte=copy_draw,
        copy_beside_update=beside,
        compute_beside_copy=slowed,
        task_overhead_s=overhead,
        machine={k: v for k, v in info.items() if k != "host"},
        description=f"Measured by `megatrain profile` on {where}, {info['date']}, for {spec.name} "
                    f"(batch up to {req.batch}, seq {req.seqs}){'; quick' if req.quick else ''}.",
        notes=notes,
    )
