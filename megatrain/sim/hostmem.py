"""Host memory as a shared resource: every host-side activity is a flow of bytes, re-rated whenever one starts or ends
(and a compute task slowed beside copies is a flow of seconds that draws none: the last paragraph).

The flows of a step are the copies (one per direction at a time: each direction is one in-order stream; H2D
reads host memory, D2H writes it; offloaded checkpoints are copies too) and the CPU optimizer updates (AdamW reads
master, gradient and both moments and writes three of them back: ~28 B/param, plus 6 B/param per bf16
conversion pass). Each flow has

- a ceiling: the rate it reaches alone (a copy: its curve's rate for its size; an update: its bytes over the
  time its threads need alone, `params / cpu_adam_rate + passes x params / cpu_convert_params_per_s`);
- a draw on host memory per byte of progress (1 for an update's bytes; `copy_host_bytes_per_byte` for a copy:
  1 for DMA, 2 for the CPU backend's memcpy, which reads and writes host memory).

Rates are shared in two layers. The copies first share PCIe: when both directions together would exceed
`duplex_Bps`, both ceilings are scaled in proportion (as before this model, and as measured: the directions are
symmetric). Then every flow shares the host memory budget `host_memory_Bps` **max-min fairly** on host bytes/s
(water-filling): no flow gets more than its ceiling, and no flow can be given more without taking from one that
has no more. Why max-min and not proportional sharing: on the 1xH200 host a 13-thread update fell from 4.14 to
2.50 Gparam/s (-40%) while full-duplex copies fell only from 97.7 to 89.5 GB/s (-8%). Proportional sharing slows
every flow by the same factor (with the budget fitted to the update, the copies would lose 40% too); max-min
leaves the copies, whose ~49 GB/s per direction is below the fair share, at their rate and gives the update the
rest, which is what was measured (docs/simulator.md has the arithmetic).

Max-min alone leaves a copy below its fair share at its rate alone, but the copies measured beside the runtime's
update do slow (on the 1xH200 host h2d 53.6 -> 44.6 GB/s beside it, 35.7 with d2h as well), and the budget B is
fitted (profiling/host.py) with the copies drawing those measured rates (each weight wire's record its own; the
profile keeps the mean of the two, which differ by a few points). So while an update runs, a copy's ceiling
is its rate alone times the profile's `copy_beside_update` fraction for the mix (one direction, or both: `BESIDE`);
without it the copies are left at their rates, and the update was priced with less of the budget than the fit gave
it (issue 24: the out-of-sample predictions of the (a) quick profiles, round 0, put copies beside an update 9-28%
fast per task; docs/accuracy.md, "Copies beside the update").

Compute beside copies: a GPU compute task draws no host memory, but the copies' DMA shares the device's memory
with its kernels, and in the steps of 7 recorded shape x machine runs a layer F took 1.05x and a B 1.04-1.11x its
measured time alone when copies ran over most of it (1.00x with none; docs/accuracy.md, "Compute beside copies").
So a compute task is a flow too (`compute`): of its seconds alone, drawing nothing, progressing at
1 / `compute_beside_copy[kind]` of its rate while any copy flow is in flight, and at its full rate otherwise. The
profiler measures a layer's F and B beside copies in both directions; the one factor is applied whatever the copy
mix (one direction or both) and to the embedding and head too, which were not measured apart.

Compute beside collectives (data parallel): NCCL's kernels run on the SMs and read device memory, and on two H200s
a layer's forward ran 2.5% longer with a collective over part of it (docs/multigpu.md). With the profile's
`compute_beside_collective` a collective is a flow of its seconds too (drawing nothing, never slowed), and the
compute flow progresses at 1 / factor[the collective in flight] of its rate, times 1 / `compute_beside_copy` while a
copy is in flight as well (the two resources are taken as independent: their factors multiply).
"""
from __future__ import annotations

import math

import simpy

from megatrain.ir.streams import COPY_STREAMS
from megatrain.sim.profile import BESIDE


