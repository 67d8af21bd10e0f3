"""Builders: from a Placement (megatrain/ir/placement.py) to the DAG of one training step, as a chain of passes.

The step streams the model unit by unit: embedding, layers 0..L-1, head (loss forward and backward fused, chunk by
chunk), then layers L-1..0 backward and the embedding's backward. Each pass adds one concern to a `StepGraph`
and has a one-sentence contract:

    add_compute              F, R, B tasks, the visits of each unit's weights, activations up and gradients down
    assign_weight_slots      each visit gets a GPU buffer: a least-recently-used ring of layer slots, embed/head
    add_weight_fills         each visit's buffer is filled (PREFETCH, or the GPU update that writes new weights)
    add_gradient_offloads    each unit's accumulated gradients leave its buffer once, after its last backward
    add_updates              each unit's AdamW update, where and when the placement says, and the global norm
    add_gradient_ring        with a gradient ring, an OFFLOAD into a ring tile waits for the readers of its previous unit
    add_checkpoint_offloads  offloaded checkpoints go to the host after the forward and back before the backward
    add_strategy_passes      (world > 1) the collective strategy's passes, e.g. all-gathers complete the slots and
                             reduce-scatters sum the gradients (megatrain/parallel/sharded.py registers them)
    order_queues             the program order: emission order, with state copies and GPU updates moved to anchors
                             (megatrain/compile/order.py)

`build_schedule(spec, batch, seq, knobs)` resolves the knobs and runs the chain; `build_from_placement` runs it on
a placement you made or changed yourself.
"""
from __future__ import annotations

from dataclasses import replace

from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.ir.dag import Schedule
from megatrain.compile.knobs import DEFAULT_SCHEDULE, ScheduleKnobs, knobs_for
from megatrain.compile.order import order_queues
from megatrain.ir.placement import GradLanding, Parallelism, Placement, Timing, UpdateSite, resident_buffer
from megatrain.compile.resolve import resolve
from megatrain.compile.strategies import add_strategy_passes
from megatrain.compile.stepgraph import StepGraph, Visit, copy_attrs, work_attrs
from megatrain.ir.tasks import NORM, B, F, O, P, R, S, Task, TaskKind, U, V, W, X, Y
from megatrain.compile.lower import lower


# ---- passes -----------------------------------------------------------------------------------------------------
def add_compute(sg: StepGraph) -> None:
    """F, R, B tasks of every micro-batch in program order, the visits of each unit's weights, and the edges that
    carry activations up through the forward and gradients down through the backward."""
    p = sg.placement
    M, L, r = p.micro_batches, p.model.num_layers, p.recompute_block
    order: list[Task] = []
    visits: list[Visit] = []
    for unit in [EMBED, *range(L), HEAD]:  # forward; the head's forward is the fused loss forward + backward
        readers = [F(unit, m) for m in range(M)]
        visits.append(Visit(unit, unit == HEAD, readers))
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
    visits += [Visit(layer, True, rd) for layer, rd in bwd_readers.items()]
    visits.append(Visit(EMBED, True, be))
    pos = {t: i for i, t in enumerate(order)}
    for v in visits:
        v.first, v.last = min(pos[t] for t in v.readers), max(pos[t] for t in v.readers)
    sg.visits = sorted(visits, key=lambda v: v.first)
    sg.compute = order
    for t in order:
        sg.add(t, **work_attrs(p, t.kind, t.unit))

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
    ring: list[Visit | None] = [None] * p.ring_buffers
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
            sg.before.setdefault(first, []).append(sg.add(v.fill, slot=v.slot, **copy_attrs(n * wire_w, n)))
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
            attrs = dict(slot=v.slot, weights=None, resident=True, **copy_attrs(0, n))
        elif where is GradLanding.GPU_KEPT:  # a device-to-device copy into the layer's own gradient buffer
            attrs = dict(slot=v.slot, weights=v.fill, fills=f"g{v.unit}", **copy_attrs(0, n))
        else:
            attrs = dict(slot=v.slot, weights=v.fill, **copy_attrs(n * wire_g, n))
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
        sg.end.append(sg.add(NORM, device="cpu", **copy_attrs(0, s.num_params)))
        for unit in s.units():
            sg.edge(O(unit), NORM, "clip")
    if p.timing is Timing.AFTER:
        for unit in s.units():
            sg.end += _add_update(sg, None, 0, unit)
    _connect_updates(sg)
    if p.speculative_clip:
        _add_clip_redos(sg)


