"""Builders: from a Placement (megatrain/ir/placement.py) to the DAG of one training step, as a chain of passes.

The step streams the model unit by unit: embedding, layers 0..L-1, head (loss forward and backward fused, chunk by
chunk), then layers L-1..0 backward and the embedding's backward. Each pass adds one concern to a `StepGraph`
and has a one-sentence contract:

    add_compute              F, R, B tasks, the visits of each unit's weights, activations up and gradients down
    assign_weight_slots      each visit gets a GPU buffer: a least-recently-used ring of layer slots, embed/head
    add_weight_fills         each visit's buffer is filled (PREFETCH, or the GPU update that writes new weights)
    add_gradient_offloads    each unit's accumulated gradients leave its buffer once, after its last backward
    add_updates              each unit's AdamW update, where and when the placement says, and the global norm
    add_checkpoint_offloads  offloaded checkpoints go to the host after the forward and back before the backward
    order_queues             the program order: emission order, with state copies and GPU updates moved to anchors

`build_schedule(spec, batch, seq, knobs)` resolves the knobs and runs the chain; `build_from_placement` runs it on
a placement you made or changed yourself.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import networkx as nx

from ..spec import EMBED, HEAD, ModelSpec
from .dag import Schedule
from .knobs import DEFAULT_SCHEDULE, ScheduleKnobs, knobs_for
from .placement import (
    GradLanding,
    Placement,
    Timing,
    UpdateSite,
    resident_buffer,
    resolve,
)
from .tasks import NORM, B, F, O, P, R, S, Task, TaskKind, U, W, X, Y


@dataclass
class _Visit:
    """An interval during which a unit's weights (and gradient area) occupy one GPU buffer."""

    unit: int
    backward: bool
    readers: list[Task]
    first: int = 0  # position of the first reader in the compute order
    last: int = 0
    slot: str = ""
    fill: Task | None = None  # the task that fills the buffer (None: reused from the forward, or resident)
    previous: _Visit | None = None  # the occupant the fill evicts


@dataclass
class StepGraph:
    """The DAG under construction, with what the passes share: the compute order, the weight visits, and where
    the non-compute tasks go in program order (just before / after a compute task, at the start, at the end)."""

    placement: Placement
    graph: nx.DiGraph = field(default_factory=nx.DiGraph)
    compute: list[Task] = field(default_factory=list)  # compute tasks in program order
    visits: list[_Visit] = field(default_factory=list)  # sorted by first reader
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

    def visit_of_fill(self, fill: Task) -> _Visit:
        return next(v for v in self.visits if v.fill == fill)


def _work(p: Placement, kind: TaskKind, unit: int) -> dict:
    s, mb = p.model, p.batch // p.micro_batches
    return dict(flops=s.task_flops(kind.value, unit, mb, p.seq), tokens=mb * p.seq, bytes=0,
                params=s.unit_params(unit))


def _copy(nbytes: int, params: int, **attrs) -> dict:
    return dict(bytes=nbytes, params=params, flops=0.0, tokens=0, **attrs)


