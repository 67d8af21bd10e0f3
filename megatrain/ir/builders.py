"""Builders: from a model, a batch and the schedule knobs (megatrain/ir/knobs.py) to the DAG of one training step.

The step streams the model unit by unit: embedding, layers 0..L-1, head (loss forward and backward fused,
chunk by chunk), then layers L-1..0 backward and the embedding's backward. Every knob changes the graph; the
knobs module says how.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ..spec import EMBED, HEAD, ModelSpec
from .dag import Schedule, ScheduleError
from .knobs import (
    ARRIVAL_PLACEMENTS,
    DEFAULT_SCHEDULE,
    ScheduleKnobs,
    gpu_updated_layers,
    knobs_for,
    offloaded_checkpoints,
    resident_units,
    retained_grad_layers,
)
from .tasks import NORM, B, F, O, P, R, S, Task, TaskKind, U, W, X, Y


@dataclass
class _Visit:
    """An interval during which a unit's weights (and gradient area) occupy one GPU slot."""

    unit: int
    backward: bool
    readers: list[Task]
    first: int = 0  # position of the first reader in the compute order
    last: int = 0
    slot: str = ""
    fill: Task | None = None  # the PREFETCH that fills the slot (None: reused from the forward visit)
    previous: "_Visit | None" = None  # the occupant the fill evicts


