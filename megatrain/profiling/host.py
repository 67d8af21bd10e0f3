"""The host as a shared resource: host memory bandwidth, the CPU update alone and beside copies, the copies beside
the update, and the fit of the simulator's host memory model (sim/hostmem.py) to them.

What is measured (each on the thread the runtime would use, at the runtime's update thread count):

- host memory bandwidth alone: a streaming fp32 copy (read + write) of a buffer well beyond the caches on the cpu
  worker with the update's threads (`measure_host_memory`);
- the CPU update (the runtime's `adamw_update`, plus the bf16 refresh when the schedule streams bf16) alone, and
  while h2d copies, d2h copies, and both run in loops on their own workers, the four taking turns over rounds
  (`measure_contention`);
- each copy direction alone, while the update runs, and while the update and the other direction run.

On CUDA the copies are pinned-memory DMA on side streams (issued from the h2d / d2h workers) while the update runs
on the host threads. On the CPU backend both ends of a "copy" are host memory: a host-to-host memcpy on its own
thread, which takes a core as well as memory bandwidth (on a 2-core machine the slowdown it causes is mostly cores).

The fit (`fit_host_memory`): the simulator shares `host_memory_Bps` (B) max-min fairly between the update (drawing
`cpu_update_bytes_per_param` (bpp) per parameter) and the copies (`copy_host_bytes_per_byte` per byte). Copies
below their fair share keep their rate, so beside copies that draw c_k host bytes/s the update keeps
rate_k = (B - c_k) / bpp: a line in c_k, fitted by least squares over the copy mixes that slowed it (two unknowns,
three mixes). When the mixes do not determine a line consistent with the update alone (fewer than two slowed, or an
intercept below the alone rate), the update alone is taken as bound by host memory, B = bpp x rate_alone, and
rate_alone - rate_k = c_k / bpp gives bpp (least squares through the origin). The model's rate for each mix is kept
beside the measured one for the notes. If no copy slows the update measurably, nothing binds: bpp is the
implementation's byte count and B the larger of the streaming bandwidth and what all three flows drew together.
"""
from __future__ import annotations

import contextlib
import math

import torch

from megatrain.sim.profile import ADAM_BYTES_PER_PARAM, BESIDE, CONVERT_BYTES_PER_PARAM
from megatrain.profiling.bench import Background, Worker, median

MIXES = ("h2d", "d2h", "both")  # the copies that run beside the update
SLOWED = 0.97  # an update rate below this fraction of the alone rate counts as slowed


