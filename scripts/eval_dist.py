"""Cost of the held-out evaluation (megatrain/train/evaluate.py) on one GPU and on the GPUs of one host.

Run from the repository root on the GPU machine; N = 1 is the one-GPU baseline (same rows, same weights):

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=1 scripts/eval_dist.py --model bench-3b
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 scripts/eval_dist.py --model bench-3b

Each rank builds a trainer with the seeded init (a sharded store for N > 1), then evaluates `--repeats` times on
random token ids (eval_batches x batch rows of seq tokens, the same on every rank). Rank 0 prints a table (one row
per rank): its eval rows, seconds per evaluation (median), seconds to fetch every full tile once without the
forward (the host all-gather for N > 1, plus the copy to the GPU; the part of an evaluation that N > 1 adds), the
GPU peak of an evaluation and the process's peak RSS; and the loss, which must be the same for every N (about
ln(vocab) at init). With $OUT set, the table is also written there.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import numpy as np
import torch

from megatrain.parallel.world import World
from megatrain.model.presets import get_model
from megatrain.train import evaluate as ev
from megatrain.data.batches import Data, TokenStream, Windows
from megatrain.engine.trainer import StreamedTrainer
from megatrain.units import MiB, GiB


def fetch_seconds(trainer) -> float:
    """Seconds to fetch every unit's full tile once, as an evaluation does (the host all-gather for N > 1, then
    the copy to the device), without the forward."""
    tiles = ev._StoreTiles(trainer.store)
    t0 = time.perf_counter()
    for unit in trainer.spec.units():
        tiles[unit].to(trainer.backend.device)
    _sync(trainer)
    return time.perf_counter() - t0


def _sync(trainer) -> None:
    if trainer.backend.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-3b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schedule", default="arrival")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (gloo)")
    a = ap.parse_args()

    world = World.from_env(a.device, 600.0)
    spec = get_model(a.model)
    trainer = StreamedTrainer(spec, a.schedule, backend=a.device, world=world)
    rows = a.eval_batches * a.batch
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, rows * a.seq + 1, dtype=np.int64)
    data = Data(train=None, eval=Windows(TokenStream(tokens, "random"), a.seq))
    cuda = trainer.backend.device.type == "cuda"
    times, fetch, peaks, loss = [], [], [], None
    for _ in range(a.repeats):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        _sync(trainer)
        t0 = time.perf_counter()
        loss = ev.evaluate(trainer, data, a.eval_batches, a.batch)
        _sync(trainer)
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() / GiB if cuda else 0.0)
        fetch.append(fetch_seconds(trainer))
    lo, hi = ev.rank_share(rows, world.rank, world.size)
    mine = (world.rank, hi - lo, statistics.median(times), statistics.median(fetch), max(peaks),
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / MiB)
    table = [None] * world.size
    if world.distributed:
        torch.distributed.all_gather_object(table, mine, group=world.host_group)
    else:
        table = [mine]
    if world.rank == 0:
        lines = [f"{a.model}, {world.size} rank(s) on {a.device}, {rows} eval rows x {a.seq}, loss {loss:.6f}",
                 "rank  rows  eval_s  fetch_s  gpu_peak_GiB  host_peak_RSS_GiB"]
        lines += [f"{r:4d}  {n:4d}  {t:6.2f}  {f:7.2f}  {g:12.2f}  {h:17.2f}" for r, n, t, f, g, h in table]
        print("\n".join(lines))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"eval_dist_{a.model}_{world.size}gpu.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")
    world.close()


if __name__ == "__main__":
    main()
