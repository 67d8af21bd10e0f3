"""Copy bandwidth between host and device, by size and direction, alone and with both directions at once.

Two kinds of measurement: a sweep of sizes on buffers of its own (`measure_curve`, `measure_duplex`), and the
runtime's own copies at its operating point (`measure_pair`: the unit sizes, from the host store's pinned tiles;
profiling/operating.py), whose points `with_point` puts into the swept curves.

The buffers are the runtime's kind: host memory from `Backend.host_region` page-locked with `Backend.pin` (the
host store's cudaHostRegister, not torch's caching host allocator) and device memory from `Backend.empty`; each
direction is issued from its own stream's thread ("h2d", "d2h"). On the CPU backend both ends are host memory and a
copy is a memcpy, exactly what its PREFETCH / OFFLOAD do.

A copy of n bytes is modelled as `latency + n / rate(n)` (sim/profile.py `CopyCurve`): the latency is the time
of the smallest copy, and each size's rate is n / (time - latency), so the latency is not counted twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.exec.backend import Backend
from megatrain.sim.profile import CopyCurve
from megatrain.profiling.bench import Background, Worker, median
from megatrain.units import KiB, MiB



def copy_sizes(max_bytes: int, quick: bool) -> list[int]:
    """4 KiB, 16 KiB, ... (x4; x16 with `quick`) up to `max_bytes`, which is always included."""
    step = 16 if quick else 4
    sizes, n = [], 4 * KiB
    while n < max_bytes:
        sizes.append(n)
        n *= step
    return sizes + [max_bytes]


@dataclass
class CopyBuffers:
    """A pinned host buffer and a device buffer of `nbytes` each (uint8)."""

    host: torch.Tensor
    device: torch.Tensor

    @classmethod
    def allocate(cls, backend: Backend, nbytes: int) -> CopyBuffers:
        host = backend.host_region(nbytes)
        host.fill_(1)  # touch every page, as the store's tiles are touched when loaded
        if backend.pins_host_memory:
            backend.pin(host)
        device = backend.empty(nbytes)
        device.fill_(2)
        return cls(host, device)

    def release(self, backend: Backend) -> None:
        if backend.pins_host_memory:
            backend.unpin(self.host)

    def copier(self, direction: str, nbytes: int):
        """A callable that performs one copy of `nbytes` in `direction` on the current stream."""
        h, d = self.host[:nbytes], self.device[:nbytes]
        if direction == "h2d":
            return lambda: d.copy_(h, non_blocking=True)
        return lambda: h.copy_(d, non_blocking=True)


def _reps_for(nbytes: int, quick: bool) -> int:
    # Enough calls that small copies are timed over ~2 ms of work and large ones a few times.
    return max(3 if quick else 5, min(40, (64 * MiB) // max(nbytes, 1)))


def measure_curve(bufs: CopyBuffers, worker: Worker, direction: str, sizes: list[int], quick: bool) -> dict:
    """Median seconds of a copy of each size in one direction, and the CopyCurve they give."""
    times = []
    for n in sizes:
        times.append(median(worker.time(bufs.copier(direction, n), _reps_for(n, quick), warmup=2)))
    return {"sizes_bytes": list(sizes), "time_s": times, "curve": fit_curve(sizes, times)}


def fit_curve(sizes: list[int], times: list[float]) -> CopyCurve:
    """latency = the smallest copy's time; rate(n) = n / (t(n) - latency) where the copy time clearly exceeds the
    latency (t > 2 x latency); smaller sizes take the rate of the smallest size that does (their time is almost all
    latency, so the rate is both unmeasurable and unimportant)."""
    latency = max(0.0, min(times))
    rates: list[float | None] = [n / (t - latency) if t > 2 * latency and t > latency else None
                                 for n, t in zip(sizes, times)]
    if all(r is None for r in rates):  # everything is latency: the link is as fast as we can measure
        rates = [sizes[-1] / max(times[-1], 1e-9)] * len(sizes)
    first = next(r for r in rates if r is not None)
    filled, last = [], first
    for r in rates:
        last = r if r is not None else last
        filled.append(last)
    return CopyCurve(tuple(sizes), tuple(filled), latency)


def measure_duplex(bufs_a: CopyBuffers, bufs_b: CopyBuffers, h2d: Worker, d2h: Worker, nbytes: int,
                   quick: bool) -> dict:
    """Bandwidth of each direction while the other one is busy the whole time; duplex_Bps is their sum.

    Each direction is timed while the opposite direction copies in a loop (its own buffers), so the timed copies
    always share the link (no tail where one runs alone, which would overstate the shared rate)."""
    reps = 3 if quick else 6
    out = {}
    for name, timed, other, other_dir in (("h2d", h2d, d2h, "d2h"), ("d2h", d2h, h2d, "h2d")):
        with Background(other, bufs_b.copier(other_dir, nbytes)):
            t = median(timed.time(bufs_a.copier(name, nbytes), reps, warmup=1))
        out[f"{name}_shared_Bps"] = nbytes / t
    out["duplex_Bps"] = out["h2d_shared_Bps"] + out["d2h_shared_Bps"]
    out["bytes"] = nbytes
    return out


def measure_pair(h2d: Worker, d2h: Worker, copy_in, copy_out, in_bytes: int, out_bytes: int, quick: bool) -> dict:
    """The runtime's two copies (`copy_in`: `in_bytes` host -> device, `copy_out`: `out_bytes` device -> host, each
    a callable on its own worker's stream): seconds of each alone, and of each while the other one copies in a loop
    (the runtime overlaps a PREFETCH with an OFFLOAD); their bytes/s alone and shared, and the shared sum."""
    reps = 3 if quick else 6
    out: dict = {"h2d_bytes": in_bytes, "d2h_bytes": out_bytes}
    out["h2d_alone_s"] = median(h2d.time(copy_in, reps, warmup=1))
    out["d2h_alone_s"] = median(d2h.time(copy_out, reps, warmup=1))
    with Background(d2h, copy_out):
        out["h2d_shared_s"] = median(h2d.time(copy_in, reps, warmup=1))
    with Background(h2d, copy_in):
        out["d2h_shared_s"] = median(d2h.time(copy_out, reps, warmup=1))
    for d, n in (("h2d", in_bytes), ("d2h", out_bytes)):
        out[f"{d}_alone_Bps"] = n / out[f"{d}_alone_s"]
        out[f"{d}_shared_Bps"] = n / out[f"{d}_shared_s"]
    out["duplex_Bps"] = out["h2d_shared_Bps"] + out["d2h_shared_Bps"]
    return out


def with_point(curve: CopyCurve, nbytes: int, time_s: float) -> CopyCurve:
    """`curve` with the copy of `nbytes` measured at `time_s` as one of its points (replacing a point of that size),
    so the simulator's duration at the runtime's copy size is the time measured there. The latency stays; a copy
    that is mostly latency (time <= 2 x latency, as `fit_curve` rules) leaves the curve as it is."""
    if not time_s > 2 * curve.latency_s:
        return curve
    rate = nbytes / (time_s - curve.latency_s)
    points = dict(zip(curve.sizes_bytes, curve.Bps))
    points[int(nbytes)] = rate
    sizes = sorted(points)
    return CopyCurve(tuple(sizes), tuple(points[n] for n in sizes), curve.latency_s)