# ---- passes -----------------------------------------------------------------------------------------------------
def add_compute(sg: StepGraph) -> None:
    """F, R, B tasks of every micro-batch in program order, the visits of each unit's weights, and the edges that
    carry activations up through the forward and gradients down through the backward."""
    p = sg.placement
    M, L, r = p.micro_batches, p.model.num_layers, p.recompute_block
    order: list[Task] = []
    visits: list[_Visit] = []
    for unit in [EMBED, *range(L), HEAD]:  # forward; the head's forward is the fused loss forward + backward
        readers = [F(unit, m) for m in range(M)]
        visits.append(_Visit(unit, unit == HEAD, readers))
        order += readers
    # Backward, block by block from the top. A block [l0, l1) recomputes l0..l1-2 from l0's checkpoint.
    sg.blocks = blocks = [(l0, min(l0 + r, L)) for l0 in range(0, L, r)]
    bwd_readers: dict[int, list[Task]] = {}
    for l0, l1 in reversed(blocks):
        for layer in range(l0, l1 - 1):
            rs = [R(layer, m) for m in range(M)]
            bwd_readers.setdefault(layer, []).extend(rs)
            order += rs
        for layer in reversed(range(l0, l1)):
            bs = [B(layer, m) for m in range(M)]
            bwd_readers.setdefault(layer, []).extend(bs)
            order += bs
    be = [B(EMBED, m) for m in range(M)]
    order += be
    visits += [_Visit(layer, True, rd) for layer, rd in bwd_readers.items()]
    visits.append(_Visit(EMBED, True, be))
    pos = {t: i for i, t in enumerate(order)}
    for v in visits:
        v.first, v.last = min(pos[t] for t in v.readers), max(pos[t] for t in v.readers)
    sg.visits = sorted(visits, key=lambda v: v.first)
    sg.compute = order
    for t in order:
        sg.add(t, **_work(p, t.kind, t.unit))

    chain = [EMBED, *range(L), HEAD]
    for m in range(M):
        for a, b in zip(chain, chain[1:]):
            sg.edge(F(a, m), F(b, m))
        for l0, l1 in blocks:  # layer l0's checkpointed input is the output of F(l0-1) (F(E) for l0 = 0)
            src = F(l0 - 1 if l0 else EMBED, m)
            sg.edge(src, B(l0, m))
            if l1 - l0 > 1:
                sg.edge(src, R(l0, m))
            for layer in range(l0, l1 - 1):  # recomputed inputs of the block's inner layers
                if layer > l0:
                    sg.edge(R(layer - 1, m), R(layer, m))
                sg.edge(R(layer, m), B(layer + 1, m))
        top = HEAD
        for layer in reversed(range(L)):
            sg.edge(F(top, m) if top == HEAD else B(top, m), B(layer, m))
            top = layer
        sg.edge(B(0, m) if L else F(HEAD, m), B(EMBED, m))


def assign_weight_slots(sg: StepGraph) -> None:
    """Each visit gets a GPU buffer: the resident unit's own, the embedding's and head's dedicated ones, or the least
    recently used slot of the layer ring (a layer still there from its forward is reused by its backward)."""
    p = sg.placement
    ring: list[_Visit | None] = [None] * p.ring_buffers
    fwd_embed = None
    fills_by_update = p.timing is Timing.OVERLAP  # a GPU update of the previous step writes the forward's weights
    for v in sg.visits:
        if p.unit(v.unit).resident:  # its own buffer for the whole run: nothing to fill or evict
            v.slot, v.fill, v.previous = resident_buffer(v.unit), None, None
            continue
        if v.unit in (EMBED, HEAD):
            v.slot = "embed" if v.unit == EMBED else "head"
            if v.unit == EMBED and v.backward:
                v.fill = fwd_embed.fill  # the embedding's buffer is never refilled within a step
            else:
                v.fill = P(v.unit)
            if v.unit == EMBED and not v.backward:
                fwd_embed = v
            continue
        kept = next((i for i, o in enumerate(ring) if o and o.unit == v.unit and not o.backward), None)
        if v.backward and kept is not None:
            v.slot, v.fill, v.previous = f"w{kept}", ring[kept].fill, None
            ring[kept] = v
            continue
        free = [i for i, o in enumerate(ring) if o is None or o.last < v.first]
        assert free, "placement.resolve guarantees buffers >= recompute_block"
        i = min(free, key=lambda i: (ring[i] is not None, ring[i].last if ring[i] else 0, i))
        by_update = fills_by_update and not v.backward and p.unit(v.unit).update is UpdateSite.GPU_STREAMED
        v.slot, v.fill, v.previous = f"w{i}", U(v.unit) if by_update else P(v.unit, back=v.backward), ring[i]
        ring[i] = v
    for v in sg.visits:
        for t in v.readers:
            sg.graph.nodes[t].update(slot=v.slot, weights=v.fill, **({"resident": True} if v.fill is None and
                                                                      p.unit(v.unit).resident else {}))


