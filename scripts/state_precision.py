"""fp32 vs bf16 optimizer state (knob state_dtype), trained side by side on the same data.

Two trainers start from the same seeded weights and see the same batches of real text (the bundled corpus, byte
tokens, unless --data is given); one keeps Adam m and v in fp32, the other in bf16 (fp32 math inside the update).
Prints a per-step loss table (every --every steps) and the max / mean relative difference of the losses; with $OUT
set, writes the full table to $OUT/state_precision.csv.

    PYTHONPATH=. python scripts/state_precision.py --model debug --steps 500                    # CPU, docs/precision.md
    PYTHONPATH=. python scripts/state_precision.py --model scripts/models/llama-1b --steps 200 \
        --batch 8 --seq 1024 --backend cuda                                                     # GPU, ~1B model
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from megatrain.exec.optim import AdamWConfig
from megatrain.compile.knobs import resolve_knobs
from megatrain.model.presets import get_model
from megatrain.data.batches import CORPUS_PATH, TrainLoader, Windows, read_text
from megatrain.engine.trainer import StreamedTrainer


def loss_table(fp32: list[float], bf16: list[float]) -> tuple[list[float], float, float]:
    """Per-step relative differences |bf16 - fp32| / fp32, and their max and mean."""
    rel = [abs(b - a) / abs(a) for a, b in zip(fp32, bf16)]
    return rel, max(rel), sum(rel) / len(rel)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="debug", help="a preset or a HF config directory")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", default="lean", help="a schedule whose updates run on the host")
    p.add_argument("--set", action="append", default=[], help="schedule knob overrides (knob=value)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--data", default=str(CORPUS_PATH), help="a text file (byte tokens)")
    p.add_argument("--every", type=int, default=25, help="print every n-th step")
    a = p.parse_args()

    spec = get_model(a.model)
    overrides = (["compute_dtype=fp32"] if a.backend == "cpu" else []) + a.set  # bf16 matmuls are slow on CPU
    name, knobs = resolve_knobs(a.schedule, overrides)
    optim = AdamWConfig(lr=a.lr, weight_decay=0.1)
    windows = Windows(read_text(a.data), a.seq)
    losses: dict[str, list[float]] = {}
    for dtype in ("fp32", "bf16"):
        trainer = StreamedTrainer(spec, dataclasses.replace(knobs, state_dtype=dtype), optim=optim,
                                  backend=a.backend, seed=0)
        loader = TrainLoader(windows, a.batch, seed=0)
        t0 = time.perf_counter()
        losses[dtype] = [trainer.step(b.inputs, b.targets).loss for b in (loader.next_batch() for _ in range(a.steps))]
        print(f"state {dtype}: {a.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
        del trainer
    rel, worst, mean = loss_table(losses["fp32"], losses["bf16"])
    print(f"\n{spec.name} ({spec.num_params / 1e6:.1f} M parameters), schedule {name}, batch {a.batch} x seq "
          f"{a.seq}, lr {a.lr:g}, data {Path(a.data).name}\n")
    print(f"{'step':>6}{'loss fp32 state':>18}{'loss bf16 state':>18}{'rel diff':>12}")
    for i in range(len(rel)):
        if i % a.every == 0 or i == len(rel) - 1:
            print(f"{i:>6}{losses['fp32'][i]:>18.4f}{losses['bf16'][i]:>18.4f}{rel[i]:>12.2e}")
    tail = max(1, len(rel) // 10)
    last = [sum(losses[d][-tail:]) / tail for d in ("fp32", "bf16")]
    print(f"\nrelative loss difference: max {worst:.2e}, mean {mean:.2e}; mean loss of the last {tail} steps: "
          f"fp32 {last[0]:.4f}, bf16 {last[1]:.4f}")
    print("RESULT " + json.dumps({"model": spec.name, "steps": a.steps, "max_rel": worst, "mean_rel": mean,
                                  "last_fp32": last[0], "last_bf16": last[1]}))
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "state_precision.csv"
        path.write_text("step,loss_fp32,loss_bf16,rel\n" + "".join(
            f"{i},{x},{y},{r}\n" for i, (x, y, r) in enumerate(zip(losses["fp32"], losses["bf16"], rel))))


if __name__ == "__main__":
    main()
