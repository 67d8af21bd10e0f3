"""The discrete-event engine: interprets a Program on a HardwareProfile with simpy and returns its Timeline.

One simpy process per stream walks that stream's queue in Program order. A task starts when the previous task
of its stream is done and every task in its `waits` is done; it then holds its stream for the duration the cost
model gives, except host-side work, whose bytes flow through the fluid model of host memory (`hostmem.py`), and
compute slowed beside copies or collectives:

- each direction (h2d, d2h) carries at most one copy at a time (each is one in-order stream); a copy alone moves
  at its curve's rate for its size, and the two directions share `duplex_Bps`;
- a CPU optimizer update is a flow of its host bytes (AdamW + bf16 conversion passes), at most the rate its
  threads reach alone; copies and the update share `host_memory_Bps` max-min fairly;
- whenever a flow starts or ends, the bytes still in flight are re-rated, so a copy that overlapped the other
  direction (or an update) for only part of its life is slowed for only that part;
- a compute task (F, R, B) whose kind the profile's `compute_beside_copy` slows is a flow of its seconds alone,
  drawing no host memory, at 1/k of its speed while a copy is in flight (the copies' DMA shares device memory);
- with the profile's `compute_beside_collective`, a collective (G, Z) is a flow of its seconds too, and a compute
  task is slowed by the factor of the collective in flight (NCCL's kernels share the SMs), times the copy's.

The simulation is deterministic: simpy breaks ties by scheduling order, and processes and events are created in
a fixed order. A Program that cannot finish (waits that form a cycle) raises SimulationError naming the stuck
tasks and what they wait for.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import pandas as pd
import simpy

from megatrain.analysis.summary import StepSummary, summarize
from megatrain.analysis.timeline import make_timeline
from megatrain.ir.facts import NO_CLIP, StepFacts
from megatrain.ir.program import STREAMS, Program
from megatrain.sim.bound import StepBound, rank_bound
from megatrain.sim.collectives import rank_profile
from megatrain.sim.costs import CostModel
from megatrain.sim.hostmem import HostMemory
from megatrain.sim.profile import COMPUTE_KINDS, HardwareProfile, load_profile


class SimulationError(RuntimeError):
    """A Program the simulator cannot run: a deadlock, or a wait on a task that does not exist."""


@dataclass
class SimResult:
    """What `simulate` returns: the predicted Timeline and its summary (plus what they were computed from)."""

    timeline: pd.DataFrame
    summary: StepSummary
    program: Program
    profile: HardwareProfile
    facts: StepFacts = NO_CLIP
    other_step_s: float | None = None  # 0 < clip_share < 1 with speculative clipping: the step that clips
    # Compute tasks the profile has no measured table for, priced from FLOPs (CostModel.estimated): their count
    # by kind, their seconds in the simulated step, and how many compute tasks the step has (sim/estimates.py).
    estimated: dict[str, int] = field(default_factory=dict)
    estimated_s: float = 0.0
    compute_tasks: int = 0

    @property
    def step_s(self) -> float:
        """Seconds of the simulated step (its Timeline's)."""
        return self.summary.step_s

    @property
    def mean_step_s(self) -> float:
        """Seconds per step over the run: the step that does not clip and the one that does, weighted by
        `facts.clip_share` (the simulated step's own time when only one kind of step occurs)."""
        if self.other_step_s is None:
            return self.step_s
        return (1 - self.facts.clip_share) * self.step_s + self.facts.clip_share * self.other_step_s

    @property
    def bound(self) -> StepBound:
        """The physical bound of the simulated step (sim/bound.py): `bound.efficiency(step_s)` is how close it
        comes to it."""
        return rank_bound(self.program, self.profile, self.facts)


class _Engine:
    def __init__(self, program: Program, profile: HardwareProfile, clip_activates: bool = False):
        self.program, self.profile = program, profile
        self.cost = CostModel(program, profile, clip_activates)
        self.env = simpy.Environment()
        self.host = HostMemory(self.env, profile.host_memory_Bps, profile.duplex_Bps, profile.copy_host_bytes_per_byte,
                               profile.copy_beside_update)
        self.done = {t: self.env.event() for t in program.tasks}
        self.rows: list[dict] = []

    def run(self) -> list[dict]:
        for s in STREAMS:
            if self.program.streams.get(s):
                self.env.process(self._stream(self.program.streams[s]))
        self.env.run()
        if len(self.rows) < len(self.program.tasks):
            raise SimulationError(deadlock_message(self.program, {r["task"] for r in self.rows}, self.env.now))
        return self.rows

    def _stream(self, queue: list[str]):
        env, tasks, cost = self.env, self.program.tasks, self.cost
        for tid in queue:
            t = tasks[tid]
            for w in t.waits:
                if not self.done[w].processed:
                    yield self.done[w]
            start = env.now
            if cost.is_copy(t):
                c = cost.copy_cost(t)
                if c.delay_s:
                    yield env.timeout(c.delay_s)
                yield self.host.copy(c.direction, c.nbytes, c.rate_Bps)
            elif cost.is_cpu_optimizer(t):  # shares host memory bandwidth with the copies
                u = cost.cpu_update(t)
                if u.delay_s:
                    yield env.timeout(u.delay_s)
                yield self.host.update(u.nbytes, u.alone_s, u.nvme_s)
            elif (op := cost.collective(t)) is not None and cost.profile.compute_beside_collective:
                # a flow of its seconds, so that the compute beside it knows it is in flight (hostmem.py)
                yield self.host.collective(op, cost.duration_s(t))
            elif (slowed := cost.slowed_beside(t)) != (1.0, {}):
                # slower while a copy or a collective is in flight (hostmem.py)
                yield env.timeout(cost.profile.overhead(t.stream, t.kind))
                yield self.host.compute(cost.compute_s(t), *slowed)
            else:
                yield env.timeout(cost.duration_s(t))
            self.rows.append(dict(task=tid, kind=t.kind, layer=t.unit, micro=t.micro, stream=t.stream,
                                  start_s=start, end_s=env.now, bytes=t.bytes, flops=t.flops, step=0))
            self.done[tid].succeed()


def check_program(program: Program) -> None:
    """Every queued task is known, every task queued once on its own stream, every wait names a task."""
    queued = [t for s in STREAMS for t in program.streams.get(s, [])]
    extra = set(program.streams) - set(STREAMS)
    if extra:
        raise SimulationError(f"program has unknown streams {sorted(extra)}; streams are {STREAMS}")
    if len(queued) != len(set(queued)) or set(queued) != set(program.tasks):
        dup = sorted({t for t in queued if queued.count(t) > 1})
        lost = sorted(set(program.tasks) - set(queued))
        ghost = sorted(set(queued) - set(program.tasks))
        raise SimulationError(f"program streams and tasks disagree: queued twice {dup}, never queued {lost}, "
                              f"queued but undefined {ghost}")
    for s in STREAMS:
        for tid in program.streams.get(s, []):
            t = program.tasks[tid]
            if t.stream != s:
                raise SimulationError(f"{tid} is queued on stream {s} but says stream={t.stream!r}")
            missing = [w for w in t.waits if w not in program.tasks]
            if missing:
                raise SimulationError(f"{tid} ({s}) waits for {missing}, which are not tasks of this program")


def deadlock_message(program: Program, finished: set[str], now: float) -> str:
    """Which stream is stuck at which task, what each waits for, and the cycle of waits."""
    heads = {}
    for s in STREAMS:
        for tid in program.streams.get(s, []):
            if tid not in finished:
                heads[s] = tid
                break
    lines, edges = [], {}
    for s, tid in heads.items():
        pending = [w for w in program.tasks[tid].waits if w not in finished]
        parts = []
        for w in pending:
            ws = program.tasks[w].stream
            blocker = heads.get(ws)
            parts.append(f"{w} ({ws}, queued behind {blocker})" if blocker != w else f"{w} ({ws}, itself stuck)")
            edges.setdefault(tid, []).append(blocker)
        lines.append(f"  {s}: {tid} waits for " + ", ".join(parts))
    cycle = _find_cycle(edges)
    never = len(program.tasks) - len(finished)
    msg = (f"simulation of {program.name!r} deadlocked at t={now:.6g} s: {never} task(s) never ran; the stuck "
           "streams:\n" + "\n".join(lines))
    if cycle:
        msg += "\nwait cycle: " + " -> ".join(f"{t} ({program.tasks[t].stream})" for t in cycle + cycle[:1])
    return msg + ("\nA task may only wait for tasks that can finish before it; fix the Program's waits or stream "
                  "order (or rebuild it with lower(build_schedule(...))).")


def _find_cycle(edges: dict[str, list[str]]) -> list[str]:
    g = nx.DiGraph([(a, b) for a, bs in edges.items() for b in bs])
    try:
        return [a for a, _ in nx.find_cycle(g)]
    except nx.NetworkXNoCycle:
        return []


def simulate(program: Program, profile: HardwareProfile | str = "h200", facts: StepFacts = NO_CLIP) -> SimResult:
    """Predict one training step of `program` on `profile` (a HardwareProfile, a shipped name or a JSON path).

    The ranks and hosts are the Program's (`placement.world`, `.hosts`): a data-parallel rank shares host memory
    bandwidth and CPU with the ranks of its host, and with several hosts its collectives cross the network; the
    placement's collective strategy registered how (sim/collectives.py `rank_profile`).

    facts: what the run knows about its steps (ir/facts.py). With speculative clipping (exact clipping, arrival
    timing) the Timeline is of a step that clips (every update undone and redone, CLIP_REDO) when
    `facts.clip_share` is 1, else of a step that does not; for a share strictly between 0 and 1 the other step is
    simulated too, and `SimResult.mean_step_s` weighs both.

    Returns SimResult(timeline, summary, program, profile, facts); the Timeline has source="predicted".
    Raises SimulationError when the Program cannot run to the end.
    """
    try:
        profile = rank_profile(load_profile(profile), program.placement)  # ranks share their host
    except ValueError as e:
        raise SimulationError(str(e)) from None
    check_program(program)
    speculative = program.placement.speculative_clip
    clips = speculative and facts.clip_share >= 1.0
    engine = _Engine(program, profile, clips)
    rows = engine.run()
    other = None
    if speculative and 0.0 < facts.clip_share < 1.0:  # the run mixes both kinds of step
        other = max((r["end_s"] for r in _Engine(program, profile, True).run()), default=0.0)  # as summarize
    timeline = make_timeline(rows, source="predicted")
    estimated, estimated_s, n = _estimated(engine.cost, program, rows)
    return SimResult(timeline, summarize(timeline, program), program, profile, facts, other, estimated, estimated_s, n)


def _estimated(cost: CostModel, program: Program, rows: list[dict]) -> tuple[dict[str, int], float, int]:
    """The compute tasks of a simulated step priced without a measured table: count by kind, their seconds (launch
    included, as the Timeline shows them), and the number of compute tasks."""
    by_kind: dict[str, int] = {}
    seconds, n = 0.0, 0
    for r in rows:
        t = program.tasks[r["task"]]
        if t.kind not in COMPUTE_KINDS:
            continue
        n += 1
        if cost.estimated(t):
            by_kind[t.kind] = by_kind.get(t.kind, 0) + 1
            seconds += r["end_s"] - r["start_s"]
    return by_kind, seconds, n