def add_weight_fills(sg: StepGraph) -> None:
    """Each visit's buffer is filled just before its first reader, by a PREFETCH in the weight wire or, for
    "overlap" GPU updates, by the update itself (S, U, W), and refilled only after the previous occupant's readers."""
    p = sg.placement
    wire_w = p.wire_bytes("weight_wire")
    for v in sg.visits:
        if v.fill is None or v.fill in sg.graph:
            continue
        first = sg.compute[v.first]
        if v.fill.kind is TaskKind.OPTIMIZER:
            sg.before.setdefault(first, []).extend(_add_gpu_update(sg, v.unit, -1, fills=v.slot))
        else:
            n = p.model.unit_params(v.unit)
            sg.before.setdefault(first, []).append(sg.add(v.fill, slot=v.slot, **_copy(n * wire_w, n)))
    for v in sg.visits:
        if v.fill is None:
            continue
        for t in v.readers:
            sg.edge(v.fill, t)
        if v.previous is not None:
            for reader in v.previous.readers:
                sg.edge(reader, v.fill, "slot")


def add_gradient_offloads(sg: StepGraph) -> None:
    """Each unit's gradients, accumulated over the micro-batches in its buffer, leave it once after its last
    backward: to the host in the grad wire, into a kept-gradient buffer, or nowhere (resident: only the norm)."""
    p, s = sg.placement, sg.placement.model
    wire_g = p.wire_bytes("grad_wire")
    for v in sg.visits:
        if not v.backward:
            continue
        n, where = s.unit_params(v.unit), p.unit(v.unit).grads
        if where is GradLanding.GPU_RESIDENT:
            attrs = dict(slot=v.slot, weights=None, resident=True, **_copy(0, n))
        elif where is GradLanding.GPU_KEPT:  # a device-to-device copy into the layer's own gradient buffer
            attrs = dict(slot=v.slot, weights=v.fill, fills=f"g{v.unit}", **_copy(0, n))
        else:
            attrs = dict(slot=v.slot, weights=v.fill, **_copy(n * wire_g, n))
        sg.after.setdefault(sg.compute[v.last], []).append(sg.add(O(v.unit), **attrs))
    for unit in s.units():
        producers = [F(HEAD, m) if unit == HEAD else B(unit, m) for m in range(p.micro_batches)]
        for a, b in zip(producers, producers[1:]):
            sg.edge(a, b, "accum")
        sg.edge(producers[-1], O(unit))
    for v in sg.visits:  # a buffer is refilled only after its previous occupant's gradients are out
        if v.fill is not None and v.previous is not None and v.previous.backward:
            sg.edge(O(v.previous.unit), v.fill, "slot")


def add_updates(sg: StepGraph) -> None:
    """Each unit's AdamW update where its placement says (host threads, the GPU on streamed or resident state) and
    when the timing says (the previous step's gradients first, as this step's land, or after the global norm)."""
    p, s = sg.placement, sg.placement.model
    if p.timing is Timing.OVERLAP:  # previous step's gradients, first in program order
        for unit in s.units():
            if U(unit) not in sg.graph:  # GPU updates are already there: they fill their layer's buffer
                sg.start.append(_add_host_update(sg, unit, -1))
    if p.timing is Timing.ARRIVAL:  # as its gradients land, right after its OFFLOAD
        for v in sg.visits:
            if v.backward:
                sg.after[sg.compute[v.last]] += _add_update(sg, v, 0)
    if p.exact_clip:
        sg.end.append(sg.add(NORM, device="cpu", **_copy(0, s.num_params)))
        for unit in s.units():
            sg.edge(O(unit), NORM, "clip")
    if p.timing is Timing.AFTER:
        for unit in s.units():
            sg.end += _add_update(sg, None, 0, unit)
    _connect_updates(sg)


