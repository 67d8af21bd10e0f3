"""Data parallelism over the ranks of one host: sharded ownership of the host store, collectives as tasks.

With `world` = N ranks (one process per GPU), rank r owns the contiguous slice `[r*s, (r+1)*s)` of every unit's
flat tile (master, moments, streaming copy, gradient landing), `s = shard_numel(n, N)`: n / N rounded up to whole
pages of fp32 (1024 elements), so every slice boundary is page aligned and the slices are equal (the last one is
padded with zeros). Per fill of a GPU slot, the rank copies only its slice host -> GPU (PREFETCH), and an
ALL_GATHER on the `comm` stream fills the rest of the slot from the other ranks; compute is unchanged. After a
unit's last backward a REDUCE_SCATTER sums the slot's gradients over the ranks, leaving each its slice (and the
unit's gradient norm, all-reduced from the slices' squared norms, so clipping and the non-finite skip decide the
same on every rank); OFFLOAD copies only the slice to the host and the rank's CPU threads update only the slice.

The resolver decides what N ranks support and puts N in the placement (megatrain/compile/resolve.py). This module
holds the compile-side parts of the "sharded" strategy, which megatrain/parallel/sharded.py registers
(compile/strategies.py): the builder pass `add_collectives` (the G and Z tasks, the rank's slices), the comm queue
order `gathers_before_reductions`, and the per-rank slicing of the host plan `sharded_host_plan`.
"""
from __future__ import annotations

import networkx as nx

from megatrain.ir.hostlayout import sliced_component_names
from megatrain.ir.placement import Placement
from megatrain.compile.stepgraph import StepGraph
from megatrain.ir.placement import padded_numel, shard_numel  # noqa: F401  (re-exported)
from megatrain.ir.tasks import COMPUTE_KINDS, G, Task, TaskKind, Z

def add_collectives(sg: StepGraph) -> None:
    """World > 1: each PREFETCH (the rank's slice) is followed by an ALL_GATHER that completes the slot before its
    readers; each OFFLOAD is preceded by a REDUCE_SCATTER after the unit's last backward."""
    p, g = sg.placement, sg.graph
    if p.world <= 1:
        return
    _rank_slices(sg)
    for fill in [t for t in g.nodes if t.kind is TaskKind.PREFETCH]:
        a = g.nodes[fill]
        n = p.model.unit_params(fill.unit)
        gather = sg.add(G(fill.unit, back=fill.back), slot=a["slot"], weights=fill,
                        **_collective_attrs(n * p.wire_bytes("weight_wire"), n, p.world))
        readers = [t for t in g.successors(fill) if g.edges[fill, t].get("why", "data") == "data"]
        sg.edge(fill, gather)
        for t in readers:
            sg.edge(gather, t)
        _emit_after(sg, fill, gather)
    for off in [t for t in g.nodes if t.kind is TaskKind.OFFLOAD]:
        a = g.nodes[off]
        n = p.model.unit_params(off.unit)
        reduce = sg.add(Z(off.unit), slot=a["slot"], weights=a.get("weights"),
                        **_collective_attrs(4 * n, n, p.world))
        for t in [t for t in g.predecessors(off) if t.kind in COMPUTE_KINDS]:
            sg.edge(t, reduce)
        sg.edge(reduce, off)
        for t in [t for t in g.successors(off) if g.edges[off, t].get("why") == "slot"]:
            sg.edge(reduce, t, "slot")
        _emit_before(sg, off, reduce)


def _rank_slices(sg: StepGraph) -> None:
    """A rank's copies and host updates move its slice: PREFETCH, OFFLOAD and U carry the slice's bytes and
    parameters (what the simulator charges and the timeline reports)."""
    p, g = sg.placement, sg.graph
    for t in g.nodes:
        if t.kind not in (TaskKind.PREFETCH, TaskKind.OFFLOAD, TaskKind.OPTIMIZER):
            continue
        s = shard_numel(p.model.unit_params(t.unit), p.world)
        wire = {TaskKind.PREFETCH: p.wire_bytes("weight_wire"), TaskKind.OFFLOAD: p.wire_bytes("grad_wire"),
                TaskKind.OPTIMIZER: 0}[t.kind]
        g.nodes[t].update(bytes=s * wire, params=s)


