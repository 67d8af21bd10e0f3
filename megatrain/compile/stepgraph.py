"""The working state of the builder passes: the DAG under construction, the compute order, the weight visits, and
where the non-compute tasks go in program order."""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from megatrain.ir.placement import Placement
from megatrain.ir.tasks import Task, TaskKind


@dataclass
class Visit:
    """An interval during which a unit's weights (and gradient area) occupy one GPU buffer."""

    unit: int
    backward: bool
    readers: list[Task]
    first: int = 0  # position of the first reader in the compute order
    last: int = 0
    slot: str = ""
    fill: Task | None = None  # the task that fills the buffer (None: reused from the forward, or resident)
    previous: Visit | None = None  # the occupant the fill evicts


@dataclass
class StepGraph:
    """The DAG under construction, with what the passes share: the compute order, the weight visits, and where
    the non-compute tasks go in program order (just before / after a compute task, at the start, at the end)."""

    placement: Placement
    graph: nx.DiGraph = field(default_factory=nx.DiGraph)
    compute: list[Task] = field(default_factory=list)  # compute tasks in program order
    visits: list[Visit] = field(default_factory=list)  # sorted by first reader
    blocks: list[tuple[int, int]] = field(default_factory=list)  # recompute blocks [l0, l1)
    before: dict[Task, list[Task]] = field(default_factory=dict)
    after: dict[Task, list[Task]] = field(default_factory=dict)
    start: list[Task] = field(default_factory=list)
    end: list[Task] = field(default_factory=list)
    # task -> (anchor task, rank, tie-break): `order_queues` puts the task next to the anchor's emission position,
    # rank 0 just before it (ties by tie-break), 2 and 3 just after it.
    anchors: dict[Task, tuple[Task, int, int]] = field(default_factory=dict)

    def add(self, task: Task, **attrs) -> Task:
        if task in self.graph:
            raise AssertionError(f"duplicate task {task}")
        self.graph.add_node(task, device=attrs.pop("device", "gpu"), **attrs)
        return task

    def edge(self, a: Task, b: Task, why: str = "data") -> None:
        for t in (a, b):
            if t not in self.graph:
                raise AssertionError(f"edge {a.id} -> {b.id}: task {t.id} has not been added")
        self.graph.add_edge(a, b, why=why)


def work_attrs(p: Placement, kind: TaskKind, unit: int) -> dict:
    s, mb = p.model, p.batch // p.micro_batches
    flops = s.task_flops(kind.value, unit, mb, p.seq)
    if kind is TaskKind.BACKWARD and unit >= 0 and p.mlp_tile_tokens:  # the tiled MLP's backward recomputes its forward
        flops += s.tiled_mlp_flops(unit, mb, p.seq)
    if kind is TaskKind.BACKWARD and unit in p.graph_layers:  # the forward kept its graph: no recompute
        flops -= s.unit_forward_flops(unit, mb, p.seq)
    return dict(flops=flops, tokens=mb * p.seq, bytes=0, params=s.unit_params(unit))


def copy_attrs(nbytes: int, params: int, **attrs) -> dict:
    return dict(bytes=nbytes, params=params, flops=0.0, tokens=0, **attrs)