def _add_update(sg: StepGraph, visit: _Visit | None, step_offset: int, unit: int | None = None) -> list[Task]:
    unit = visit.unit if visit is not None else unit
    where = sg.placement.unit(unit).update
    if where is UpdateSite.GPU_RESIDENT:
        n = sg.placement.model.unit_params(unit)
        return [sg.add(U(unit), step_offset=step_offset, slot=visit.slot, weights=None, resident=True,
                       **_copy(0, n))]
    if where is UpdateSite.GPU_STREAMED:
        return _add_gpu_update(sg, unit, step_offset)
    return [_add_host_update(sg, unit, step_offset)]


def _add_host_update(sg: StepGraph, unit: int, step_offset: int) -> Task:
    s = sg.placement.model
    # A tied head's lm_head is the embedding: its update is the embedding's.
    n = s.hidden_size if unit == HEAD and s.tie_word_embeddings else s.unit_params(unit)
    return sg.add(U(unit), device="cpu", step_offset=step_offset, **_copy(0, n))


def _add_gpu_update(sg: StepGraph, unit: int, step_offset: int, fills: str | None = None) -> list[Task]:
    """S, U, W of a GPU update on streamed state: master + m + v (+ gradients in the grad wire dtype, unless kept on
    the GPU) into a state buffer, AdamW there, then master + m + v (+ the bf16 streaming copy) back."""
    p = sg.placement
    placed = p.unit(unit)
    n, slot = p.model.unit_params(unit), placed.state_buffer
    grads = 0 if placed.grads is GradLanding.GPU_KEPT else p.wire_bytes("grad_wire")  # widened on the device
    shadow = 2 if p.weight_wire == "bf16" else 0
    return [sg.add(S(unit), slot=slot, step_offset=step_offset, **_copy(n * (12 + grads), n)),
            sg.add(U(unit), step_offset=step_offset, slot=slot, weights=S(unit), **({"fills": fills} if fills else {}),
                   **_copy(0, n)),
            sg.add(W(unit), slot=slot, weights=S(unit), step_offset=step_offset, **_copy(n * (12 + shadow), n))]


def _connect_updates(sg: StepGraph) -> None:
    """The edges of the updates: gradients in, the norm before them, weights out to the next copy, state buffers."""
    p, g, s = sg.placement, sg.graph, sg.placement.model
    for t in [t for t in g.nodes if t.kind is TaskKind.OPTIMIZER]:
        u, offset, where = t.unit, g.nodes[t]["step_offset"], p.unit(t.unit)
        if offset == -1 and where.update is UpdateSite.GPU_STREAMED:
            # "overlap" GPU update: fills the forward's weight buffer (visit edges); a backward that fetches the
            # layer again streams the copy W brought back.
            sg.edge(S(u), t)
            sg.edge(t, W(u))
            sg.edge(t, O(u), "state")  # read the old gradients before this step's are offloaded
            if P(u, back=True) in g:
                sg.edge(W(u), P(u, back=True), "state")
        elif offset == -1:
            sg.edge(t, P(u), "state")  # stream the weights only once they are updated
            sg.edge(t, O(u), "state")  # read the old gradients before this step's land
        elif where.update is UpdateSite.GPU_STREAMED:
            # The update reads gradients that O landed on the host (and S brings back), or that O copied into the
            # layer's own GPU buffer (kept gradients: S carries master and moments only).
            sg.edge(O(u), t if where.grads is GradLanding.GPU_KEPT else S(u))
            sg.edge(S(u), t)
            sg.edge(t, W(u))
        else:
            sg.edge(O(u), t)
        if offset == 0 and NORM in g:
            sg.edge(NORM, t, "clip")
    if s.tie_word_embeddings:
        # The head's lm_head gradient is added into the embedding's before its update, and the head's streaming
        # copy of the shared matrix is refreshed after it.
        if g.nodes[U(EMBED)]["step_offset"] == 0:
            sg.edge(O(HEAD), U(EMBED))
        sg.edge(U(EMBED), U(HEAD), "state")
    order = p.state_order  # a state buffer is refilled only after its previous occupant's W
    for a, b in zip(order, order[p.state_buffers:]):
        sg.edge(W(a), S(b), "slot")