def measure_host_memory(worker: Worker, threads: int, nbytes: int, budget_s: float) -> dict:
    """Host memory bytes/s of a streaming read + write (fp32 `copy_` of `nbytes`) at `threads` intra-op threads."""
    n = max(1, nbytes // 4)
    src = torch.full((n,), 1.0)
    dst = torch.empty(n)
    before = worker.call(torch.get_num_threads)
    try:
        worker.call(torch.set_num_threads, threads)
        t = median(worker.time_for(lambda: dst.copy_(src), budget_s, warmup=1))
    finally:
        worker.call(torch.set_num_threads, before)
    return {"bytes": 4 * n, "threads": threads, "time_s": t, "Bps": 8.0 * n / t}


def measure_contention(cpu: Worker, update, threads: int, h2d: Worker, d2h: Worker, copy_in, copy_out,
                       nbytes: int, budget_s: float, quick: bool, out_bytes: int | None = None) -> dict:
    """The update's seconds alone and beside each copy mix; each copy direction's bytes/s alone, beside the
    update, and beside the update and the other direction. `copy_in` copies `nbytes`, `copy_out` `out_bytes`
    (default `nbytes`: the runtime's copies differ, a layer's weights in and its gradients out)."""
    out_bytes = nbytes if out_bytes is None else out_bytes
    reps = 3 if quick else 6
    rounds = 3 if quick else 4
    before = cpu.call(torch.get_num_threads)

    def copy_Bps(worker: Worker, fn) -> float:
        n = nbytes if worker is h2d else out_bytes
        return n / median(worker.time(fn, reps, warmup=1))

    backgrounds = {"alone": (), "h2d": ((h2d, copy_in),), "d2h": ((d2h, copy_out),),
                   "both": ((h2d, copy_in), (d2h, copy_out))}
    out: dict = {"copy_bytes": nbytes, "copy_out_bytes": out_bytes, "threads": threads, "rounds": rounds}
    try:
        cpu.call(torch.set_num_threads, threads)
        # The four mixes take turns, round after round: the host's own speed drifts (two quick profiles on two
        # starts of the H200 kind predicted the same schedules 20-25% apart, docs/accuracy.md: two machines of one
        # kind, or one host's drift, move the update's rate that much), and the fit reads the differences between
        # mixes, which drift measured mix after mix would bias. Each mix keeps its least disturbed round
        # (Worker.time_for's rule).
        first = cpu.time(update, 1, warmup=1)[0]
        per_round = max(1, int(budget_s / 4 / rounds / max(first, 1e-7)))
        samples: dict[str, list[float]] = {mix: [] for mix in backgrounds}
        for _ in range(rounds):
            for mix, bg in backgrounds.items():
                with contextlib.ExitStack() as stack:
                    for worker, fn in bg:
                        stack.enter_context(Background(worker, fn))
                    samples[mix].append(median(cpu.time(update, per_round, 0)))
        for mix, times in samples.items():
            out[f"update_{mix}_s"] = min(times)
            # every round's time too: whether the least disturbed round or a typical one matches the runtime's
            # steps is not settled (docs/accuracy.md, "A sixth H200 start"); recorded so a later run can tell
            out[f"update_{mix}_rounds_s"] = list(times)
        out["h2d_alone_Bps"], out["d2h_alone_Bps"] = copy_Bps(h2d, copy_in), copy_Bps(d2h, copy_out)
        with Background(cpu, update):
            out["h2d_update_Bps"], out["d2h_update_Bps"] = copy_Bps(h2d, copy_in), copy_Bps(d2h, copy_out)
            with Background(d2h, copy_out):
                out["h2d_both_Bps"] = copy_Bps(h2d, copy_in)
            with Background(h2d, copy_in):
                out["d2h_both_Bps"] = copy_Bps(d2h, copy_out)
    finally:
        cpu.call(torch.set_num_threads, before)
    return out


def update_bytes_per_param(passes: int) -> float:
    """Host bytes per parameter of the update as implemented: fused AdamW (28) plus 6 per bf16 conversion pass."""
    return ADAM_BYTES_PER_PARAM + passes * CONVERT_BYTES_PER_PARAM


def copy_beside_update(records: list[dict]) -> dict[str, float]:
    """The profile's `copy_beside_update` from `measure_contention` records: each copy direction's rate beside the
    update (and beside it and the other direction) over its rate alone, the mean over the records (the runtime's
    update at one or both weight wires beside the same copies), within [0.05, 1]."""
    out = {}
    for (direction, both), key in BESIDE.items():
        rate, alone = f"{direction}_{'both' if both else 'update'}_Bps", f"{direction}_alone_Bps"
        fracs = [c[rate] / c[alone] for c in records if c.get(rate, 0) > 0 and c.get(alone, 0) > 0]
        if fracs:
            out[key] = min(1.0, max(0.05, sum(fracs) / len(fracs)))
    return out


def _drawn(c: dict, copy_draw: float) -> dict[str, float]:
    """Host bytes/s the copies of each mix drew beside the update (a contention record's copy rates)."""
    both = c["h2d_both_Bps"] + c["d2h_both_Bps"]
    return {mix: copy_draw * (both if mix == "both" else c[f"{mix}_update_Bps"]) for mix in MIXES}


def _mix_rates(c: dict, params: int, copy_draw: float) -> tuple[float, list[tuple[float, float]]]:
    """A contention record's update rate alone and its (copy host bytes/s drawn, update rate) per copy mix (MIXES
    order), for an update of `params` parameters."""
    n, drawn = params, _drawn(c, copy_draw)
    return n / c["update_alone_s"], [(drawn[k], n / c[f"update_{k}_s"]) for k in MIXES]


def _model_rate(alone: float, host: float, bpp: float, drawn: float) -> float:
    """The simulator's update rate beside copies drawing `drawn` host bytes/s (sim/hostmem.py, max-min): what the
    budget leaves it, at most its rate alone."""
    return max(0.0, min(alone, (host - drawn) / bpp))


def fit_host_memory(c: dict, params: int, passes: int, copy_draw: float, stream_Bps: float) -> dict:
    """host_memory_Bps and cpu_update_bytes_per_param from `measure_contention`'s record (module docstring).

    params: parameters of one measured update; passes: its bf16 conversion passes; copy_draw: host bytes drawn
    per byte copied; stream_Bps: `measure_host_memory`'s bandwidth. Returns the two fields, whether the update was
    bound by host memory, and per copy mix the update rate measured and the rate the fitted model gives."""
    alone, mixes = _mix_rates(c, params, copy_draw)
    drawn = {k: d for k, (d, _) in zip(MIXES, mixes)}
    rate = {k: r for k, (_, r) in zip(MIXES, mixes)}
    slowed = [k for k in MIXES if rate[k] < SLOWED * alone]
    bpp, host = math.inf, math.inf
    if len(slowed) >= 2:
        # rate_k = (B - drawn_k) / bpp: a line in drawn_k, intercept B / bpp and slope -1 / bpp (least squares)
        xs, ys = [drawn[k] for k in slowed], [rate[k] for k in slowed]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
        if slope < 0 and my - slope * mx >= alone:  # the update alone below the line's intercept: consistent
            bpp = -1.0 / slope
            host = (my - slope * mx) * bpp
    if slowed and not math.isfinite(bpp):
        # the update alone taken as bound by host memory: B = bpp x rate_alone, rate_alone - rate_k = drawn_k / bpp
        inv = sum((alone - rate[k]) * drawn[k] for k in MIXES) / sum(drawn[k] ** 2 for k in MIXES)
        if inv > 0:
            bpp = 1.0 / inv
            host = bpp * alone
    if not math.isfinite(bpp):
        bpp = update_bytes_per_param(passes)
        host = max(stream_Bps, bpp * alone + drawn["both"])
    model = {k: _model_rate(alone, host, bpp, drawn[k]) for k in MIXES}
    return {"host_memory_Bps": host, "cpu_update_bytes_per_param": bpp, "bound": bool(slowed),
            "update_alone_params_per_s": alone, "update_params_per_s": rate, "model_params_per_s": model,
            "copies_drawn_Bps": drawn, "stream_Bps": stream_Bps}


def _misfit(alone: float, mixes: list[tuple[float, float]], host: float, bpp: float) -> float:
    """Sum of squared relative errors of the modelled rates: alone and beside each copy mix."""
    points = [(0.0, alone)] + mixes
    return sum((_model_rate(alone, host, bpp, d) / r - 1.0) ** 2 for d, r in points)


# The fit's grids (log-spaced): host budgets from the streaming bandwidth to 20x it, bytes per parameter 2-2000.
_HOST_GRID = [1.02 ** i for i in range(0, 152)]  # x1 .. x20
_BPP_GRID = [2.0 * 1.015 ** i for i in range(0, 465)]  # 2 .. ~2000 B/param
_TIE = 1e-5  # weight of the preference for the implementation's byte count among fits equally good


def fit_host_memory_wires(records: list[dict], copy_draw: float, stream_Bps: float) -> dict:
    """One host budget B, the update's bytes per parameter without conversion (b0) and per bf16 conversion pass
    (cb) fitted jointly to the runtime's update measured at two weight wires (`measure_contention` records, each
    with its `params` and conversion `passes`).

    Why two: the update with the bf16 weight wire also refreshes the bf16 streaming copy, and on the H100 host that
    pass is what the copies slow down (52 ms alone, 67 beside both copies for a 177 M-parameter layer), while the
    fp32-wire update beside the same copies ran at its rate alone (38 ms in the steps); the uncalibrated (a) quick
    profiles, whose fit took the bf16-wire update alone, predicted the fp32-wire one 7-31% slow (docs/accuracy.md).
    Each record gets bpp_i = b0 + passes_i x cb; the simulator's rate beside copies drawing d is
    min(alone, (B - d) / bpp_i). B is searched on a grid from the streaming bandwidth up; for each B each record's
    bpp is the one that fits its rates alone and beside the three copy mixes best (relative squared error), ties
    going to the implementation's count (28 + 6 per pass); the B of the least total error wins. Returns B, b0, cb,
    and per record its update's time alone and the measured and modelled rates."""
    if len({r["passes"] for r in records}) != len(records) or len(records) != 2:
        raise ValueError(f"fit_host_memory_wires needs two records of different conversion passes, got "
                         f"{[r['passes'] for r in records]}")
    records = sorted(records, key=lambda r: r["passes"])
    data = [_mix_rates(r, r["params"], copy_draw) for r in records]
    floor = max(stream_Bps, max(d for _, mixes in data for d, _ in mixes) * 1.05)
    best = None
    for scale in _HOST_GRID:
        host = floor * scale
        total, bpps = 0.0, []
        for rec, (alone, mixes) in zip(records, data):
            count = update_bytes_per_param(rec["passes"])
            err, bpp = min((_misfit(alone, mixes, host, b) + _TIE * math.log(b / count) ** 2, b) for b in _BPP_GRID)
            total += err
            bpps.append(bpp)
        if best is None or total < best[0] - 1e-12:
            best = (total, host, bpps)
    _, host, (b_lo, b_hi) = best
    p_lo, p_hi = records[0]["passes"], records[1]["passes"]
    cb = max(0.0, (b_hi - b_lo) / (p_hi - p_lo))
    b0 = max(1.0, b_lo - p_lo * cb)
    out = {"host_memory_Bps": host, "cpu_update_bytes_per_param": b0, "cpu_convert_bytes_per_param": cb,
           "stream_Bps": stream_Bps, "records": []}
    for rec, (alone, mixes) in zip(records, data):
        bpp = b0 + rec["passes"] * cb
        out["records"].append({"passes": rec["passes"], "params": rec["params"],
                               "update_alone_s": rec["update_alone_s"], "alone_params_per_s": alone,
                               "measured_params_per_s": dict(zip(MIXES, (r for _, r in mixes))),
                               "model_params_per_s": {k: _model_rate(alone, host, bpp, d)
                                                      for k, (d, _) in zip(MIXES, mixes)}})
    return out


def wires_note(fit: dict) -> str:
    """The profile note of the two-wire fit: each record's measured and modelled rates."""
    g = 1e9
    parts = []
    for r in fit["records"]:
        mixes = ", ".join(f"{k} {r['measured_params_per_s'][k] / g:.2f} (model {r['model_params_per_s'][k] / g:.2f})"
                          for k in MIXES)
        parts.append(f"{r['passes']} conversion pass(es): alone {r['alone_params_per_s'] / g:.2f}, beside {mixes}")
    return (f"fitted jointly to the runtime's update at both weight wires (profiling/host.fit_host_memory_wires): "
            f"B {fit['host_memory_Bps'] / g:.1f} GB/s, {fit['cpu_update_bytes_per_param']:.1f} B/param without "
            f"conversion + {fit['cpu_convert_bytes_per_param']:.1f} per conversion pass; Gparam/s " + "; ".join(parts)
            + ".")


def host_note(fit: dict, c: dict, device: str, threads: int) -> str:
    """The profile note of host_memory_Bps / cpu_update_bytes_per_param: what was measured and how well the fit
    reproduces each mix."""
    g = 1e9
    mixes = "; ".join(f"beside {k}: measured {fit['update_params_per_s'][k] / g:.2f}, model "
                      f"{fit['model_params_per_s'][k] / g:.2f}" for k in MIXES)
    copies = ("pinned DMA on side streams" if device == "cuda"
              else "host-to-host memcpys on their own threads (cores shared too)")
    how = ("the update's rate beside copies fitted as (B - copy bytes/s) / bpp by least squares over the copy mixes"
           if fit["bound"] else "no copy mix slowed the update: bpp is the implementation's count and "
           "B the larger of the streaming bandwidth and all three flows together")
    return (f"measured at {threads} update threads: streaming read+write {fit['stream_Bps'] / g:.1f} GB/s; CPU update "
            f"alone {fit['update_alone_params_per_s'] / g:.2f} Gparam/s, {mixes} Gparam/s; copies ({copies}) h2d "
            f"{c['h2d_alone_Bps'] / g:.1f} -> {c['h2d_update_Bps'] / g:.1f} GB/s and d2h {c['d2h_alone_Bps'] / g:.1f}"
            f" -> {c['d2h_update_Bps'] / g:.1f} GB/s beside the update; {how} "
            f"(B {fit['host_memory_Bps'] / g:.1f} GB/s, bpp {fit['cpu_update_bytes_per_param']:.1f}).")