def _add_update(sg: StepGraph, visit: Visit | None, step_offset: int, unit: int | None = None) -> list[Task]:
    unit = visit.unit if visit is not None else unit
    where = sg.placement.unit(unit).update
    if where is UpdateSite.GPU_RESIDENT:
        n = sg.placement.model.unit_params(unit)
        return [sg.add(U(unit), step_offset=step_offset, slot=visit.slot, weights=None, resident=True,
                       **copy_attrs(0, n))]
    if where is UpdateSite.GPU_STREAMED:
        return _add_gpu_update(sg, unit, step_offset)
    return [_add_host_update(sg, unit, step_offset)]


def _add_host_update(sg: StepGraph, unit: int, step_offset: int) -> Task:
    s = sg.placement.model
    # A tied head's lm_head is the embedding: its update is the embedding's.
    n = s.hidden_size if unit == HEAD and s.tie_word_embeddings else s.unit_params(unit)
    return sg.add(U(unit), device="cpu", step_offset=step_offset, **copy_attrs(0, n))


def _add_gpu_update(sg: StepGraph, unit: int, step_offset: int, fills: str | None = None) -> list[Task]:
    """S, U, W of a GPU update on streamed state: master + m + v (+ gradients in the grad wire dtype, unless kept on
    the GPU) into a state buffer, AdamW there, then master + m + v (+ the bf16 streaming copy) back."""
    p = sg.placement
    placed = p.unit(unit)
    n, slot = p.model.unit_params(unit), placed.state_buffer
    grads = 0 if placed.grads is GradLanding.GPU_KEPT else p.wire_bytes("grad_wire")  # widened on the device
    shadow = 2 if p.weight_wire == "bf16" else 0
    return [sg.add(S(unit), slot=slot, step_offset=step_offset, **copy_attrs(n * (12 + grads), n)),
            sg.add(U(unit), step_offset=step_offset, slot=slot, weights=S(unit), **({"fills": fills} if fills else {}),
                   **copy_attrs(0, n)),
            sg.add(W(unit), slot=slot, weights=S(unit), step_offset=step_offset, **copy_attrs(n * (12 + shadow), n))]


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
        if offset == 0 and NORM in g and not p.speculative_clip:
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


def add_gradient_ring(sg: StepGraph) -> None:
    """With a gradient ring, an OFFLOAD into a ring tile waits for every reader of the tile's previous unit (the
    ring tiles are assigned by the placement, `Placement.ring_tiles`)."""
    p = sg.placement
    previous: dict[int, int] = {}
    for unit, tile in p.ring_tiles:
        if tile in previous:
            for reader in p.landing_readers(previous[tile]):
                sg.edge(reader, O(unit), "ring")
        previous[tile] = unit


