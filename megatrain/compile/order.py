"""The last builder pass: the program order that lowering breaks ties with.

Tasks keep their emission order (what runs first at the start, each compute task with its fills just before and
its offloads just after it, the global norm and post-step updates at the end); state copies and GPU updates are then
moved next to anchors, the tasks whose position they follow. Orders are integers 0..n-1: no float nudges.
"""
from __future__ import annotations

from megatrain.model.spec import EMBED, HEAD
from megatrain.ir.placement import Timing
from megatrain.compile.stepgraph import StepGraph
from megatrain.ir.tasks import P, S, Task, TaskKind, U, W


def order_queues(sg: StepGraph) -> None:
    """The program order (`order`, 0..n-1) that lowering breaks ties with: tasks in emission order (what runs
    first at the start, each compute task with its fills before and its offloads after, the global norm and
    post-step updates at the end), then state copies and GPU updates moved next to their anchors."""
    p = sg.placement
    _anchor_state_copies(sg)
    if p.timing is Timing.ARRIVAL:
        _anchor_arrival_updates(sg)
    emitted = list(sg.start)
    for t in sg.compute:
        emitted += sg.before.get(t, []) + [t] + sg.after.get(t, [])
    emitted += sg.end
    position = {t: i for i, t in enumerate(emitted)}
    assert len(position) == sg.graph.number_of_nodes(), "a task was added but never emitted"

    def key(t: Task) -> tuple[int, int, int]:
        if t in sg.anchors:
            anchor, rank, tie = sg.anchors[t]
            return position[anchor], rank, tie
        return position[t], 1, 0

    for i, t in enumerate(sorted(emitted, key=key)):
        sg.graph.nodes[t]["order"] = i


def _anchor_state_copies(sg: StepGraph) -> None:
    """"overlap" GPU updates: a layer's state copy S goes on h2d ahead of the fills of the `state_lookahead` layers
    before its own (the PREFETCHes of host-updated layers wait for their CPU update, and a copy queued behind them
    would idle the link meanwhile)."""
    p = sg.placement
    if p.timing is not Timing.OVERLAP:
        return
    fill_of = {v.unit: v.fill for v in sg.visits if not v.backward and v.fill is not None}
    for layer in p.gpu_streamed_layers:
        ahead = layer - p.state_lookahead
        fill = fill_of[ahead if ahead >= 0 else EMBED]
        first = S(fill.unit) if fill.kind is TaskKind.OPTIMIZER else fill  # a GPU update's fill starts with its S
        sg.anchors[S(layer)] = (first, 0, layer)


def _anchor_arrival_updates(sg: StepGraph) -> None:
    """Arrival placements: S(l) goes on h2d just before the backward fetch of layer l + 1 + state_lookahead, so
    master and moments stream in while the layers above run their backward; a GPU update goes on the compute stream
    after the next unit's backward has been issued (the update waits for its O, and the GPU should not idle
    meanwhile); W follows its update."""
    p, g, L = sg.placement, sg.graph, sg.placement.model.num_layers
    first_bwd, last_bwd = {}, {}  # unit -> its first (layers) / last backward compute task
    for t in sg.compute:
        if t.kind in (TaskKind.RECOMPUTE, TaskKind.BACKWARD):
            if t.unit >= 0:
                first_bwd.setdefault(t.unit, t)
            if t.kind is TaskKind.BACKWARD:
                last_bwd[t.unit] = t
    for unit in p.resident_units:
        nxt = {HEAD: L - 1, EMBED: None}.get(unit, unit - 1 if unit > 0 else EMBED)
        if nxt is None or nxt not in last_bwd:  # the embedding's update ends the step anyway; a head without layers
            continue
        sg.anchors[U(unit)] = (last_bwd[nxt], 2, 0)
    for layer in p.gpu_streamed_layers:
        ahead = min(layer + 1 + p.state_lookahead, L - 1)
        fetch = P(ahead, back=True)
        sg.anchors[S(layer)] = (fetch if fetch in g else first_bwd[ahead], 0, layer)
        below = last_bwd[layer - 1 if layer > 0 else EMBED]
        sg.anchors[U(layer)] = (below, 2, 0)
        sg.anchors[W(layer)] = (below, 3, 0)
