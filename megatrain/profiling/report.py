"""What `megatrain profile` prints when it is done: every number of the profile, with what it was measured on,
laid out to be pasted into docs/calibration.md."""
from __future__ import annotations

from megatrain.profiling.assemble import not_simulated
from megatrain.profiling.calibrate import Calibration
from megatrain.profiling.machine import describe
from megatrain.units import format_bytes


def calibration_report(cal: Calibration) -> str:
    """A multi-line summary of a Calibration: machine, copies, compute tables, optimizer, overheads, contention."""
    p, m = cal.profile, cal.measurements
    mach = m["machine"]
    lines = [f"profile {p.name}: {p.description}", f"machine: {describe(mach)}, {mach['date']}",
             "", "copies (time of one copy, and the curve's rate = size / (time - latency)):",
             f"  {'size':>10} {'h2d us':>10} {'h2d GB/s':>9} {'d2h us':>10} {'d2h GB/s':>9}"]
    h, d = m["h2d"], m["d2h"]
    for i, n in enumerate(h["sizes_bytes"]):
        lines.append(f"  {format_bytes(n, 'g'):>10} {h['time_s'][i] * 1e6:>10.1f} {h['Bps'][i] / 1e9:>9.2f} "
                     f"{d['time_s'][i] * 1e6:>10.1f} {d['Bps'][i] / 1e9:>9.2f}")
    dup = m["duplex"]
    lines += [f"  latency h2d {p.h2d.latency_s * 1e6:.1f} us, d2h {p.d2h.latency_s * 1e6:.1f} us; both at once "
              f"({format_bytes(dup['bytes'], 'g')}): h2d {dup['h2d_shared_Bps'] / 1e9:.2f} + d2h "
              f"{dup['d2h_shared_Bps'] / 1e9:.2f}"
              f" = {p.duplex_Bps / 1e9:.2f} GB/s; h2d while a CPU update runs x{p.dma_factor_cpu_optimizer:.2f}",
              "", "compute tables (ms per task by tokens per task):"]
    shape = None
    for t in p.compute_tables:
        if t.model != shape:
            shape = t.model
            lines.append(f"  {shape}")
        pts = ", ".join(f"{n}: {s * 1e3:.3f}" for n, s in zip(t.tokens, t.dur_s))
        lines.append(f"    {t.unit:5} {t.kind}  {t.dtype:4} seq {t.seq:<6} {pts}")
    lines.append(f"  ({p.notes.get('compute_tables', 'measured')})")
    mm = ", ".join(f"{k} {v / 1e12:.3f}" for k, v in p.matmul_flops_per_s.items())
    eff = ", ".join(f"{k} {v:.2f}" for k, v in p.efficiency.items())
    lines.append(f"  matmul TFLOP/s: {mm}; efficiency of the measured tasks vs that: {eff}; "
                 f"device memory {p.gpu_memory_Bps / 1e9:.1f} GB/s")
    adam = m["cpu_adam"]
    by = ", ".join(f"{t} threads {v / 1e9:.2f}" for t, v in p.cpu_adam_params_per_s.items())
    lines += ["", f"CPU AdamW on {adam['params']:,}-parameter tiles, Gparam/s: {by}; the runtime "
                  f"uses {p.cpu_threads} threads; fixed cost {adam['fixed_s'] * 1e6:.0f} us per update",
              f"AdamW on device tiles: {p.gpu_adam_params_per_s / 1e9:.2f} Gparam/s",
              "", f"host memory: {p.notes.get('host_memory_Bps', '')}"]
    rt = m["runtime"]
    ov = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in p.task_overhead_s.items())
    steps = ", ".join(f"{s * 1e3:.1f}" for s in rt["step_s"])
    lines += ["", f"runtime overheads (us; gaps of {rt['steps']} real steps of a {rt['layers']}-layer cut at batch "
                  f"{rt['batch']} x {rt['seq']}, step ms {steps}): {ov}"]
    if "host_wait_late_s" in m and mach["device"] == "cuda":
        lines.append(f"  a host task notices a finished device event {m['host_wait_late_s'] * 1e6:.0f} us late")
    lines += ["", "measured but not simulated: " + not_simulated(m)]
    return "\n".join(lines)
