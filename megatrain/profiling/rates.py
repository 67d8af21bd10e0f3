"""Rates of the machine: matmul FLOP/s, device memory bandwidth, AdamW params/s (host threads and device), the
global-norm task, and how much a CPU update slows compute down when both run at once.

The optimizer is the executor's: `exec.optim.adamw_update` (torch's fused AdamW kernel) on flat fp32 tiles the size
of one layer, and on the host followed by the bf16 streaming-copy refresh the runtime does after every CPU update
(`HostStore.refresh_stream`). A task of n parameters is modelled as `overhead + n / rate`; the fixed part (Python,
two kernel calls, the step tensors) matters for small units, so the host rate and its fixed cost are fitted over
three tile sizes.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from megatrain.exec.backend import Backend, ExecError
from megatrain.exec.optim import AdamWConfig, adamw_undo, adamw_update
from megatrain.profiling import bench
from megatrain.profiling.bench import Background, Worker, median
import threading

_CFG = AdamWConfig(lr=1e-4, weight_decay=0.1)


class AdamTiles:
    """master, grad, m, v (fp32) of `n` parameters on `device`, plus the bf16 streaming copy on the host."""

    def __init__(self, n: int, device: torch.device, streaming_copy: bool):
        # Constant fills: fast for layer-sized tiles, and the kernel's speed does not depend on the values (none of
        # them is denormal).
        self.n = n
        self.p = torch.full((n,), 0.02, device=device)
        self.g = torch.full((n,), 1e-3, device=device)
        self.m = torch.zeros(n, device=device)
        self.v = torch.full((n,), 1e-6, device=device)
        self.copy = torch.empty(n, dtype=torch.bfloat16) if streaming_copy else None
        self.step = 0

    def update(self, n: int | None = None) -> None:
        """One update of the first n parameters, as the runtime's CPU (or GPU) optimizer task does it."""
        n = n or self.n
        self.step += 1
        adamw_update(self.p[:n], self.g[:n], self.m[:n], self.v[:n], self.step, n - n // 100, 1e-4, _CFG,
                     clip_coef=0.5)
        if self.copy is not None:
            self.copy[:n].copy_(self.p[:n])  # refresh_stream: master -> bf16 streaming copy

    def redo(self, chunk: int | None = None) -> None:
        """Speculative clipping's CLIP_REDO of a unit on the device, as `Updates._redo` does it: undo the step's
        unclipped update (`adamw_undo`, several element-wise passes of `chunk` elements, by default the executor's),
        then update again with the coefficient."""
        step = max(1, self.step)  # the undo divides by the bias correction of a step >= 1
        adamw_undo(self.p, self.g, self.m, self.v, step, self.n - self.n // 100, 1e-4, _CFG, chunk=chunk)
        adamw_update(self.p, self.g, self.m, self.v, step, self.n - self.n // 100, 1e-4, _CFG, clip_coef=0.5)


def fit_fixed_and_rate(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Least-squares line t = a + n / rate through (n, t); a clamped to >= 0. Returns (a_s, rate)."""
    k = len(sizes)
    mx, my = sum(sizes) / k, sum(times) / k
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx if sxx else 0.0
    if slope <= 0:  # all fixed cost (or noise): the largest tile's average rate
        return 0.0, sizes[-1] / times[-1]
    a = max(0.0, my - slope * mx)
    return a, 1.0 / slope


def thread_counts(runtime_threads: int, cores: int, quick: bool) -> list[int]:
    """1, 2, 4, ... up to the cores, and the runtime's count; with `quick` only the runtime's."""
    if quick:
        return [runtime_threads]
    out, t = [], 1
    while t < max(cores, runtime_threads):
        out.append(t)
        t *= 2
    return sorted(set(out + [runtime_threads, max(cores, runtime_threads)]))


def measure_cpu_adam(worker: Worker, n: int, runtime_threads: int, cores: int, streaming_copy: bool,
                     quick: bool, budget_s: float) -> dict:
    """CPU AdamW params/s by thread count, and the fixed cost per update at the runtime's thread count."""
    tiles = AdamTiles(n, torch.device("cpu"), streaming_copy)
    # The runtime's count first: its fit gives the fixed cost that the other counts' rates are corrected by.
    counts = sorted(thread_counts(runtime_threads, cores, quick), key=lambda t: (t != runtime_threads, t))
    before = torch.get_num_threads()
    per = budget_s / (len(counts) + 2)
    out: dict = {"params": n, "by_threads": {}}
    try:
        for t in counts:
            # In the worker's own thread: a thread fixes its OpenMP team size at its first parallel op, so a
            # set_num_threads from another thread would not reach it (the trainer sets it before its threads exist).
            worker.call(torch.set_num_threads, t)
            if t == runtime_threads:
                sizes = sorted({max(1, n // 16), max(1, n // 4), n})
                times = [median(worker.time_for(lambda k=k: tiles.update(k), per / 2, warmup=1)) for k in sizes]
                fixed, rate = fit_fixed_and_rate(sizes, times)
                out.update(fixed_s=fixed, rate=rate, fit_sizes=sizes, fit_times_s=times)
                out["by_threads"][t] = rate
            else:
                tt = median(worker.time_for(tiles.update, per, warmup=1))
                out["by_threads"][t] = n / max(tt - out.get("fixed_s", 0.0), tt / 2)
    finally:
        worker.call(torch.set_num_threads, before)
    out["by_threads"] = dict(sorted(out["by_threads"].items()))
    return out


def measure_refresh(worker: Worker, n: int, runtime_threads: int, budget_s: float) -> dict:
    """The bf16 streaming-copy refresh after a CPU update (`HostStore.refresh_stream`: fp32 master -> bf16 copy)
    in params/s at the runtime's thread count. Measured apart from AdamW because only schedules with
    weight_wire="bf16" pay it (the simulator adds it per program)."""
    src = torch.full((n,), 0.02)
    dst = torch.empty(n, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        worker.call(torch.set_num_threads, runtime_threads)
        t = median(worker.time_for(lambda: dst.copy_(src), budget_s, warmup=1))
    finally:
        worker.call(torch.set_num_threads, before)
    return {"params": n, "rate": n / t}


def measure_gpu_adam(worker: Worker, backend: Backend, n: int, budget_s: float) -> dict:
    """AdamW params/s on device tiles (the GPU optimizer placement; the CPU backend runs it in the compute
    thread on host memory), without a streaming-copy refresh (STATE_OFFLOAD writes that); and the clipping redo
    (undo + update) on the same tiles, in updates."""
    tiles = worker.call(AdamTiles, n, backend.device, False)
    t = median(worker.time_for(tiles.update, budget_s * 2 / 3, warmup=1))
    # the redo of speculative clipping on a device unit, in updates of that unit (the profile's clip_redo_updates)
    redo = median(worker.time_for(tiles.redo, budget_s / 3, warmup=1))
    return {"params": n, "time_s": t, "rate": n / t, "redo_s": redo, "redo_updates": redo / t}


def measure_matmul(worker: Worker, backend: Backend, dtype: torch.dtype, n: int, budget_s: float) -> float:
    """FLOP/s of an (n x n) @ (n x n) matmul in `dtype`: the analytic fallback's peak."""
    a, b = (worker.call(lambda: torch.randn(n, n, device=backend.device).to(dtype)) for _ in range(2))
    t = median(worker.time_for(lambda: a @ b, budget_s, warmup=2))
    return 2.0 * n**3 / t


def measure_memory(worker: Worker, backend: Backend, nbytes: int, budget_s: float) -> float:
    """Device memory bytes/s (read + write) of a device-to-device copy: prices the embedding's gather/scatter
    when no table does."""
    src = backend.empty(nbytes).fill_(1)
    dst = backend.empty(nbytes)
    t = median(worker.time_for(lambda: dst.copy_(src), budget_s, warmup=2))
    return 2.0 * nbytes / t


def measure_host_wait(backend: Backend, cpu: Worker, compute: Worker, wait_s: float = 0.02, reps: int = 5) -> float:
    """How late a host-stream task notices that a device task it waits for has finished (the runtime polls CUDA
    events with a growing back-off, exec/backend.py `host_wait`). 0 on the CPU backend, where host events are
    immediate. Measured as the host's wake-up time minus the device's finish time of a timed spin kernel."""
    if not backend.device.type == "cuda":
        return 0.0

    lates = []
    for _ in range(reps):
        def launch():
            start = backend.record(compute.stream)
            torch.cuda._sleep(int(wait_s * 1.5e9))  # ~wait_s of device time (cycles at ~1.5 GHz)
            return start, backend.record(compute.stream)
        start, end = compute.call(launch)
        t_issue = time.perf_counter()
        cpu.call(backend.host_wait, end, 600.0)
        t_host = time.perf_counter() - t_issue
        lates.append(max(0.0, t_host - backend.elapsed_s(start, end)))
    return median(lates)


def measure_compute_under_update(compute: Worker, cpu: Worker, body, update, budget_s: float) -> dict:
    """A compute task alone and while the CPU optimizer runs in a loop: how much the update slows it down (host
    threads of the update take the cores the issuing threads need; on the CPU backend they share the same cores)."""
    alone = median(compute.time_for(body, budget_s / 2, warmup=1))
    with Background(cpu, update):
        shared = median(compute.time_for(body, budget_s / 2, warmup=1))
    return {"alone_s": alone, "with_update_s": shared, "factor": shared / alone}


def measure_compute_beside_copies(compute: Worker, bodies: dict, copiers: list[tuple[Worker, object]],
                                  budget_s: float, rounds: int = 3) -> dict:
    """Each compute body alone and while copies run in a loop on their streams (`copiers`: (worker, copy) pairs,
    both directions as a layer's prefetch and offload overlap its compute): {kind: {"alone_s", "beside_copies_s",
    "factor"}}, each the median of every call timed. The copies' DMA shares the device memory with the kernels (on
    the CPU backend, memcpy shares the cores and host memory).

    Alone and beside take turns over `rounds`: the effect is a few percent (fits of 1.03-1.07 to the steps of the
    recorded runs, docs/accuracy.md), the size of the device's and the host's drift over a measurement, which one
    pass of alone-then-beside would fold into it. Every call counts (not `Worker.time_for`'s least disturbed
    round): beside copies, the round the copies disturbed least would be the one kept. With that rule the profiler
    measured 1.00-1.05 where the same start's steps fitted 1.03-1.04 (H200, 2026-11-27); this one is not yet
    measured on a GPU."""
    reps = {k: max(2, int(budget_s / (2 * len(bodies) * rounds) / max(compute.time(body, 1, 1)[0], 1e-7)))
            for k, body in bodies.items()}
    alone: dict = {k: [] for k in bodies}
    beside: dict = {k: [] for k in bodies}
    for _ in range(rounds):
        for k, body in bodies.items():
            alone[k] += compute.time(body, reps[k], 1)
        with contextlib.ExitStack() as stack:
            for worker, copy in copiers:
                stack.enter_context(Background(worker, copy))
            for k, body in bodies.items():
                beside[k] += compute.time(body, reps[k], 1)
    out = {}
    for k in bodies:
        a, b = median(alone[k]), median(beside[k])
        out[k] = {"alone_s": a, "beside_copies_s": b, "factor": b / a, "calls": len(alone[k]) + len(beside[k])}
    return out


def measure_compute_sustained(compute: Worker, bodies: dict, budget_s: float, block: int = 8) -> dict:
    """The layer's F and B in a step's pattern for about `budget_s`: blocks of `block` F, then `block` B (a forward
    over many layers, then their backward), every call issued back to back (`Worker.time_sequence`), so the device
    runs for seconds without idling. {kind: {"burst_s": the median of `block` calls after one warm call and a
    wait, as the compute tables time a task; "sustained_s": the median of the calls after the first cycle;
    "factor": sustained / burst; "calls"}}.

    Why: on the H200 the same compiled llama3-8b layer forward took 20.2 ms in steps whose GPU idled between layers,
    24 ms in steps that kept it busy, and 21.2 ms in the profile's table (docs/accuracy.md, "The first blind test").
    Clocks that fall under sustained load are the candidate; this measures the effect, whatever its cause."""
    burst = {k: median(compute.time(body, block, 1)) for k, body in bodies.items()}
    cycle_s = block * sum(burst.values())
    cycles = max(2, int(budget_s / max(cycle_s, 1e-9)))
    calls = [(k, bodies[k]) for _ in range(cycles) for k in bodies for _ in range(block)]
    timed = compute.time_sequence(calls)[len(bodies) * block:]  # the first cycle ramps the load up
    out = {}
    for k in bodies:
        times = [s for label, s in timed if label == k]
        sustained = median(times)
        out[k] = {"burst_s": burst[k], "sustained_s": sustained, "factor": sustained / burst[k],
                  "calls": len(times)}
    return out


def measure_update_under_compute(cpu: Worker, update, compute: Worker, body, budget_s: float) -> dict:
    """The CPU update alone and while a layer forward runs in a loop on the compute stream's thread."""
    alone = median(cpu.time_for(update, budget_s / 2, warmup=1))
    with Background(compute, body):
        shared = median(cpu.time_for(update, budget_s / 2, warmup=1))
    return {"alone_s": alone, "with_compute_s": shared, "factor": shared / alone if alone > 0 else math.nan}


def measure_fresh_thread(backend: Backend, body, threads: int = 4) -> dict:
    """The first call of `body` in a new thread against later calls there. The runtime starts new issuing threads
    for every step (exec/runtime.py), and a thread's first parallel CPU op starts its OpenMP team."""

    firsts, laters = [], []

    def run():
        backend.enter_thread()
        with torch.no_grad():
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                body()
                backend.synchronize(bench.WAIT_TIMEOUT_S)
                ts.append(time.perf_counter() - t0)
        firsts.append(ts[0])
        laters.append(min(ts[1:]))

    for _ in range(threads):
        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(bench.WAIT_TIMEOUT_S)
        if th.is_alive():
            raise ExecError(f"profile: the new-thread measurement did not finish within {bench.WAIT_TIMEOUT_S:.0f} s "
                            "(--wait-timeout)")
    return {"first_s": median(firsts), "later_s": median(laters), "extra_s": median(firsts) - median(laters)}
