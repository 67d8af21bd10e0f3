"""What-if of the `comm` stream's order (no GPU): each backward all-gather issued before the reduce-scatter queued
just ahead of it.

Lowering queues a layer's backward all-gather `G<l-1>b` behind the previous layer's reduce-scatter `Z<l>`, which
waits for that layer's backward; the executor's comm thread issues collectives in queue order, so the backward pass
pays B + Z + G in series per layer. This script simulates the Program as lowered and with those pairs swapped (the
gather waits only for its own slice's copy, so the swap keeps the queue valid where the simulator runs it to the
end) and prints both steps and where the new critical path lies.

    python scripts/comm_order_whatif.py --model bench-3b --schedule arrival --gpus 8
    python scripts/comm_order_whatif.py --model dense-120b --schedule arrival --gpus 8 --hosts 2
"""
from __future__ import annotations

import argparse

from megatrain.ir.builders import build_schedule
from megatrain.ir.knobs import resolve_knobs
from megatrain.ir.program import lower
from megatrain.presets import get_model
from megatrain.sim import simulate


def gathers_first(program) -> list[str]:
    """The comm queue with every backward G moved before a Z directly ahead of it."""
    q = list(program.streams["comm"])
    for i in range(1, len(q)):
        a, b = program.tasks[q[i - 1]], program.tasks[q[i]]
        if b.kind == "G" and q[i].endswith("b") and a.kind == "Z":
            q[i - 1], q[i] = q[i], q[i - 1]
    return q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench-3b")
    ap.add_argument("--schedule", default="arrival")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per host")
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--profile", default="h200-measured")
    args = ap.parse_args()
    _, knobs = resolve_knobs(args.schedule, [])
    program = lower(build_schedule(get_model(args.model), args.batch, args.seq, knobs, world=args.gpus * args.hosts))
    before = simulate(program, args.profile, hosts=args.hosts)
    program.streams["comm"] = gathers_first(program)
    after = simulate(program, args.profile, hosts=args.hosts)
    for label, r in (("as lowered", before), ("gathers first", after)):
        path = ", ".join(f"{s} {v:.3f} s" for s, v in r.summary.critical_path_s.items() if v > 0)
        print(f"{label:>14}: step {r.step_s:.3f} s, {r.summary.tokens_per_s:,.0f} tok/s per GPU; critical path {path}")


if __name__ == "__main__":
    main()
