"""Collectives between data-parallel ranks, measured for the simulator's `collectives` table (sim/collectives.py).

Run by every rank of a torchrun launch (`megatrain profile --collectives-only`, or a full profile under torchrun)
on the world's device group (NCCL on CUDA, gloo on the CPU backend), with the calls the runtime issues
(megatrain/parallel/work.py), in place:

    G  all-gather        all_gather_into_tensor(slot, slot[my slice])   (gloo: all_gather into the slot's slices)
    Z  reduce-scatter    reduce_scatter_tensor(slot[my slice], slot)     (gloo: all_reduce of the slot, as the
                                                                          runtime does there: same sums, more bytes)
    A  all-reduce        all_reduce(buffer)

G in the weight wire's dtype (what the runtime gathers: bf16 by default), Z and A in fp32 (the slot's gradients and
the units' squared norms are fp32). Each kind is timed at message sizes S (the whole buffer: the gathered slot, the
slot reduce-scattered, the all-reduced buffer) and at one element per rank (its latency). Per size: warm-up calls, then
ROUNDS rounds of: a barrier, one more call that lines the ranks up, `iters` calls back to back and a device
synchronisation; a round's time is the mean per call, the maximum over the ranks (a collective is as slow as its
slowest rank), and the fastest round is kept.

Bandwidths as nccl-tests define them (NVIDIA/nccl-tests, doc/PERFORMANCE.md, "Bus bandwidth"): algbw = S / t;
busbw = algbw x (n-1)/n for all-gather and reduce-scatter (S the total array, n x the per-rank count), and
algbw x 2(n-1)/n for all-reduce. They are what `megatrain profile` prints (comparable with nccl-tests' busbw).

The simulator prices a collective as `latency_s + bytes / bus_Bps(bytes)` with `bytes` the task's bus bytes (one
rank's (n-1)/n of the message: ir/collectives.py), the rate interpolated in the table by those bytes. So the table
(`table()`) is keyed by bus bytes = busbw x t, and its rate is taken net of the latency,
bus_Bps = bus bytes / (t - latency_s): fed back through `collective_s` it gives the measured t at every measured
size. (nccl-tests' busbw counts the latency in t: the two differ by latency / t, ~5% at 198 MB on NVLink if the
latency is 20 us.)

The collectives also slow the compute beside them: NCCL's kernels take SMs and device memory bandwidth (on two
H200s a layer's forward ran 2.5% longer with a collective over part of it, docs/multigpu.md).
`measure_compute_beside` times a layer-sized matmul alone and while G, then Z, run back to back beside it; the
ratio is the profile's `compute_beside_collective`, which the simulator applies to every F, R, B while that
collective is in flight (sim/hostmem.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from megatrain.ir.tasks import SCHEDULED_COLLECTIVES, Collective
from megatrain.sim.profile import HardwareProfile
from megatrain.parallel.world import World
from megatrain.units import KiB, MiB, format_bytes
import os

KINDS = {c.value: c.label for c in Collective}  # the operations measured, by letter (ir/tasks.py `Collective`)
GPU_SIZES = [MiB * 4**i for i in range(6)]  # 1 MiB .. 1 GiB: a bench-3b layer is 198 MB bf16 / 396 MB fp32
CPU_SIZES = [64 * KiB * 4**i for i in range(4)]  # 64 KiB .. 4 MiB: gloo on CI
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ROUNDS = 3  # timed rounds per size; the fastest is kept
MAX_LATENCY_SHARE = 0.5  # the latency is at most this share of the smallest size's time (every rate stays finite)


def bus_factor(kind: str, world: int) -> float:
    """nccl-tests' busbw / algbw (module docstring)."""
    return Collective(kind).bus_factor * (world - 1) / world


def kind_dtypes(weight_wire: str) -> dict[str, str]:
    """The dtype each kind moves in the runtime: G the weight wire, Z and A fp32 (module docstring)."""
    return {c.value: weight_wire if c.dtype == "weight_wire" else c.dtype for c in Collective}