def _collective_attrs(msg_bytes: int, params: int, world: int) -> dict:
    """`bytes` of a collective: what each rank sends over the bus, (world-1)/world of the whole message."""
    return dict(bytes=msg_bytes * (world - 1) // world, params=params, flops=0.0, tokens=0, device="gpu")


def _where(sg: StepGraph, task: Task) -> list[Task]:
    for lists in (sg.before, sg.after):
        for lst in lists.values():
            if task in lst:
                return lst
    for lst in (sg.start, sg.end):
        if task in lst:
            return lst
    raise AssertionError(f"{task} was never emitted")


def _emit_after(sg: StepGraph, anchor: Task, task: Task) -> None:
    lst = _where(sg, anchor)
    lst.insert(lst.index(anchor) + 1, task)


def _emit_before(sg: StepGraph, anchor: Task, task: Task) -> None:
    lst = _where(sg, anchor)
    lst.insert(lst.index(anchor), task)


def gathers_before_reductions(graph: nx.DiGraph, queues: dict[str, list[Task]]) -> list[Task]:
    """The `comm` queue with each all-gather moved ahead of the reduce-scatters queued just before it that it does
    not depend on.

    The comm stream is in order. Topological order puts the backward gather of layer l-1 (its slice copied a layer
    ahead) behind the reduce-scatter of layer l, which waits for layer l's backward. The backward then pays
    B + Z + G in series per layer, while the gather could have run during B. Moving G ahead of such a Z is safe
    exactly when no path leads from Z to G, through the DAG's edges or any stream's order (the streams are in
    order, so their order is a dependency too); that is checked for every move. Simulated: bench-3b `arrival`
    8 x 2048 on 2 GPUs 0.939 -> 0.905 s/step, dense-120b on 2 hosts x 8 GPUs 37.35 -> 34.50 s (docs/multigpu.md)."""
    comm = list(queues["comm"])
    lowered = nx.DiGraph(graph.edges)
    lowered.add_nodes_from(graph.nodes)
    for q in queues.values():
        lowered.add_edges_from(zip(q, q[1:]))
    for i in range(1, len(comm)):
        j = i
        while j > 0 and comm[j].kind is TaskKind.ALL_GATHER and comm[j - 1].kind is TaskKind.REDUCE_SCATTER:
            z, gather = comm[j - 1], comm[j]
            lowered.remove_edge(z, gather)
            if nx.has_path(lowered, z, gather):
                lowered.add_edge(z, gather)
                break
            before, after = comm[j - 2] if j > 1 else None, comm[j + 1] if j + 1 < len(comm) else None
            if before is not None:  # the stream order around the pair follows the swap
                lowered.remove_edge(before, z)
                lowered.add_edge(before, gather)
            if after is not None:
                lowered.remove_edge(gather, after)
                lowered.add_edge(z, after)
            lowered.add_edge(gather, z)
            comm[j - 1], comm[j] = gather, z
            j -= 1
    return comm


def sharded_host_plan(p: Placement, plan):
    """Host memory of one rank of a sharded placement (`plan.memory.HostMemoryPlan`), from the one-GPU `plan`: the
    store's tiles cut to the rank's slices (page-padded); offloaded checkpoints (of the rank's batch), scratch and
    runtime as one process has them."""
    spec = p.model
    full = sum(spec.unit_params(u) for u in spec.units())  # untied: the store's tiles are the units
    mine = sum(shard_numel(spec.unit_params(u), p.world) for u in spec.units())
    sliced = sliced_component_names(p.host_layout)  # each rank's store holds its slice of these
    components = {k: (v * mine // full if k in sliced else v) for k, v in plan.components.items()}
    pinned = plan.pinned_bytes * mine // full if plan.pinned_bytes else 0
    return type(plan)(components, pinned, plan.num_params)
