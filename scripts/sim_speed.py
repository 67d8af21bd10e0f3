"""How long the simulator takes: build + lower + simulate one step of a model, median of several runs.

    python scripts/sim_speed.py                      # dense-120b (96 layers), 8 micro-batches, overlap, h200
    python scripts/sim_speed.py --model bench-3b --micro-batches 1 --repeat 10

The target (issue 3) is under 1 s for the 96-layer, 8-micro-batch case on the 2-core CI machine; the number is
recorded in docs/simulator.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from megatrain import build_schedule, get_model, knobs_for, lower, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dense-120b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--schedule", default="overlap")
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    spec = get_model(args.model)
    knobs = knobs_for(args.schedule, micro_batches=args.micro_batches)
    simulate(lower(build_schedule(spec, args.batch, args.seq, knobs)), args.profile)  # warm imports and caches
    phases = {"build": [], "lower": [], "simulate": [], "total": []}
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        sched = build_schedule(spec, args.batch, args.seq, knobs)
        t1 = time.perf_counter()
        prog = lower(sched)
        t2 = time.perf_counter()
        res = simulate(prog, args.profile)
        t3 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            phases[k].append(v)
    print(f"{spec.name}: {spec.num_layers} layers, batch {args.batch} x seq {args.seq}, "
          f"{args.micro_batches} micro-batches, schedule {args.schedule}, {len(prog.tasks)} tasks, "
          f"{os.cpu_count()} CPUs")
    print("  " + ", ".join(f"{k} {statistics.median(v) * 1e3:.0f} ms" for k, v in phases.items())
          + f" (median of {args.repeat})")
    print(f"  predicted step {res.step_s:.3f} s, GPU idle {100 * res.summary.gpu_idle_frac:.1f}%")


if __name__ == "__main__":
    main()
