"""One rank of a data-parallel CPU run (gloo), started by tests/test_dist_cpu.py as a subprocess with torchrun's
environment variables. Trains the debug model on the test's global batches and writes, on rank 0, the losses and
the gathered parameters to the output path. `--fail raise|sleep` makes rank 1 break in F1 (layer 1's forward); `--fail nan` makes rank 1's layer-1 gradients
non-finite in the second step; `--rank1-seq` gives rank 1 another sequence length (so another Program)."""
from __future__ import annotations

import argparse
import time

import torch

from megatrain.parallel.world import World
from megatrain.exec.optim import AdamWConfig
from megatrain.compile.knobs import knobs_for
from megatrain.model.presets import PRESETS
from megatrain.engine.trainer import StreamedTrainer

SPEC = PRESETS["debug"].with_layers(3)
GLOBAL_BATCH, SEQ = 4, 16


def batches(steps: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, SPEC.vocab_size, (GLOBAL_BATCH, SEQ), generator=gen)
        targets = torch.roll(ids, -1, 1)
        targets[:, -1] = -100
        targets[0, :5] = -100  # rows with different numbers of valid tokens: the loss needs the global count
        yield ids, targets


def trainer(schedule: str, clip: float, micro: int, world: World, timeout_s: float = 30.0,
            device: str = "cpu") -> StreamedTrainer:
    knobs = knobs_for(schedule, compute_dtype="fp32", weight_wire="fp32", clip=clip, micro_batches=micro)
    return StreamedTrainer(SPEC, knobs, optim=AdamWConfig(lr=1e-2, weight_decay=0.1), backend=device,
                           timeout_s=timeout_s, seed=3, world=world)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="overlap:0.5", help="schedule:clip,... trained one after the other")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fail", choices=["raise", "sleep", "nan"])
    ap.add_argument("--rank1-seq", type=int)
    ap.add_argument("--load", help="resume from this sharded checkpoint first")
    ap.add_argument("--save", help="write a sharded checkpoint here at the end")
    ap.add_argument("--skip", type=int, default=0, help="batches of the stream already trained on")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL, one GPU per rank")
    a = ap.parse_args()
    world = World.from_env(a.device, timeout_s=a.timeout)
    out = {}
    for case in a.cases.split(","):
        schedule, clip = case.split(":")
        out[case] = train_case(a, world, schedule, float(clip))
    if world.rank == 0:
        torch.save(out, a.out)
    world.close()


def train_case(a, world: World, schedule: str, clip: float) -> dict:
    tr = trainer(schedule, clip, 1, world, a.timeout, a.device)
    seq = a.rank1_seq if a.rank1_seq and world.rank == 1 else SEQ
    if a.fail in ("raise", "sleep") and world.rank == 1:
        fail = {"raise": _raise, "sleep": lambda t: time.sleep(3600)}[a.fail]
        work = tr.program(GLOBAL_BATCH // world.size, seq) and tr._work
        work.handlers["F"] = lambda t, f=work.handlers["F"]: fail(t) if t.unit == 1 else f(t)
    if a.fail == "nan" and world.rank == 1:
        work = tr.program(GLOBAL_BATCH // world.size, seq) and tr._work
        work.handlers["B"] = lambda t, f=work.handlers["B"]: _poison(work, t, f) if t.unit == 1 else f(t)
    results = run(tr, a.steps, a.skip, a.load, a.save, seq)
    tiles = {u: t.cpu() for u, t in tr.tiles().items()}
    mine = {"skipped": [r.skipped for r in results], "steps": dict(tr.store.steps)}
    every = [None] * world.size
    torch.distributed.all_gather_object(every, mine, group=world.host_group)
    return {"losses": [r.loss for r in results], "tiles": tiles, "ranks": every}


def run(tr: StreamedTrainer, steps: int, skip: int = 0, load: str | None = None, save: str | None = None,
        seq: int = SEQ) -> list:
    """Train `steps` steps on batches skip.. of the stream, resuming from / saving a sharded checkpoint."""
    from megatrain.io.sharded_checkpoint import load_sharded, save_sharded

    if load:
        tr.step_count = load_sharded(load, tr.store, tr.world)
    results = [tr.step(ids[:, :seq], targets[:, :seq]) for ids, targets in list(batches(skip + steps))[skip:]]
    if save:
        tr.flush()
        save_sharded(save, tr.store, tr.world, tr.step_count)
    return results


def _poison(work, t, f):
    """Layer 1's backward, then a NaN in its gradients in the second step (this rank's part of the sum only)."""
    f(t)
    if work.updates.current.step == 1:
        work.buffers[t.slot].g[0] = float("nan")


def _raise(t):
    raise RuntimeError(f"injected failure in {t.id}")


if __name__ == "__main__":
    main()