def measure_collectives(world, device: torch.device, weight_wire: str = "bf16", sizes: list[int] | None = None,
                        warmup: int = 5, iters: int = 20, log=None) -> dict:
    """Time G, Z and A on `world`'s device group (every rank calls this with the same arguments). Returns the
    record `table()` and `note()` read: world size, backend, per kind its dtype, message bytes, seconds per call
    (max over ranks), latency probe seconds, nccl-tests algbw and busbw."""
    if not world.distributed:
        raise ValueError("measuring collectives needs several ranks (a torchrun launch)")
    n, group = world.size, world.device_group
    nccl = dist.get_backend(group) == "nccl"
    sizes = sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtypes = kind_dtypes(weight_wire)
    big = max(sizes) + 16 * n  # one buffer for every call (bytes), room for rounding up to n elements
    buf = torch.zeros(big, dtype=torch.uint8, device=device)
    rec = {"world": n, "backend": dist.get_backend(group), "device": str(device), "warmup": warmup, "iters": iters,
           "kinds": {}}
    for kind, name in KINDS.items():
        dtype = DTYPES[dtypes[kind]]
        item = torch.finfo(dtype).bits // 8
        probe_bytes = item if kind == Collective.ALL_REDUCE else n * item  # the one-element norm all-reduce of a Z
        probe = _time(_call(kind, buf, probe_bytes, n, world.rank, group, nccl, dtype), world, sync,
                      warmup, 5 * iters)
        msgs, times = [], []
        for size in sizes:
            nbytes = -(-size // (n * item)) * n * item  # whole elements, equal slices
            msgs.append(nbytes)
            times.append(_time(_call(kind, buf, nbytes, n, world.rank, group, nccl, dtype), world, sync,
                               warmup, iters))
        algbw = [s / t for s, t in zip(msgs, times)]
        rec["kinds"][kind] = {"name": name, "dtype": dtypes[kind], "message_bytes": msgs, "time_s": times,
                              "probe_bytes": probe_bytes, "probe_s": probe, "algbw_Bps": algbw,
                              "busbw_Bps": [a * bus_factor(kind, n) for a in algbw]}
        if log:
            log(f"{name} ({dtypes[kind]}): "
                + ", ".join(f"{format_bytes(s, 'g')} {t * 1e3:.3f} ms" for s, t in zip(msgs, times))
                + f"; latency probe {probe * 1e6:.1f} us")
    del buf
    if device.type == "cuda":
        torch.cuda.empty_cache()  # a full profile measures the rest of this GPU next
    return rec


BESIDE_MESSAGE = 256 * MiB  # the largest measured message up to this size runs beside the matmul (a layer's slot)
GPU_GEMM = (8192, 3072, 8192)  # m, k, n: a bench-3b layer's MLP matmul at 4 x 2048 tokens (bf16, 412 GFLOP)
CPU_GEMM = (128, 128, 128)  # gloo on CI (fp32)


def measure_compute_beside(world, device: torch.device, rec: dict, reps: int, rounds: int = ROUNDS,
                           log=None) -> dict:
    """A layer-sized matmul's time alone and while each collective a step schedules (G, Z) runs back to back
    beside it, as the runtime overlaps them (every rank calls this with the same arguments; `rec` is
    `measure_collectives`' record, whose times size the collectives to outlast the matmuls).

    Per round: `reps` matmuls alone, then the same with enough collectives issued first (async) to run over all
    of them; the matmuls' span is timed on their own stream (CUDA events; the wall clock on the CPU backend, where
    gloo runs the collectives on its own threads). A rank's factor is the median over rounds of with / alone; the
    profile's `compute_beside_collective[op]` is the largest over the ranks (a step is as slow as its slowest
    rank), at least 1. Returns {"gemm", "dtype", "reps", "message_bytes": {op: bytes}, "alone_s", "with_s": {op: s},
    "factor": {op: f}} (times of rank 0, factors max over the ranks)."""
    n, group, cuda = world.size, world.device_group, device.type == "cuda"
    nccl = dist.get_backend(group) == "nccl"
    m, k, nn = GPU_GEMM if cuda else CPU_GEMM
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(shape, generator=gen).to(device, dtype) for shape in ((m, k), (k, nn)))  # (m, k), (k, n)
    c = torch.empty(m, nn, dtype=dtype, device=device)  # (m, n)

    def span(before=None) -> float:
        """Seconds of `reps` matmuls on this rank's stream, with `before()` issued first (its works returned)."""
        dist.barrier(group=world.host_group)
        if cuda:
            torch.cuda.synchronize(device)
        works = before() if before else []
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        if cuda:
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            dt = time.perf_counter() - t0
        for w in works:
            w.wait()
        if cuda:
            torch.cuda.synchronize(device)
        return dt

    span()  # warm-up: kernel selection, the barrier's first use
    out = {"gemm": [m, k, nn], "dtype": str(dtype).removeprefix("torch."), "reps": reps, "message_bytes": {},
           "alone_s": 0.0, "with_s": {}, "factor": {}}
    big = max(max(rec["kinds"][op]["message_bytes"]) for op in SCHEDULED_COLLECTIVES) + 16 * n
    buf = torch.zeros(big, dtype=torch.uint8, device=device)
    alone = [span() for _ in range(rounds)]
    out["alone_s"] = sorted(alone)[len(alone) // 2]
    # every rank must issue the same number of collectives (or they wait on each other forever): the longest span
    longest = torch.tensor([max(alone)], dtype=torch.float64)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=world.host_group)
    for op in SCHEDULED_COLLECTIVES:
        kr = rec["kinds"][op]
        fits = [i for i, s in enumerate(kr["message_bytes"]) if s <= BESIDE_MESSAGE] or [0]
        nbytes, t_call = kr["message_bytes"][fits[-1]], kr["time_s"][fits[-1]]
        count = min(200, math.ceil(1.5 * float(longest) / t_call) + 1)  # outlasts the matmuls, the same on every rank
        call = _call(op, buf, nbytes, n, world.rank, group, nccl, DTYPES[kr["dtype"]], async_op=True)
        ratios, withs = [], []
        for i in range(rounds):
            withs.append(span(lambda: [call() for _ in range(count)]))
            ratios.append(withs[-1] / alone[i])
        mine = torch.tensor([sorted(ratios)[len(ratios) // 2]], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=world.host_group)
        out["message_bytes"][op], out["with_s"][op] = nbytes, sorted(withs)[len(withs) // 2]
        out["factor"][op] = float(mine)
        if log:
            log(f"{KINDS[op]} beside a {m}x{k}x{nn} {out['dtype']} matmul ({format_bytes(nbytes, 'g')} messages): "
                f"the matmuls x{out['factor'][op]:.3f} (alone {out['alone_s'] * 1e3:.3f} ms for {reps})")
    del buf
    return out


def measure_launch(device: str, weight_wire: str, timeout_s: float, quick: bool = False,
                   log=print) -> tuple[int, dict]:
    """Every rank of a torchrun launch: join the world (`World.from_env`), measure the collectives, leave it
    (`World.close`). Returns (rank, record); only rank 0 logs. The rank's core pinning (World.from_env) is undone
    afterwards, so that rank 0 measures the rest of a profile on all the cores, as one process would."""

    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    world = World.from_env("cuda" if device == "cuda" else "cpu", timeout_s)
    try:
        dev = torch.device("cuda", world.local_rank) if device == "cuda" else torch.device("cpu")
        say = log if world.rank == 0 else None
        if say:
            say(f"measuring collectives over {world.size} ranks ({dist.get_backend(world.device_group)})")
        on_gpu = dev.type == "cuda"
        warmup, iters = ((2, 10) if quick else (5, 20)) if on_gpu else (2, 5)
        rec = measure_collectives(world, dev, weight_wire, warmup=warmup, iters=iters, log=say)
        try:  # the collectives' table stands without it: a failure here is said, and leaves the factor out
            rec["compute_beside"] = measure_compute_beside(world, dev, rec, reps=(10 if quick else 20) if on_gpu
                                                           else 20, log=say)
        except (RuntimeError, ValueError) as e:
            rec["compute_beside_error"] = f"{type(e).__name__}: {e}"
            if say:
                say(f"compute beside collectives NOT measured ({rec['compute_beside_error']}): the profile leaves "
                    "compute_beside_collective empty, so the simulator does not slow compute beside collectives")
        world.close()  # every rank done before any tears its groups down; the liveness thread joined
    finally:
        world.leave()  # a failed measurement: leave without waiting for the peers (after close: nothing left to do)
        if cores is not None:
            os.sched_setaffinity(0, cores)
    return world.rank, rec


def _call(kind: str, buf: torch.Tensor, nbytes: int, n: int, rank: int, group, nccl: bool, dtype,
          async_op: bool = False):
    """One collective of `kind` on the first `nbytes` of `buf`, as the runtime issues it (dist/work.py); with
    `async_op` the call returns its Work (to wait on) instead of None."""
    whole = buf[:nbytes].view(dtype)  # (n * s,)
    s = whole.numel() // n
    mine = whole[rank * s:(rank + 1) * s]
    if kind == Collective.ALL_GATHER:
        if nccl:
            return lambda: dist.all_gather_into_tensor(whole, mine, group=group, async_op=async_op)
        return lambda: dist.all_gather(list(whole.split(s)), mine.clone(), group=group, async_op=async_op)
    if kind == Collective.REDUCE_SCATTER and nccl:
        return lambda: dist.reduce_scatter_tensor(mine, whole, group=group, async_op=async_op)
    # all-reduce; a reduce-scatter on gloo (no reduce-scatter there)
    return lambda: dist.all_reduce(whole, group=group, async_op=async_op)


def _time(call, world, sync, warmup: int, iters: int, rounds: int = ROUNDS) -> float:
    """Seconds per call: warm up; per round, line the ranks up and time `iters` calls back to back, the round's
    time being the max over the ranks; the fastest round (a round that a busy host preempted is discarded)."""
    for _ in range(warmup):
        call()
    sync()
    best = float("inf")
    for _ in range(rounds):
        dist.barrier(group=world.host_group)
        call()  # completes on every rank only once all have arrived: the ranks leave it together
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=world.host_group)
        best = min(best, float(dt))
    return best


def table(rec: dict) -> dict[str, dict]:
    """The profile's `collectives` field from `measure_collectives`' record: per kind `latency_s` (the one-element
    probe, at most MAX_LATENCY_SHARE of the smallest size's time), `sizes` (bus bytes = busbw x t, the key the
    simulator looks up) and `bus_Bps` (bus bytes / (t - latency)). See the module docstring."""
    out = {}
    for kind, k in rec["kinds"].items():
        lat = min(k["probe_s"], MAX_LATENCY_SHARE * min(k["time_s"]))
        bus = [s * bus_factor(kind, rec["world"]) for s in k["message_bytes"]]  # = busbw x t
        out[kind] = {"latency_s": lat, "sizes": bus, "bus_Bps": [b / (t - lat) for b, t in zip(bus, k["time_s"])]}
    return out


def with_collectives(profile: HardwareProfile, rec: dict) -> HardwareProfile:
    """`profile` with the measured `collectives` table and its note, and `compute_beside_collective` where the
    record measured it (each factor at least 1: a collective never speeds the matmuls up; below 1 is noise)."""
    notes = dict(profile.notes, collectives=note(rec))
    beside = rec.get("compute_beside")
    if not beside:
        return replace(profile, collectives=table(rec), notes=notes)
    notes["compute_beside_collective"] = beside_note(beside)
    return replace(profile, collectives=table(rec), notes=notes,
                   compute_beside_collective={op: max(1.0, f) for op, f in beside["factor"].items()})


def beside_note(beside: dict) -> str:
    """The profile note of `compute_beside_collective`: what was measured (measure_compute_beside)."""
    m, k, n = beside["gemm"]
    each = "; ".join(f"{KINDS[op]} ({format_bytes(beside['message_bytes'][op], 'g')} messages back to back) "
                     f"x{f:.3f}" for op, f in beside["factor"].items())
    return (f"measured (profiling/collectives.py, measure_compute_beside): {beside['reps']} {m}x{k}x{n} "
            f"{beside['dtype']} matmuls, {beside['alone_s'] * 1e3:.3f} ms alone on rank 0, and beside each "
            f"collective: {each} (median of {ROUNDS} rounds per rank, the largest over the ranks; applied as at "
            f"least 1 to every F, R, B while that collective is in flight)")


def note(rec: dict) -> str:
    """The profile note of the `collectives` field: what was measured, and the nccl-tests bus bandwidths."""
    kinds = "; ".join(
        f"{KINDS[kind]} ({k['dtype']}) busbw " + ", ".join(f"{b / 1e9:.1f}" for b in k["busbw_Bps"])
        + f" GB/s, latency probe {k['probe_s'] * 1e6:.1f} us" for kind, k in rec["kinds"].items())
    sizes = next(iter(rec["kinds"].values()))["message_bytes"]
    return (f"measured (profiling/collectives.py): {rec['world']} ranks, {rec['backend']}, on {rec['device']}, "
            f"messages {format_bytes(sizes[0], 'g')} .. {format_bytes(sizes[-1], 'g')} (x4), in place as the runtime "
            "issues them, mean of "
            f"{rec['iters']} calls after {rec['warmup']} warm-up, max over the ranks, fastest of {ROUNDS} rounds; "
            f"{kinds} (nccl-tests' busbw at the sizes; the table's rates are net of the latency and keyed by bus "
            "bytes)"
            + ("; gloo: Z timed as the runtime's all-reduce of the slot" if rec["backend"] == "gloo" else "") + ".")


def report(rec: dict) -> str:
    """The measured collectives as a table (what `megatrain profile` prints)."""
    lines = [f"collectives over {rec['world']} ranks ({rec['backend']}, {rec['device']}):",
             f"  {'kind':<15} {'dtype':<5} {'message':>10} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for kind, k in rec["kinds"].items():
        for s, t, a, b in zip(k["message_bytes"], k["time_s"], k["algbw_Bps"], k["busbw_Bps"]):
            lines.append(f"  {KINDS[kind]:<15} {k['dtype']:<5} {format_bytes(s, 'g'):>10} {t * 1e3:>9.3f} "
                         f"{a / 1e9:>11.2f} {b / 1e9:>11.2f}")
        lines.append(f"  {KINDS[kind]:<15} {k['dtype']:<5} {'latency':>10} {k['probe_s'] * 1e3:>9.4f}")
    if rec.get("compute_beside"):
        lines.append("  " + beside_note(rec["compute_beside"]).split(": ", 1)[1])
    return "\n".join(lines)

