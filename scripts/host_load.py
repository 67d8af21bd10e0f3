"""Host load with several GPUs (issue 17): H2D bandwidth per GPU when every GPU copies at once, and the CPU AdamW
rate of megatrain's update under that load: the two host resources data parallel training shares.

    python scripts/host_load.py --gpus 8 --seconds 5                     # the GPU machine (all its GPUs)
    python scripts/host_load.py --gpus 2 --device cpu --seconds 0.5 --mib 16 --params 1e6   # the CPU stand-in

Phases, each `--seconds` long; the copiers (one process per GPU, pinned host buffer -> its GPU, `--duplex` adds
the other direction on a second stream) and the update (this process: `exec.optim.adamw_update` plus the bf16
streaming-copy refresh, on `--threads` threads) start together through a barrier:
  1. GPU 0 copies alone;  2. all GPUs copy at once;  3. the update alone;  4. the update while all GPUs copy.
On `--device cpu` a "GPU" is a host-to-host copy (for testing the script, not a measurement of anything).
Prints a table and writes $OUT/host_load.json (or ./host_load.json).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from megatrain.exec.optim import AdamWConfig, adamw_update
from megatrain.units import MiB

WAIT_S = 120.0  # the longest any process waits for the others (barrier, results)


def copier(gpu: int, device: str, mib: int, seconds: float, duplex: bool, barrier, results) -> None:
    """Copy a pinned host buffer to GPU `gpu` (and back at the same time, with `duplex`) for `seconds`; report the
    H2D GB/s."""
    n = mib * MiB
    if device == "cuda":
        torch.cuda.set_device(gpu)
        src, dst = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8, device="cuda")
        back, ret = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8).pin_memory()
        h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    else:
        src, dst, back, ret = (torch.empty(n, dtype=torch.uint8) for _ in range(4))
    dst.copy_(src)  # warm-up: page the buffers in, create the context
    barrier.wait(timeout=WAIT_S)
    copies, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if device == "cuda":
            with torch.cuda.stream(h2d):
                dst.copy_(src, non_blocking=True)
            if duplex:
                with torch.cuda.stream(d2h):
                    ret.copy_(back, non_blocking=True)
            torch.cuda.synchronize()
        else:
            dst.copy_(src)
            if duplex:
                ret.copy_(back)
        copies += 1
    elapsed = time.perf_counter() - t0
    results.put((gpu, copies * n / elapsed / 1e9))


def update_rate(params: int, threads: int, seconds: float, barrier) -> float:
    """Gparam/s of megatrain's host update (AdamW, then the bf16 refresh) on one fp32 tile for `seconds`."""
    torch.set_num_threads(threads)
    p, g, m, v = (torch.randn(params) for _ in range(4))  # (params,) fp32 each
    v.abs_()
    stream_copy = torch.empty(params, dtype=torch.bfloat16)
    cfg = AdamWConfig(lr=1e-4, weight_decay=0.1)
    adamw_update(p, g, m, v, 1, params, 1e-4, cfg)  # warm-up
    if barrier is not None:
        barrier.wait(timeout=WAIT_S)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        adamw_update(p, g, m, v, steps + 2, params, 1e-4, cfg)
        stream_copy.copy_(p)
        steps += 1
    return steps * params / (time.perf_counter() - t0) / 1e9


def phase(a, gpus: list[int], with_update: bool) -> dict:
    """One phase: copiers on `gpus` (maybe none) and maybe the update, started together."""
    ctx = mp.get_context("spawn" if a.device == "cuda" else "fork")  # CUDA cannot be used in a forked child
    barrier = ctx.Barrier(len(gpus) + (1 if with_update else 0))
    results = ctx.Queue()
    procs = [ctx.Process(target=copier, args=(g, a.device, a.mib, a.seconds, a.duplex, barrier, results))
             for g in gpus]
    for p in procs:
        p.start()
    rate = update_rate(int(a.params), a.threads, a.seconds, barrier) if with_update else None
    copies = dict(results.get(timeout=WAIT_S + a.seconds) for _ in gpus)
    for p in procs:
        p.join(timeout=WAIT_S)
        if p.exitcode != 0:
            raise SystemExit(f"copier of GPU {gpus[procs.index(p)]} failed (exit {p.exitcode})")
    return {"GBps_by_gpu": [round(copies[g], 2) for g in gpus], "update_Gparam_s": rate and round(rate, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--mib", type=int, default=256, help="bytes per copy (MiB)")
    ap.add_argument("--params", type=float, default=100e6, help="parameters of the update's tile")
    ap.add_argument("--threads", type=int, help="update threads (default: the cores minus one per GPU)")
    ap.add_argument("--duplex", action="store_true", help="copy device -> host at the same time")
    a = ap.parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < a.gpus:
        raise SystemExit(f"--gpus {a.gpus}: this machine has {torch.cuda.device_count()} GPUs")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    a.threads = a.threads or max(1, cores - a.gpus)
    every = list(range(a.gpus))
    rows = {"GPU 0 copies alone": phase(a, [0], False), f"all {a.gpus} GPUs copy": phase(a, every, False),
            "update alone": phase(a, [], True), f"update while all {a.gpus} GPUs copy": phase(a, every, True)}
    what = "H2D (D2H at the same time)" if a.duplex else "H2D"
    print(f"{a.device}, {a.gpus} GPUs, {cores} cores, update on {a.threads} threads ({a.params:.0f}-parameter tile), "
          f"{what} {a.mib} MiB copies, {a.seconds:g} s per phase")
    print(f"| phase | {what} GB/s per GPU (median, min-max) | total GB/s | update Gparam/s |\n|---|---|---|---|")
    for name, r in rows.items():
        bw = r["GBps_by_gpu"]
        per_gpu = f"{statistics.median(bw):.1f} ({min(bw):.1f}-{max(bw):.1f})" if bw else "-"
        total = f"{sum(bw):.1f}" if bw else "-"
        rate = "-" if r["update_Gparam_s"] is None else f"{r['update_Gparam_s']:.2f}"
        print(f"| {name} | {per_gpu} | {total} | {rate} |")
    out = Path(os.environ.get("OUT") or ".") / "host_load.json"
    out.write_text(json.dumps({"device": a.device, "gpus": a.gpus, "cores": cores, "threads": a.threads,
                               "duplex": a.duplex, "mib": a.mib, "seconds": a.seconds, "phases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