def _add_clip_redos(sg: StepGraph) -> None:
    """Speculative exact clipping: each update ran unclipped as its gradients landed; V(u) undoes it and applies it
    again with the clip coefficient when the global norm exceeds the max, applies a deferred one (the host waited
    for the norm), and does nothing otherwise. It runs where the unit's state and gradients are.

    A resident unit's V runs on the GPU at the end of the step, after both U(u) and the norm. A host unit's V (its
    gradients landed on the host; a GPU-streamed update's W has brought its state back) runs at the start of the
    next step (step_offset -1; knob clip_redo unset or "next-step"), before the copies that read what it changes:
    the PREFETCH of its weights, the STATE_PREFETCH of a GPU-streamed update, and the OFFLOAD that overwrites the
    gradients it reads. In a step that clips, the host's redos then overlap the next forward (of the resident layers
    first, whose weights need none) instead of holding the step's end: measured on an H200, bench-3b 8 x 2048 with
    12 resident layers spent 0.44 s a step after the norm on them (docs/runs/25-peers/h200-table3). The step
    boundary orders the redo after the norm and U(u) of the step before; `StreamedTrainer.flush` runs the last
    step's. With clip_redo="step-end" it runs at the end of its own step, after the norm and W(u) or U(u)."""
    p, s = sg.placement, sg.placement.model
    for unit in s.units():
        update = U(unit)
        a = sg.graph.nodes[update]
        resident = a.get("resident")
        where = dict(slot=a["slot"], weights=None, resident=True) if resident else dict(device="cpu")
        if resident or not p.redo_next_step:  # in this step, after the norm (host units: clip_redo="step-end")
            redo = sg.add(V(unit), **where, **copy_attrs(0, a["params"]))
            sg.end.append(redo)
            sg.edge(NORM, redo, "clip")
            sg.edge(W(unit) if W(unit) in sg.graph else update, redo)
            continue
        redo = sg.add(V(unit), **where, step_offset=-1, **copy_attrs(0, a["params"]))
        sg.start.append(redo)  # forward order: the first layer the forward streams is redone first
        sg.edge(redo, O(unit), "state")  # read the last step's gradients before this step's land
        for reader in (P(unit), S(unit)):  # stream the weights, or the state of a GPU update, once redone
            if reader in sg.graph:
                sg.edge(redo, reader, "state")
    if s.tie_word_embeddings:  # the head's streaming copy of the shared matrix is refreshed by the embedding's redo
        sg.edge(V(EMBED), V(HEAD), "state")


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
            sg.after.setdefault(src, []).append(sg.add(X(l0, m), **copy_attrs(act, 0)))
        sg.before.setdefault(starts[l0], []).extend(sg.add(Y(l0, m), **copy_attrs(act, 0)) for m in range(M))
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



PASSES = (add_compute, assign_weight_slots, add_weight_fills, add_gradient_offloads, add_updates,
          add_gradient_ring, add_checkpoint_offloads, add_strategy_passes, order_queues)


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
                   validate: bool = True, world: int | Parallelism = 1) -> Schedule:
    """Resolve the knobs (a named schedule or ScheduleKnobs), build and (by default) validate one step's DAG;
    `world`: the run's Parallelism (ranks, hosts, strategy), or just its number of ranks on one host. With more than
    one rank it is one rank's step of data parallel training, `batch` being the rank's share of the global batch."""
    name = knobs if isinstance(knobs, str) else "custom"
    if isinstance(knobs, str):
        knobs = knobs_for(knobs)
    parallel = world if isinstance(world, Parallelism) else Parallelism(world)
    sched = build_from_placement(resolve(spec, batch, seq, knobs, parallel), knobs, name, validate)
    if knobs.state_lookahead is not None:
        _report_if_lookahead_changes_nothing(sched, knobs)
    return sched


def _report_if_lookahead_changes_nothing(sched: Schedule, knobs: ScheduleKnobs) -> None:
    """state_lookahead moves state copies in the program order, but dependencies (the state-buffer ring, one weight
    buffer, a short model) can fix the queues regardless: then the placement's notes say so, rather than the knob
    silently doing nothing. Only the stream queues count (what the interpreters follow)."""

    p = sched.placement
    default = resolve(p.model, p.batch, p.seq, replace(knobs, state_lookahead=None))
    if default.state_lookahead == p.state_lookahead:
        return
    if lower(build_from_placement(default, validate=False)).streams == lower(sched).streams:
        note = (f"state_lookahead={p.state_lookahead} gives the same stream queues as the default "
                f"{default.state_lookahead} here (dependencies fix where the state copies run)")
        sched.placement = replace(p, notes=p.notes + (note,))
