"""The compiler's registry of collective strategies: what lowering does for a Program of several ranks.

A collective strategy (e.g. "sharded": each rank owns a slice of every unit, all-gathers fill the slots,
reduce-scatters sum the gradients) is one module of megatrain/parallel/ that registers its parts with each floor
below it; compile/ never imports parallel/. Here it registers
- `passes`: builder passes run after the one-GPU passes, before the queues are ordered (they add the collective
  tasks and size the rank's copies);
- `order_comm`: how lowering orders the `comm` stream's queue (graph, per-stream queues) -> comm queue;
- `host_plan`: the host memory of one rank, from the one-GPU plan (the store's per-rank slicing rule).

A placement of one rank needs no strategy. One of several ranks whose strategy is not registered is refused with a
message saying to `import megatrain.parallel` (which registers every strategy it ships).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from megatrain.compile.stepgraph import StepGraph
from megatrain.ir.dag import ScheduleError
from megatrain.ir.placement import Placement
from megatrain.plan.memory import plan_host_memory


@dataclass(frozen=True)
class CompileStrategy:
    """The compile-side parts of one collective strategy (module docstring)."""

    name: str
    passes: tuple[Callable, ...]  # fn(StepGraph) -> None, in order
    order_comm: Callable  # fn(graph, {stream: [Task]}) -> [Task], the comm queue
    host_plan: Callable  # fn(Placement, one-GPU HostMemoryPlan) -> one rank's HostMemoryPlan


_STRATEGIES: dict[str, CompileStrategy] = {}


def register_strategy(strategy: CompileStrategy) -> None:
    """Make `strategy` available to lowering (called by the strategy's module in megatrain/parallel/)."""
    _STRATEGIES[strategy.name] = strategy


def registered_strategies() -> tuple[str, ...]:
    return tuple(sorted(_STRATEGIES))


def strategy_of(p: Placement) -> CompileStrategy | None:
    """The compile parts of `p`'s collective strategy; None for one rank. Refuses a strategy nobody registered."""
    if p.world <= 1:
        return None
    found = _STRATEGIES.get(p.strategy)
    if found is None:
        known = ", ".join(registered_strategies()) or "none registered"
        raise ScheduleError(f"the placement runs {p.world} ranks with collective strategy {p.strategy!r}, which is "
                            f"not registered (registered: {known}); import megatrain.parallel first, which registers "
                            "the strategies it ships")
    return found


def add_strategy_passes(sg: StepGraph) -> None:
    """Builder pass: the passes of the placement's collective strategy (none for one rank, so one-GPU Programs
    are unchanged)."""
    strategy = strategy_of(sg.placement)
    for run_pass in strategy.passes if strategy else ():
        run_pass(sg)


def rank_host_plan(p: Placement, backend: str = "cuda"):
    """Host memory of one rank of `p` (`plan.memory.HostMemoryPlan`): the one-GPU plan, cut to the rank's share by
    the strategy's slicing rule. The node needs `world / hosts` times it."""
    plan = plan_host_memory(replace(p, world=1, hosts=1), backend)
    strategy = strategy_of(p)
    return plan if strategy is None else strategy.host_plan(p, plan)