class _Builder:
    def __init__(self, spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs):
        if batch % knobs.micro_batches:
            raise ScheduleError(
                f"batch {batch} does not split into micro_batches={knobs.micro_batches}; "
                "choose a micro-batch count that divides the batch"
            )
        self.spec, self.batch, self.seq, self.k = spec, batch, seq, knobs
        self.M = knobs.micro_batches
        self.mb = batch // self.M
        self.gpu_layers = gpu_updated_layers(spec, knobs)
        self.retained = set(retained_grad_layers(spec, knobs))
        self.resident = set(resident_units(spec, knobs))
        self.offloaded = set(offloaded_checkpoints(spec, knobs))
        # The order GPU updates take their state slots in: as gradients land (top down) for "arrival-split",
        # forward order otherwise.
        self.state_order = self.gpu_layers[::-1] if knobs.optimizer == "arrival-split" else list(self.gpu_layers)
        # "overlap-split": a GPU update of the previous step's gradients fills the layer's weight slot itself.
        self.update_fills = set(self.gpu_layers) if knobs.optimizer == "overlap-split" else set()
        self.g = nx.DiGraph()
        self._order = 0

    # -- graph primitives --
    def add(self, task: Task, **attrs) -> Task:
        if task in self.g:
            raise AssertionError(f"duplicate task {task}")
        self.g.add_node(task, order=self._order, device=attrs.pop("device", "gpu"), **attrs)
        self._order += 1
        return task

    def edge(self, a: Task, b: Task, why: str = "data") -> None:
        self.g.add_edge(a, b, why=why)

    # -- work quantities --
    def compute_work(self, kind: TaskKind, unit: int) -> dict:
        s, mb, seq = self.spec, self.mb, self.seq
        return dict(flops=s.task_flops(kind.value, unit, mb, seq), tokens=mb * seq, bytes=0,
                    params=s.unit_params(unit))

    def act_bytes(self) -> int:
        return self.mb * self.seq * self.spec.hidden_size * self.k.wire_bytes("compute_dtype")

    # -- the step --
    def build(self) -> Schedule:
        s, M, L = self.spec, self.M, self.spec.num_layers
        r = self.k.recompute_block
        order: list[Task] = []  # compute tasks in program order
        visits: list[_Visit] = []

        # Forward: embedding, layers, head (fused forward + backward of the loss).
        for unit in [EMBED, *range(L), HEAD]:
            readers = [F(unit, m) for m in range(M)]
            visits.append(_Visit(unit, unit == HEAD, readers))
            order += readers
        # Backward, block by block from the top. A block [l0, l1) recomputes l0..l1-2 from l0's checkpoint.
        blocks = [(l0, min(l0 + r, L)) for l0 in range(0, L, r)]
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
        for layer, rd in bwd_readers.items():
            visits.append(_Visit(layer, True, rd))
        visits.append(_Visit(EMBED, True, be))
        pos = {t: i for i, t in enumerate(order)}
        for v in visits:
            v.first = min(pos[t] for t in v.readers)
            v.last = max(pos[t] for t in v.readers)
        visits.sort(key=lambda v: v.first)

        self.assign_slots(visits)
        self.emit(visits, order, blocks)
        sched = Schedule(self.g, s, self.batch, self.seq, self.k)
        return sched

    def assign_slots(self, visits: list[_Visit]) -> None:
        """Dedicated buffers for embedding and head; a ring of k slots for layers, least recently used first."""
        ring: list[_Visit | None] = [None] * self.k.buffers
        fwd_embed = None
        for v in visits:
            if v.unit in self.resident:  # its own buffer for the whole run: nothing to fill or evict
                v.slot = resident_slot(v.unit)
                v.fill = v.previous = None
                continue
            if v.unit in (EMBED, HEAD):
                v.slot = "embed" if v.unit == EMBED else "head"
                if v.unit == EMBED and v.backward:
                    v.fill = fwd_embed.fill  # the embedding's buffer is never refilled within a step
                    v.previous = None
                else:
                    v.fill = P(v.unit)
                if v.unit == EMBED and not v.backward:
                    fwd_embed = v
                continue
            # Backward visit of a layer still resident from its forward: reuse, no copy.
            resident = next((i for i, o in enumerate(ring) if o and o.unit == v.unit and not o.backward), None)
            if v.backward and resident is not None:
                v.slot, v.fill, v.previous = f"w{resident}", ring[resident].fill, None
                ring[resident] = v
                continue
            free = [i for i, o in enumerate(ring) if o is None or o.last < v.first]
            if not free:
                r = self.k.recompute_block
                raise ScheduleError(
                    f"{self.k.buffers} weight buffer(s) cannot hold the {r} layers that a recompute block keeps "
                    f"resident during its backward; use buffers >= {r} ({r + 1} to overlap the copies), "
                    "or a smaller recompute_block"
                )
            i = min(free, key=lambda i: (ring[i] is not None, ring[i].last if ring[i] else 0, i))
            fill = U(v.unit) if not v.backward and v.unit in self.update_fills else P(v.unit, back=v.backward)
            v.slot, v.fill, v.previous = f"w{i}", fill, ring[i]
            ring[i] = v

    def emit(self, visits: list[_Visit], order: list[Task], blocks) -> None:
        s, k, M = self.spec, self.k, self.M
        wire_w, wire_g = k.wire_bytes("weight_wire"), k.wire_bytes("grad_wire")
        placement = k.optimizer
        gpu_layers = set(self.gpu_layers)
        state_slot = {u: f"s{i % k.state_buffers}" for i, u in enumerate(self.state_order)}

        def update_params(unit):
            # A tied head's lm_head is the embedding: its update is the embedding's.
            if unit == HEAD and s.tie_word_embeddings:
                return s.hidden_size
            return s.unit_params(unit)

        def add_gpu_update(unit: int, step_offset: int, fills: str | None = None) -> None:
            """S, U, W of a GPU update: master + m + v (+ gradients in the grad wire dtype, unless kept on the
            GPU) into a state slot, AdamW there, then master + m + v (+ the bf16 streaming copy) back."""
            n, slot = s.unit_params(unit), state_slot[unit]
            grads = 0 if unit in self.retained else wire_g  # widened to fp32 on the device
            self.add(S(unit), slot=slot, bytes=n * (12 + grads), params=n, flops=0.0, tokens=0,
                     step_offset=step_offset)
            extra = {"fills": fills} if fills else {}
            self.add(U(unit), device="gpu", step_offset=step_offset, slot=slot, weights=S(unit), params=n,
                     flops=0.0, bytes=0, tokens=0, **extra)
            shadow = 2 if k.weight_wire == "bf16" else 0
            self.add(W(unit), slot=slot, weights=S(unit), bytes=n * (12 + shadow), params=n, flops=0.0, tokens=0,
                     step_offset=step_offset)

        # Updates of the previous step's gradients come first in program order (overlap placements); a GPU
        # update comes where the PREFETCH of its layer's forward would (it fills that weight slot).
        if placement in ("overlap", "overlap-split"):
            for unit in s.units():
                if unit not in self.update_fills:
                    self.add(U(unit), device="cpu", step_offset=-1, params=update_params(unit), flops=0.0,
                             bytes=0, tokens=0)

        visit_of: dict[Task, _Visit] = {}
        for v in visits:
            for t in v.readers:
                visit_of[t] = v
        # PREFETCHes are emitted just before the first reader of their visit (a visit reusing a resident copy
        # has its fill already), activation prefetches just before the backward of their block.
        fills_at = {v.first: v for v in visits}
        block_start = {R(l0, 0) if l1 - l0 > 1 else B(l0, 0): l0 for l0, l1 in blocks}
        offload_after = {}  # position of a unit's last backward reader -> unit
        for v in visits:
            if v.backward:
                offload_after[v.last] = v.unit
        act = self.act_bytes()
        fill_order: dict[int, int] = {}  # unit -> program order of the fill of its forward visit
        for i, t in enumerate(order):
            v = visit_of[t]
            if i in fills_at and fills_at[i].fill is not None and fills_at[i].fill not in self.g:
                fv = fills_at[i]
                if not fv.backward:
                    fill_order[fv.unit] = self._order
                if fv.fill.kind is TaskKind.OPTIMIZER:
                    add_gpu_update(fv.unit, -1, fills=fv.slot)
                else:
                    self.add(fv.fill, slot=fv.slot, bytes=s.unit_params(fv.unit) * wire_w, flops=0.0, tokens=0,
                             params=s.unit_params(fv.unit))
            if t in block_start and block_start[t] in self.offloaded:
                for m in range(M):
                    self.add(Y(block_start[t], m), bytes=act, flops=0.0, tokens=0, params=0)
            self.add(t, slot=v.slot, weights=v.fill, **self.compute_work(t.kind, t.unit), **self.resident_attr(t.unit))
            # F(l-1) (F(E) for l = 0) produces layer l's input: offload it when l keeps a checkpoint.
            if t.kind is TaskKind.FORWARD and t.unit != HEAD and (t.unit + 1) in self.offloaded:
                self.add(X(t.unit + 1, t.micro), bytes=act, flops=0.0, tokens=0, params=0)
            if i in offload_after:
                unit = offload_after[i]
                if unit in self.resident:  # the norm of the gradients where they are; nothing moves
                    self.add(O(unit), slot=v.slot, weights=None, bytes=0, flops=0.0, tokens=0,
                             params=s.unit_params(unit), resident=True)
                elif unit in self.retained:  # a device-to-device copy into the layer's own gradient buffer
                    self.add(O(unit), slot=v.slot, weights=v.fill, fills=f"g{unit}", bytes=0, flops=0.0,
                             tokens=0, params=s.unit_params(unit))
                else:
                    self.add(O(unit), slot=v.slot, weights=v.fill, bytes=s.unit_params(unit) * wire_g, flops=0.0,
                             tokens=0, params=s.unit_params(unit))
                if placement in ARRIVAL_PLACEMENTS:  # the unit's update, as its gradients land
                    if unit in self.resident:
                        self.add(U(unit), device="gpu", step_offset=0, slot=v.slot, weights=None,
                                 params=s.unit_params(unit), flops=0.0, bytes=0, tokens=0, resident=True)
                    elif unit in gpu_layers:
                        add_gpu_update(unit, 0)
                    else:
                        self.add(U(unit), device="cpu", step_offset=0, params=update_params(unit), flops=0.0,
                                 bytes=0, tokens=0)
        # Clip norm and the updates that use this step's gradients.
        if k.clip == "exact":
            self.add(NORM, device="cpu", params=s.num_params, flops=0.0, bytes=0, tokens=0)
        if placement in ("after", "gpu", "split"):
            for unit in s.units():
                if unit in gpu_layers:
                    add_gpu_update(unit, 0)
                else:
                    self.add(U(unit), device="cpu", step_offset=0, params=update_params(unit), flops=0.0,
                             bytes=0, tokens=0)

        if placement in ARRIVAL_PLACEMENTS:
            self.order_arrival_updates(order, gpu_layers)
        # A state copy is queued on h2d ahead of the fills of the `state_lookahead` layers before its own: the
        # PREFETCHes of host-updated layers wait for their CPU update, and a copy queued behind them would idle
        # the link meanwhile.
        for layer in self.update_fills:
            ahead = layer - k.state_lookahead
            self.g.nodes[S(layer)]["order"] = fill_order[ahead if ahead >= 0 else EMBED] - 0.5 + layer * 1e-3
        self.connect(visits, order, blocks, gpu_layers)

    def resident_attr(self, unit: int) -> dict:
        return {"resident": True} if unit in self.resident else {}

    def order_arrival_updates(self, order: list[Task], gpu_layers: set[int]) -> None:
        """Arrival placements: where the GPU updates (resident units, "arrival-split" layers) sit in their queues.

        S(l) goes on h2d just before the backward fetch of layer l + 1 + state_lookahead, so master and moments
        stream in while the layers above run their backward; a GPU U goes on the compute stream after the next
        unit's backward has been issued (the update waits for its O, and the GPU should not idle meanwhile)."""
        g, L = self.g, self.spec.num_layers
        first_bwd, last_bwd = {}, {}  # unit -> program order of its first (layers) / last backward compute task
        for t in order:
            if t.kind is TaskKind.RECOMPUTE or t.kind is TaskKind.BACKWARD:
                if t.unit >= 0:
                    first_bwd.setdefault(t.unit, g.nodes[t]["order"])
                if t.kind is TaskKind.BACKWARD:
                    last_bwd[t.unit] = g.nodes[t]["order"]
        for unit in self.resident:  # the update on the compute stream, after the next backward has been issued
            nxt = {HEAD: L - 1, EMBED: None}.get(unit, unit - 1 if unit > 0 else EMBED)
            if nxt is None:
                continue  # the embedding's update is the last task of the step anyway
            if nxt not in last_bwd:  # HEAD of a model without layers
                continue
            g.nodes[U(unit)]["order"] = last_bwd[nxt] + 0.25
        for layer in gpu_layers:
            ahead = min(layer + 1 + self.k.state_lookahead, L - 1)
            fetch = P(ahead, back=True)
            at = g.nodes[fetch]["order"] if fetch in g else first_bwd[ahead]
            g.nodes[S(layer)]["order"] = at - 0.5 + layer * 1e-3
            below = layer - 1 if layer > 0 else EMBED
            g.nodes[U(layer)]["order"] = last_bwd[below] + 0.25
            g.nodes[W(layer)]["order"] = last_bwd[below] + 0.5

    def connect(self, visits, order, blocks, gpu_layers: set[int]) -> None:
        """Data, slot, accumulation, clipping and optimizer edges."""
        s, k, M, L = self.spec, self.k, self.M, self.spec.num_layers
        g = self.g
        # Weights into readers.
        for v in visits:
            for t in v.readers:
                if v.fill is not None:  # a resident unit's buffer is never filled within a step
                    self.edge(v.fill, t)
            # Refill only after the previous occupant's readers (and the offload of its gradients) are done.
            if v.previous is not None:
                prev = v.previous
                for reader in prev.readers:
                    self.edge(reader, v.fill, "slot")
                if prev.backward:
                    self.edge(O(prev.unit), v.fill, "slot")
        # Activations through the forward, loss, and gradients back down.
        chain = [EMBED, *range(L), HEAD]
        for m in range(M):
            for a, b in zip(chain, chain[1:]):
                self.edge(F(a, m), F(b, m))
        for l0, l1 in blocks:
            for m in range(M):
                # Layer l0's checkpointed input: the output of F(l0-1), via the host when offloaded.
                src = F(l0 - 1 if l0 else EMBED, m)
                if l0 in self.offloaded:
                    self.edge(src, X(l0, m))
                    self.edge(X(l0, m), Y(l0, m))
                    src = Y(l0, m)
                self.edge(src, B(l0, m))
                if l1 - l0 > 1:
                    self.edge(src, R(l0, m))
                for layer in range(l0, l1 - 1):  # recomputed inputs of the block's inner layers
                    if layer > l0:
                        self.edge(R(layer - 1, m), R(layer, m))
                    self.edge(R(layer, m), B(layer + 1, m))
        for m in range(M):
            top = HEAD
            for layer in reversed(range(L)):
                self.edge(F(top, m) if top == HEAD else B(top, m), B(layer, m))
                top = layer
            self.edge(B(0, m) if L else F(HEAD, m), B(EMBED, m))
        # Long context: bring a block's checkpoints back only once the block above has started its backward.
        prev_first = F(HEAD, 0)
        for l0, l1 in reversed(blocks):
            if l0 in self.offloaded:
                for m in range(M):
                    self.edge(prev_first, Y(l0, m), "slot")
            prev_first = R(l0, 0) if l1 - l0 > 1 else B(l0, 0)
        # Gradient accumulation over micro-batches into one buffer, then one offload per unit.
        for unit in s.units():
            producers = [F(HEAD, m) for m in range(M)] if unit == HEAD else [B(unit, m) for m in range(M)]
            for a, b in zip(producers, producers[1:]):
                self.edge(a, b, "accum")
            self.edge(producers[-1], O(unit))
        offloads = [O(u) for u in s.units()]
        if NORM in g:
            for o in offloads:
                self.edge(o, NORM, "clip")
        # Optimizer.
        for t in [t for t in g.nodes if t.kind is TaskKind.OPTIMIZER]:
            u = t.unit
            if g.nodes[t]["step_offset"] == -1 and u in gpu_layers:
                # "overlap-split": the update fills the forward's weight slot (visit edges); a backward that
                # fetches the layer again streams the copy W brought back.
                self.edge(S(u), t)
                self.edge(t, W(u))
                self.edge(t, O(u), "state")  # read the old gradients before this step's are offloaded
                if P(u, back=True) in g:
                    self.edge(W(u), P(u, back=True), "state")
            elif g.nodes[t]["step_offset"] == -1:
                self.edge(t, P(u), "state")  # stream the weights only once they are updated
                self.edge(t, O(u), "state")  # read the old gradients before this step's land
            elif u in gpu_layers:
                # The update reads gradients that O landed on the host (and S brings back), or that O copied
                # into the layer's own GPU buffer (kept gradients: S carries master and moments only).
                self.edge(O(u), t if u in self.retained else S(u))
                self.edge(S(u), t)
                self.edge(t, W(u))
                if NORM in g:
                    self.edge(NORM, t, "clip")
            else:
                self.edge(O(u), t)
                if NORM in g:
                    self.edge(NORM, t, "clip")
        if s.tie_word_embeddings:
            # The head's lm_head gradient is added into the embedding's before its update, and the head's
            # streaming copy of the shared matrix is refreshed after it.
            if g.nodes[U(EMBED)]["step_offset"] == 0:
                self.edge(O(HEAD), U(EMBED))
            self.edge(U(EMBED), U(HEAD), "state")
        # State slot ring for GPU updates: refill a state slot only after its previous W.
        for a, b in zip(self.state_order, self.state_order[k.state_buffers:]):
            self.edge(W(a), S(b), "slot")


