"""Data-parallel costs: collectives on the `comm` stream, and one rank's share of the host it shares.

A collective takes `latency + bytes / bus bandwidth`: a task's `bytes` are already the bus bytes of one rank,
(N-1)/N of the message for an all-gather or reduce-scatter (megatrain/ir/collectives.py), and the bus bandwidth is
read from the profile's `collectives` table by message size, or else from DEFAULTS. A reduce-scatter also pays one
more latency for the 4-byte all-reduce of the unit's squared norm that rides after it.

The simulator runs one rank's Program (the ranks are symmetric: every rank does the same copies and updates at the
same time). What the ranks share is charged to that rank:
- host memory bandwidth (`host_memory_Bps`): all ranks' copies and updates draw on one DRAM, so a rank gets 1/N;
- the CPU AdamW rate: measured on the 2xH200 host, the node's rate does not grow with ranks (one process on 30
  threads 5.52 Gparam/s, two processes on 16 cores each 2.92 + 2.92), so a rank gets the profile's rate / N;
- PCIe: each GPU has its own link (measured 55.3 GB/s each with both GPUs copying, 55.4 alone), so the copy curves
  are unchanged. A host whose GPUs share an uplink would need a profile field for it (not modelled).
"""
from __future__ import annotations

import bisect
from dataclasses import replace

from .profile import HardwareProfile

# Measured on nvidia-h200-x2 (NVLink NV18, NCCL_NVLS_ENABLE=0) with one ~198 MB bf16 buffer (issue 15): all-gather
# 236 GB/s bus bandwidth, reduce-scatter 224, all-reduce 296. The latency is an ASSUMPTION (NCCL's small-message
# latency on NVLink is ~10-30 us); `megatrain profile` does not measure collectives yet.
DEFAULTS = {
    "G": {"latency_s": 20e-6, "sizes": [198e6], "bus_Bps": [236e9]},
    "Z": {"latency_s": 20e-6, "sizes": [396e6], "bus_Bps": [224e9]},
    "A": {"latency_s": 20e-6, "sizes": [198e6], "bus_Bps": [296e9]},
}


def table(profile: HardwareProfile, kind: str) -> dict:
    return profile.collectives.get(kind) or DEFAULTS[kind]


def bus_Bps(profile: HardwareProfile, kind: str, nbytes: float) -> float:
    """Bus bandwidth of a collective at a message size: linear between measured sizes, flat outside them."""
    t = table(profile, kind)
    sizes, rates = t["sizes"], t["bus_Bps"]
    i = bisect.bisect_left(sizes, nbytes)
    if i == 0:
        return rates[0]
    if i >= len(sizes):
        return rates[-1]
    f = (nbytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
    return rates[i - 1] + f * (rates[i] - rates[i - 1])


def collective_s(profile: HardwareProfile, kind: str, nbytes: int) -> float:
    """Seconds of a G or Z task moving `nbytes` bus bytes (a Z also all-reduces the unit's norm)."""
    t = table(profile, kind)
    extra = table(profile, "A")["latency_s"] if kind == "Z" else 0.0
    return t["latency_s"] + extra + (nbytes / bus_Bps(profile, kind, nbytes) if nbytes else 0.0)


def rank_share(profile: HardwareProfile, world: int) -> HardwareProfile:
    """The profile one of `world` ranks sees on a shared host (module docstring)."""
    if world <= 1:
        return profile
    rates = {t: r / world for t, r in profile.cpu_adam_params_per_s.items()}
    notes = dict(profile.notes, data_parallel=f"one of {world} ranks: host memory bandwidth and CPU AdamW rate / "
                 f"{world} (shared by the ranks), PCIe per GPU unchanged (sim/collectives.py)")
    return replace(profile, host_memory_Bps=profile.host_memory_Bps / world, cpu_adam_params_per_s=rates,
                   notes=notes)
