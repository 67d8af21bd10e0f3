"""The physical bound of a step: the least time its work needs on a profile's machine, whatever the schedule.

A Program's step moves through three resources, each of which it must use for at least

    compute      the model FLOPs of its compute tasks (F, R, B: recompute included) at the profile's measured
                 matmul rate for the compute dtype (`matmul_flops_per_s`, the peak of square matmuls, not the
                 fitted `efficiency`: a bound, not an estimate);
    host memory  the host bytes the simulator charges (sim/hostmem.py): every CPU update's AdamW and bf16
                 conversion bytes (`CostModel.cpu_update`) plus every copy's draw on host memory
                 (`copy_host_bytes_per_byte` per byte copied), over `host_memory_Bps`;
    PCIe         per direction, every copy's bytes over its curve's rate at its size (`CopyCurve.rate`, the rate
                 of a copy alone on the link; latencies left out).

The largest of the four times binds; `efficiency(step_s) = bound_s / step_s` says how close a step (predicted or
measured) comes to it. The simulator shares these resources and never runs a task faster than its rate alone, so a
predicted step is never shorter than the bound (tests/test_bound.py checks it for every named schedule).

    from megatrain.sim import step_bound
    b = step_bound(program, "h200-measured")
    print(b.describe(), f"{100 * b.efficiency(result.step_s):.0f}%")
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from megatrain.ir.facts import NO_CLIP, StepFacts
from megatrain.ir.program import Program
from megatrain.ir.tasks import TaskKind
from megatrain.sim.collectives import rank_profile
from megatrain.sim.costs import CostModel
from megatrain.sim.profile import COMPUTE_KINDS, HardwareProfile, load_profile

# The resources a step can be bound by, in the order ties are broken (the first of equal times binds).
RESOURCES = ("compute", "host memory", "h2d", "d2h")


@dataclass(frozen=True)
class StepBound:
    """The least seconds a step needs on each resource (module docstring), which of them binds, and its time."""

    compute_s: float
    host_memory_s: float
    h2d_s: float
    d2h_s: float

    @property
    def by_resource(self) -> dict[str, float]:
        """Seconds by resource name (RESOURCES order)."""
        return dict(zip(RESOURCES, (self.compute_s, self.host_memory_s, self.h2d_s, self.d2h_s)))

    @property
    def binding(self) -> str:
        """The resource of the largest time: "compute", "host memory", "h2d" or "d2h"."""
        times = self.by_resource
        return max(RESOURCES, key=lambda r: (times[r], -RESOURCES.index(r)))

    @property
    def bound_s(self) -> float:
        """The step can take no less than this."""
        return self.by_resource[self.binding]

    def efficiency(self, step_s: float) -> float:
        """bound_s / step_s: 1 is a step at the limit of its binding resource (0 for a step of no time)."""
        return self.bound_s / step_s if step_s > 0 else 0.0

    def describe(self) -> str:
        """One line: the bound, what binds, and every resource's time."""
        t = {k: 1e3 * v for k, v in self.by_resource.items()}
        return (f"bound {1e3 * self.bound_s:.2f} ms ({self.binding} binds): compute {t['compute']:.2f} ms at the "
                f"measured matmul rate, host memory {t['host memory']:.2f} ms, PCIe h2d {t['h2d']:.2f} / "
                f"d2h {t['d2h']:.2f} ms")

    def to_dict(self, prefix: str = "bound_") -> dict:
        """Flat fields for CSV / JSON rows: bound_compute_s, ..., bound_s, bound_binds."""
        d = {f"{prefix}{k}": v for k, v in asdict(self).items()}
        return {**d, f"{prefix}s": self.bound_s, f"{prefix}binds": self.binding}


def step_bound(program: Program, profile: HardwareProfile | str, facts: StepFacts = NO_CLIP) -> StepBound:
    """The physical bound of one step of `program` on `profile` (a HardwareProfile, a shipped name or a JSON path),
    as one rank of the Program's placement sees the machine (`rank_profile`, as `simulate` does). With speculative
    clipping and `facts.clip_share` 1 the step is one that clips (the updates its CLIP_REDO tasks do), as in
    `simulate`. Raises ProfileError when the profile has no matmul rate for the compute dtype."""
    return rank_bound(program, rank_profile(load_profile(profile), program.placement), facts)


def rank_bound(program: Program, profile: HardwareProfile, facts: StepFacts = NO_CLIP) -> StepBound:
    """`step_bound` on the profile one rank sees already (`SimResult.profile`: `rank_profile` applied once)."""
    clips = program.placement.speculative_clip and facts.clip_share >= 1.0
    cost = CostModel(program, profile, clips)  # what the simulator charges a CPU update, clipping included
    flops = host_bytes = 0.0
    pcie = {"h2d": 0.0, "d2h": 0.0}
    for t in program.tasks.values():
        kind = TaskKind(t.kind)
        if t.kind in COMPUTE_KINDS:
            flops += t.flops
        elif kind.copy and t.bytes:
            curve = profile.h2d if kind.copy == "h2d" else profile.d2h
            pcie[kind.copy] += t.bytes / curve.rate(t.bytes)
            host_bytes += profile.copy_host_bytes_per_byte * t.bytes
        elif cost.is_cpu_optimizer(t):
            host_bytes += cost.cpu_update(t).nbytes
    compute_s = flops / profile.matmul_rate(program.placement.compute_dtype)
    return StepBound(compute_s, host_bytes / profile.host_memory_Bps, pcie["h2d"], pcie["d2h"])