def add_checkpoint_offloads(sg: StepGraph) -> None:
    """An offloaded checkpoint goes to the host right after the forward that makes it (X) and comes back before its
    block's backward (Y), once the block above has started its backward."""
    p = sg.placement
    offloaded = set(p.offloaded_checkpoints)
    if not offloaded:
        return
    act = p.tokens_per_micro * p.model.hidden_size * p.wire_bytes("compute_dtype")
    M = p.micro_batches
    starts = {l0: R(l0, 0) if l1 - l0 > 1 else B(l0, 0) for l0, l1 in sg.blocks}
    for l0 in sorted(offloaded):
        for m in range(M):
            src = F(l0 - 1 if l0 else EMBED, m)  # F(l-1) (F(E) for l = 0) produces layer l's input
            sg.after.setdefault(src, []).append(sg.add(X(l0, m), **_copy(act, 0)))
        sg.before.setdefault(starts[l0], []).extend(sg.add(Y(l0, m), **_copy(act, 0)) for m in range(M))
        for m in range(M):  # the block's first readers take the checkpoint from Y instead of from the forward
            src = F(l0 - 1 if l0 else EMBED, m)
            readers = [t for t in (B(l0, m), R(l0, m)) if sg.graph.has_edge(src, t)]
            for t in readers:
                sg.graph.remove_edge(src, t)
                sg.edge(Y(l0, m), t)
            sg.edge(src, X(l0, m))
            sg.edge(X(l0, m), Y(l0, m))
    prev_first = F(HEAD, 0)  # bring a block's checkpoints back once the block above has started its backward
    for l0, _ in reversed(sg.blocks):
        if l0 in offloaded:
            for m in range(M):
                sg.edge(prev_first, Y(l0, m), "slot")
        prev_first = starts[l0]


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


PASSES = (add_compute, assign_weight_slots, add_weight_fills, add_gradient_offloads, add_updates,
          add_checkpoint_offloads, order_queues)


# ---- entry points -----------------------------------------------------------------------------------------------
def build_from_placement(placement: Placement, knobs: ScheduleKnobs | None = None, name: str = "custom",
                         validate: bool = True) -> Schedule:
    """Run the passes on a placement; `knobs` (the words it was resolved from) are kept for display."""
    sg = StepGraph(placement)
    for run_pass in PASSES:
        run_pass(sg)
    sched = Schedule(sg.graph, placement.model, placement.batch, placement.seq, knobs, name, placement=placement)
    if validate:
        sched.validate()
    return sched


def build_schedule(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs | str = DEFAULT_SCHEDULE,
                   validate: bool = True) -> Schedule:
    """Resolve the knobs (a named schedule or ScheduleKnobs), build and (by default) validate one step's DAG."""
    name = knobs if isinstance(knobs, str) else "custom"
    if isinstance(knobs, str):
        knobs = knobs_for(knobs)
    sched = build_from_placement(resolve(spec, batch, seq, knobs), knobs, name, validate)
    if knobs.state_lookahead is not None:
        _report_if_lookahead_changes_nothing(sched, knobs)
    return sched


def _report_if_lookahead_changes_nothing(sched: Schedule, knobs: ScheduleKnobs) -> None:
    """state_lookahead moves state copies in the program order, but dependencies (the state-buffer ring, one weight
    buffer, a short model) can fix the queues regardless: then the placement's notes say so, rather than the knob
    silently doing nothing. Only the stream queues count (what the interpreters follow)."""
    from .program import lower  # lowering sits above the builders

    p = sched.placement
    default = resolve(p.model, p.batch, p.seq, replace(knobs, state_lookahead=None))
    if default.state_lookahead == p.state_lookahead:
        return
    if lower(build_from_placement(default, validate=False)).streams == lower(sched).streams:
        note = (f"state_lookahead={p.state_lookahead} gives the same stream queues as the default "
                f"{default.state_lookahead} here (dependencies fix where the state copies run)")
        sched.placement = replace(p, notes=p.notes + (note,))