def share_rates(ceilings: dict[str, float], draws: dict[str, float], copies: set[str], host_Bps: float,
                duplex_Bps: float, beside_update: dict[str, float] | None = None) -> dict[str, float]:
    """Rates (progress units/s) of concurrent flows: PCIe duplex in proportion among `copies`, each copy at most
    its ceiling times its `beside_update` fraction (`BESIDE` keys) while a "cpu" flow of known bytes runs under a
    finite budget, then host memory max-min fair on host bytes/s (`draws[f]` host bytes per unit of progress of
    flow f).

    Deterministic: flows are visited in sorted order, and the result depends only on the inputs."""
    caps = dict(ceilings)
    busy = sorted(f for f in copies if f in caps)
    total = sum(caps[f] for f in busy)
    if len(busy) > 1 and total > duplex_Bps:
        for f in busy:
            caps[f] *= duplex_Bps / total
    # part of the host memory model: an unlimited budget (no contention) or an update of no known bytes leaves them
    if beside_update and "cpu" in caps and draws.get("cpu", 0.0) > 0 and not math.isinf(host_Bps):
        both = len(busy) > 1
        for f in busy:
            key = BESIDE.get((f, both))
            if key in beside_update:  # measured against each direction's rate alone (profiling/operating.py)
                caps[f] = min(caps[f], ceilings[f] * beside_update[key])
    rates: dict[str, float] = {}
    free = {f: caps[f] for f in sorted(caps) if draws.get(f, 0.0) <= 0 or math.isinf(host_Bps)}
    rates.update(free)  # flows that draw no host memory (or an unlimited budget) run at their ceiling
    active = sorted(f for f in caps if f not in free)
    left = host_Bps
    # Water-filling: raise every active flow's host draw to a common level; a flow whose ceiling is below the
    # level is frozen there and its unused share goes to the others.
    while active:
        level = left / len(active)
        capped = [f for f in active if caps[f] * draws[f] <= level]
        if not capped:
            for f in active:
                rates[f] = level / draws[f]
            break
        for f in capped:
            rates[f] = caps[f]
            left -= caps[f] * draws[f]
        active = [f for f in active if f not in capped]
    return rates


class _Flow:
    __slots__ = ("beside_collective", "beside_copy", "ceiling", "done", "draw", "op", "rate", "remaining")

    def __init__(self, amount: float, ceiling: float, draw: float, done: simpy.Event, beside_copy: float = 1.0,
                 beside_collective: dict[str, float] | None = None, op: str | None = None):
        self.remaining, self.ceiling, self.draw, self.rate, self.done = float(amount), ceiling, draw, 0.0, done
        self.beside_copy = beside_copy  # its ceiling is divided by this while a copy is in flight
        self.beside_collective = beside_collective or {}  # ... and by this one's [op] while collective op is
        self.op = op  # the collective a "comm" flow runs ("G", "Z")

    def slowed_ceiling(self, copying: bool, collective: str | None) -> float:
        """Its ceiling beside the copies (any in flight) and the collective in flight (None: none)."""
        ceiling = self.ceiling / (self.beside_copy if copying else 1.0)
        return ceiling / self.beside_collective.get(collective, 1.0) if collective else ceiling


