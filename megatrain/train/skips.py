"""Skipped updates: every one counted, logged, and a diverged run stopped.

An update is skipped when its gradients are not finite: the whole step (exact clipping: the global norm is not
finite) or single units (clip=0: each unit checks its own gradients). The trainer reports both on the step's
`UpdatePlan` (`skip`, `skipped_units`). A plan is *settled* once every unit's update ran or was skipped: at the end
of its own step, or, with the "overlap" placement (updates run during the next step), one step later or at
`flush()`. `SkipTracker` settles plans as they complete, so each skipped update is counted exactly once, and
counts consecutive steps with a skipped update: after `max_consecutive` of them the run has diverged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatrain.exec.optim import UpdatePlan
from megatrain.io.checkpoint_format import unit_key


@dataclass(frozen=True)
class Skip:
    """The skipped part of one step's update: its step (1-based) and the units not updated."""

    step: int
    units: tuple[int, ...]
    whole: bool  # the whole step was skipped (non-finite global norm)

    def describe(self, n_units: int) -> str:
        if self.whole or len(self.units) == n_units:
            return f"the update of step {self.step} was skipped (non-finite gradients; no unit updated)"
        names = ", ".join(unit_key(u) for u in self.units)
        return (f"the update of step {self.step} was skipped for {len(self.units)} of {n_units} units "
                f"(non-finite gradients in {names})")


@dataclass
class SkipTracker:
    """Settles UpdatePlans and keeps the run's skip accounting (see the module docstring)."""

    n_units: int
    max_consecutive: int = 0  # 0: never stop
    consecutive: int = 0  # steps in a row (by gradient step) with a skipped update
    skipped_steps: list[int] = field(default_factory=list)  # steps whose update was (partly) skipped
    skipped_unit_updates: int = 0  # unit updates skipped in all
    _pending: list[UpdatePlan] = field(default_factory=list)
    # Steps whose plan was settled: the same plan may come back (a whole-step skip settles at once, and the "overlap"
    # trainer's flush() at the last checkpoint hands it over again); it must not be counted twice.
    _settled_steps: set[int] = field(default_factory=set)

    def settle(self, *plans: UpdatePlan | None) -> list[Skip]:
        """Add `plans` (None is ignored) and return the skips of every plan now settled, oldest first."""
        self._pending += [p for p in plans if p is not None and p.step not in self._settled_steps
                          and all(p is not q for q in self._pending)]
        done = [p for p in self._pending if self._settled(p)]
        self._pending = [p for p in self._pending if not self._settled(p)]
        self._settled_steps.update(p.step for p in done)
        skips = []
        for p in sorted(done, key=lambda p: p.step):
            if p.skip or p.skipped_units:
                skip = Skip(p.step + 1, tuple(p.skipped_units), p.skip)
                skips.append(skip)
                self.skipped_steps.append(skip.step)
                self.skipped_unit_updates += self.n_units if skip.whole else len(skip.units)
                self.consecutive += 1
            else:
                self.consecutive = 0
        return skips

    def _settled(self, plan: UpdatePlan) -> bool:
        return plan.skip or len(plan.applied_units) + len(plan.skipped_units) >= self.n_units

    @property
    def diverged(self) -> bool:
        """`max_consecutive` steps in a row skipped their update."""
        return bool(self.max_consecutive) and self.consecutive >= self.max_consecutive

    def unit_count(self, skips: list[Skip]) -> int:
        """Unit updates skipped in `skips` (a whole skipped step counts every unit)."""
        return sum(self.n_units if s.whole else len(s.units) for s in skips)