def build_schedule(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs | str = DEFAULT_SCHEDULE,
                   validate: bool = True) -> Schedule:
    """Build and (by default) validate the DAG of one training step."""
    name = knobs if isinstance(knobs, str) else "custom"
    if isinstance(knobs, str):
        knobs = knobs_for(knobs)
    if batch < 1 or seq < 1:
        raise ScheduleError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    sched = _Builder(spec, batch, seq, knobs).build()
    sched.name = name
    if validate:
        sched.validate()
    return sched


def gpu_slot_bytes(spec: ModelSpec, knobs: ScheduleKnobs) -> dict[str, int]:
    """Bytes of each GPU buffer: weights in the wire dtype plus an fp32 gradient area (fp32 accumulation)."""
    w = knobs.wire_bytes("weight_wire")

    def unit_bytes(unit):
        return spec.unit_params(unit) * (w + 4)

    sizes = {f"w{i}": unit_bytes(0) for i in range(knobs.buffers)}
    sizes["embed"] = unit_bytes(EMBED)
    sizes["head"] = unit_bytes(HEAD)
    gpu = gpu_updated_layers(spec, knobs)
    if gpu:
        # master, m, v and gradient (or the staged streaming copy), fp32
        for i in range(min(knobs.state_buffers, len(gpu))):
            sizes[f"s{i}"] = spec.layer_params * 16
    for layer in retained_grad_layers(spec, knobs):
        sizes[f"g{layer}"] = spec.layer_params * 4
    for unit in resident_units(spec, knobs):  # fp32 master, m, v, gradient (replaces a streamed embed/head buffer)
        sizes[resident_slot(unit)] = spec.unit_params(unit) * 16
    return sizes


def resident_slot(unit: int) -> str:
    """The GPU buffer of a resident unit: "embed" / "head" (as when streamed), "r<layer>" for a layer."""
    return "embed" if unit == EMBED else "head" if unit == HEAD else f"r{unit}"
