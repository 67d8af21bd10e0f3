"""Data-parallel costs: collectives on the `comm` stream, and one rank's share of the host it shares.

A collective takes `latency + bytes / bus bandwidth`: a task's `bytes` are already the bus bytes of one rank,
(N-1)/N of the message for an all-gather or reduce-scatter (megatrain/compile/collectives.py), and the bus bandwidth is
read from the profile's `collectives` table by those bus bytes (profiling/collectives.py measures it so), or else
from DEFAULTS. A reduce-scatter also pays one more latency for the 4-byte all-reduce of the unit's squared norm
that rides after it.

The simulator runs one rank's Program (the ranks are symmetric: every rank does the same copies and updates at the
same time). What the ranks of one host share is charged to that rank; with `hosts` > 1 the world is hosts x G ranks,
G = world / hosts on each host, and a rank shares only with the G ranks of its own host:
- host memory bandwidth (`host_memory_Bps`): all of a host's copies and updates draw on its DRAM, so a rank gets 1/G;
- the CPU AdamW rate: measured on the 2xH200 host, the node's rate does not grow with ranks (one process on 30
  threads 5.52 Gparam/s, two processes on 16 cores each 2.92 + 2.92), so a rank gets the profile's rate / G;
- PCIe: each GPU has its own link (measured 55.3 GB/s each with both GPUs copying, 55.4 alone), so the copy curves
  are unchanged. A host whose GPUs share an uplink would need a profile field for it (not modelled).

Several hosts (`span_hosts`): every collective of the Program spans all ranks, so it crosses the network. NCCL runs
all-gather and reduce-scatter as rings, one ring per channel, and a ring moves at the speed of its slowest link;
the channels of a host leave it through its NICs, so across hosts a ring's bus bandwidth is what the host's NICs
carry together (NCCL's developers: "if we use ring, the busbw is going to reflect exactly what's going through the
NICs", NVIDIA/nccl-tests#160), G x `inter_host_Bps` (the profile's network bandwidth per GPU: one NIC per GPU on
DGX/HGX-class hosts). A collective over hosts therefore takes
    inter_host_latency_s + bus bytes / min(bus bandwidth within a host at that size, G x inter_host_Bps).
Not modelled: NCCL's tree and NVLS algorithms (used for all-reduce; not for the G and Z tasks), latency that grows
with the number of ring steps, congestion in the network fabric, NICs shared by more GPUs than the profile says.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import replace

from megatrain.ir.placement import Placement
from megatrain.ir.tasks import Collective
from megatrain.sim.profile import HardwareProfile

# Measured on nvidia-h200-x2 (NVLink NV18, NCCL_NVLS_ENABLE=0) with one ~198 MB bf16 buffer (issue 15): all-gather
# 236 GB/s bus bandwidth, reduce-scatter 224, all-reduce 296. The latency is an ASSUMPTION (NCCL's small-message
# latency on NVLink is ~10-30 us). `megatrain profile` under torchrun measures a table for the machine at hand.
# Keyed by the operation's letter (ir/tasks.py `Collective`), as a profile's `collectives` table is.
DEFAULTS = {
    Collective.ALL_GATHER.value: {"latency_s": 20e-6, "sizes": [198e6], "bus_Bps": [236e9]},
    Collective.REDUCE_SCATTER.value: {"latency_s": 20e-6, "sizes": [396e6], "bus_Bps": [224e9]},
    Collective.ALL_REDUCE.value: {"latency_s": 20e-6, "sizes": [198e6], "bus_Bps": [296e9]},
}


def table(profile: HardwareProfile, kind: Collective | str) -> dict:
    """The latency and bus bandwidth table of a collective operation (`Collective` or its letter)."""
    key = Collective(kind).value  # the letter: a str Enum hashes by its name, the profile's keys are letters
    return profile.collectives.get(key) or DEFAULTS[key]


def bus_Bps(profile: HardwareProfile, kind: Collective | str, nbytes: float) -> float:
    """Bus bandwidth of a collective at a message size: linear between measured sizes, flat outside them, and at
    most the table's `cap_Bps` where it has one (`span_hosts`)."""
    t = table(profile, kind)
    sizes, rates = t["sizes"], t["bus_Bps"]
    i = bisect.bisect_left(sizes, nbytes)
    if i == 0:
        rate = rates[0]
    elif i >= len(sizes):
        rate = rates[-1]
    else:
        f = (nbytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        rate = rates[i - 1] + f * (rates[i] - rates[i - 1])
    return min(rate, t.get("cap_Bps", math.inf))  # cap_Bps: the network, when the ranks span hosts


def collective_s(profile: HardwareProfile, kind: Collective | str, nbytes: int) -> float:
    """Seconds of a G or Z task moving `nbytes` bus bytes (a Z also all-reduces the unit's norm)."""
    t = table(profile, kind)
    rides = Collective(kind) is Collective.REDUCE_SCATTER  # the unit's squared norm, all-reduced after it
    extra = table(profile, Collective.ALL_REDUCE)["latency_s"] if rides else 0.0
    return t["latency_s"] + extra + (nbytes / bus_Bps(profile, kind, nbytes) if nbytes else 0.0)


# strategy name -> fn(profile, world, hosts) -> the profile one rank sees. A collective strategy registers its own
# (megatrain/parallel/sharded.py registers `rank_share`); sim/ never imports parallel/.
_RANK_PROFILES: dict[str, Callable[[HardwareProfile, int, int], HardwareProfile]] = {}


def register_rank_profile(strategy: str, fn: Callable[[HardwareProfile, int, int], HardwareProfile]) -> None:
    """Register how a collective strategy's rank sees its host and network (called by the strategy's module)."""
    _RANK_PROFILES[strategy] = fn


def rank_profile(profile: HardwareProfile, placement: Placement) -> HardwareProfile:
    """The profile one rank of `placement` sees (its world, hosts and strategy); one rank: `profile` itself.
    ValueError for a strategy that nobody registered."""
    if placement.world <= 1 and placement.hosts <= 1:
        return profile
    fn = _RANK_PROFILES.get(placement.strategy)
    if fn is None:
        raise ValueError(f"the Program runs {placement.world} ranks with collective strategy "
                         f"{placement.strategy!r}, whose costs are not registered; import megatrain.parallel first")
    return fn(profile, placement.world, placement.hosts)


def rank_share(profile: HardwareProfile, world: int, hosts: int = 1) -> HardwareProfile:
    """The profile one of `world` ranks sees, the ranks spread evenly over `hosts` hosts (module docstring).
    One host: the ranks share its memory bandwidth and CPU; the result is exactly that of the one-host model."""
    if hosts < 1 or world % hosts:
        raise ValueError(f"{world} ranks cannot be spread evenly over {hosts} host(s): the world size must be a "
                         "multiple of the number of hosts (give --gpus per host)")
    per_host = world // hosts
    shared = profile
    if per_host > 1:
        where = "" if hosts == 1 else f" of its host ({hosts} hosts)"
        notes = dict(profile.notes, data_parallel=f"one of {per_host} ranks{where}: host memory bandwidth and CPU "
                     f"AdamW rate / {per_host} (shared by the ranks), PCIe per GPU unchanged (sim/collectives.py)")
        shared = replace(profile.with_cpu_adam_times(1 / per_host), host_memory_Bps=profile.host_memory_Bps / per_host,
                         notes=notes)
    return shared if hosts == 1 else span_hosts(shared, per_host)


def span_hosts(profile: HardwareProfile, per_host: int) -> HardwareProfile:
    """The profile of a rank whose collectives cross hosts of `per_host` ranks each: every collective table gets
    the network's latency and is capped at the host's network bus bandwidth, per_host x `inter_host_Bps`
    (module docstring)."""
    cap = per_host * profile.inter_host_Bps
    tables = {kind: dict(table(profile, kind), latency_s=profile.inter_host_latency_s, cap_Bps=cap)
              for kind in DEFAULTS}
    notes = dict(profile.notes, multi_host=f"collectives span hosts: latency {profile.inter_host_latency_s * 1e6:g} us"
                 f", bus bandwidth at most {per_host} x {profile.inter_host_Bps / 1e9:g} GB/s = {cap / 1e9:g} GB/s "
                 "(the host's NICs; sim/collectives.py)")
    return replace(profile, collectives=tables, notes=notes)