class HostMemory:
    """The fluid model in simpy: flows in flight, re-rated (`share_rates`) whenever a flow starts or ends."""

    def __init__(self, env: simpy.Environment, host_Bps: float, duplex_Bps: float, copy_draw: float,
                 beside_update: dict[str, float] | None = None):
        self.env, self.host_Bps, self.duplex_Bps, self.copy_draw = env, host_Bps, duplex_Bps, copy_draw
        self.beside_update = dict(beside_update or {})  # the profile's copy_beside_update (module docstring)
        # "h2d", "d2h" (copies), "cpu" (a CPU update), "nvme" (its drive time), "compute" (a GPU compute task),
        # "comm" (a collective, with compute_beside_collective)
        self.flows: dict[str, _Flow] = {}
        self._t = 0.0  # time up to which `remaining` is accounted
        self._gen = 0  # bumps on every re-plan, so that stale wake-ups are ignored (simpy cannot cancel them)

    def copy(self, stream: str, nbytes: int, alone_Bps: float) -> simpy.Event:
        """Move `nbytes` on a copy stream; the returned event fires when the last byte has arrived."""
        return self._start(stream, nbytes, alone_Bps, self.copy_draw)

    def update(self, nbytes: float, alone_s: float, nvme_s: float = 0.0) -> simpy.Event:
        """A CPU update moving `nbytes` of host memory, `alone_s` seconds when nothing else draws on it; with the
        optimizer state on the NVMe tier also `nvme_s` seconds of the drive (a flow of its own, streamed chunk by
        chunk alongside the update: the update ends when both have)."""
        if nbytes <= 0 or alone_s <= 0:
            done = self._start("cpu", alone_s, 1.0, 0.0)  # no bytes known: a plain duration
        else:
            done = self._start("cpu", nbytes, nbytes / alone_s, 1.0)
        if nvme_s <= 0:
            return done
        return simpy.AllOf(self.env, [done, self._start("nvme", nvme_s, 1.0, 0.0)])

    def compute(self, seconds: float, beside_copy: float,
                beside_collective: dict[str, float] | None = None) -> simpy.Event:
        """A compute task of `seconds` alone, `beside_copy` times slower while a copy is in flight and
        `beside_collective[op]` times slower while collective op is (the two multiply)."""
        return self._start("compute", seconds, 1.0, 0.0, beside_copy, beside_collective)

    def collective(self, op: str, seconds: float) -> simpy.Event:
        """A collective `op` ("G", "Z") of `seconds` on the comm stream: it draws no host memory and is not slowed;
        it is a flow so that a compute task knows while it is in flight."""
        return self._start("comm", seconds, 1.0, 0.0, op=op)

    def _start(self, name: str, amount: float, ceiling: float, draw: float, beside_copy: float = 1.0,
               beside_collective: dict[str, float] | None = None, op: str | None = None) -> simpy.Event:
        done = self.env.event()
        if amount <= 0 or math.isinf(ceiling):
            done.succeed()
            return done
        self._advance()
        self.flows[name] = _Flow(amount, ceiling, draw, done, beside_copy, beside_collective, op)
        self._replan()
        return done

    def _advance(self) -> None:
        dt = self.env.now - self._t
        if dt > 0:
            for f in self.flows.values():
                f.remaining -= f.rate * dt
        self._t = self.env.now

    def _replan(self) -> None:
        self._gen += 1
        if not self.flows:
            return
        copying = [n for n in self.flows if n in COPY_STREAMS]
        collective = self.flows["comm"].op if "comm" in self.flows else None
        rates = share_rates({n: f.slowed_ceiling(bool(copying), collective) for n, f in self.flows.items()},
                            {n: f.draw for n, f in self.flows.items()},
                            set(copying), self.host_Bps, self.duplex_Bps, self.beside_update)
        for n, f in self.flows.items():
            f.rate = rates[n]
        dt, due = min((max(f.remaining, 0.0) / f.rate, n) for n, f in self.flows.items())
        gen = self._gen
        self.env.timeout(dt).callbacks.append(lambda _e: self._wake(gen, due))

    def _wake(self, gen: int, due: str) -> None:
        if gen != self._gen:
            return
        self._advance()
        # The flow the wake-up was planned for is done, whatever rounding left in `remaining` (a wake-up for a
        # residue below the clock's resolution would never advance time). Another flow finishing within the
        # clock's resolution of it is done too.
        slack_s = max(1e-12, 8 * math.ulp(self.env.now))
        for name in sorted(self.flows):
            f = self.flows[name]
            if name == due or f.remaining <= f.rate * slack_s:
                del self.flows[name]
                f.done.succeed()
        self._replan()
