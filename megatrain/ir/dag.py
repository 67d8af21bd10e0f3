"""A training step as a DAG of tasks, and the validator that proves it safe to run.

A `Schedule` is a `networkx.DiGraph` whose nodes are `Task`s. Node attributes:

    order   int    the program order, 0..n-1 (lowering breaks ties with it; `builders.order_queues` sets it)
    device  str    "gpu" or "cpu": where the task runs (OPTIMIZER may be either)
    slot    str    GPU buffer the task reads or fills ("w0".."w{k-1}" ring, "embed", "head", "s0".."s{n-1}" state)
    fills   str    a buffer a non-copy task fills besides reading `slot`: a GPU update of "overlap-split" writes
                   the new weights into the layer's weight slot; an OFFLOAD that keeps the gradients on the GPU
                   copies them into the layer's own buffer "g<layer>"
    weights Task   for compute tasks: the PREFETCH whose copy of the weights it reads (None when `resident`)
    resident bool  the task's unit lives in its GPU buffer for the whole run (a GPU_RESIDENT unit of the
                   placement): nothing fills or evicts that buffer within a step
    step_offset int  OPTIMIZER (and its S, W): 0 = updates with this step's gradients, -1 = with the previous step's
    bytes, flops, tokens, params   the work, for the simulator's cost model

Edge attribute `why`: "data" (a value flows), "slot" (a buffer is refilled only after its readers are done),
"accum" (gradient accumulation into one buffer), "clip" (the global norm needs every gradient), "state",
"ring" (a gradient ring tile is landed into only after the previous unit's gradients in it were read).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import networkx as nx

from megatrain.model.spec import ModelSpec
from megatrain.ir.tasks import COMPUTE_KINDS, Task, TaskKind


class ScheduleError(ValueError):
    """A schedule that cannot run correctly; the message shows the offending region."""


@dataclass
class Schedule:
    """The DAG of one training step plus what it was built from."""

    graph: nx.DiGraph
    spec: ModelSpec
    batch: int
    seq: int
    knobs: "object"  # ScheduleKnobs the placement was resolved from (display only; None for a hand-made placement)
    name: str = "custom"
    placement: "object" = None  # the Placement the builders built it from (megatrain/ir/placement.py)
    _ordered: list[Task] | None = field(default=None, repr=False)

    def tasks(self) -> list[Task]:
        """Tasks in the builder's program order."""
        if self._ordered is None:
            self._ordered = sorted(self.graph.nodes, key=lambda t: self.graph.nodes[t]["order"])
        return self._ordered

    def __len__(self) -> int:
        return self.graph.number_of_nodes()

    def attrs(self, task: Task) -> dict:
        return self.graph.nodes[task]

    def count(self, kind: TaskKind) -> int:
        return sum(1 for t in self.graph.nodes if t.kind is kind)

    def listing(self, tasks: Iterable[Task] | None = None, mark: Iterable[Task] = ()) -> str:
        """One line per task in program order: `F3.1 <- F2.1 P3`; marked tasks get `>>`. Golden-file format."""
        marked = set(mark)
        lines = []
        for t in tasks if tasks is not None else self.tasks():
            preds = " ".join(sorted(p.id for p in self.graph.predecessors(t)))
            prefix = ">> " if t in marked else "   "
            slot, fills = self.graph.nodes[t].get("slot"), self.graph.nodes[t].get("fills")
            where = f" [{slot}]" if slot and t.kind is TaskKind.PREFETCH else f" [{slot}->{fills}]" if fills else ""
            lines.append(f"{prefix}{t.id}{where}" + (f" <- {preds}" if preds else ""))
        return "\n".join(lines)

    def region(self, around: Iterable[Task], context: int = 3) -> str:
        """The listing of the tasks near `around` (in program order), those marked, for error messages."""
        around = list(around)
        order = self.tasks()
        index = {t: i for i, t in enumerate(order)}
        keep = set()
        for t in around:
            if t in index:
                keep.update(range(max(0, index[t] - context), min(len(order), index[t] + context + 1)))
        chosen, last, lines = sorted(keep), None, []
        for i in chosen:
            if last is not None and i != last + 1:
                lines.append("   ...")
            lines.append(self.listing([order[i]], mark=around))
            last = i
        return "\n".join(lines)

    def validate(self) -> None:
        validate(self)


# ---- validator --------------------------------------------------------------------------------------------------
def filled_slot(g: nx.DiGraph, task: Task) -> str | None:
    """The buffer `task` fills: a PREFETCH's / STATE_PREFETCH's slot, or any task's `fills` attribute."""
    a = g.nodes[task]
    if task.kind in (TaskKind.PREFETCH, TaskKind.STATE_PREFETCH):
        return a.get("slot")
    return a.get("fills")


def _fail(schedule: Schedule, message: str, tasks: Iterable[Task]) -> None:
    tasks = list(tasks)
    raise ScheduleError(f"{message}\n{schedule.region(tasks)}")


def validate(schedule: Schedule) -> None:
    """Check that the schedule can run correctly under every execution order its edges allow.

    - the graph is acyclic;
    - every compute task reads weights that a PREFETCH (or a GPU update that `fills` the slot) put into its slot
      before it (an ancestor), and the next fill of that slot is a descendant of the reader (the slot is not
      refilled under it);
    - a PREFETCH of a layer after that layer's GPU update comes after the STATE_OFFLOAD that brings the updated
      weights back to the host;
    - every OFFLOAD of a gradient buffer finishes before that buffer's slot is refilled;
    - with a gradient ring, an OFFLOAD into a ring tile waits for the readers of the tile's previous unit;
    - every optimizer update that uses this step's gradients comes after their OFFLOAD (and after the global norm
      when clipping is exact); an update of the previous step's gradients comes before this step's OFFLOAD
      overwrites them and before the PREFETCH that streams the updated weights.
    """
    g = schedule.graph
    if not nx.is_directed_acyclic_graph(g):
        cycle = [u for u, _ in nx.find_cycle(g)]
        _fail(schedule, "the schedule has a cycle: " + " -> ".join(t.id for t in cycle + cycle[:1]), cycle)

    topo = {t: i for i, t in enumerate(nx.topological_sort(g))}

    def before(a: Task, b: Task) -> bool:
        return g.has_edge(a, b) or (topo[a] < topo[b] and nx.has_path(g, a, b))

    # Fills of each slot (prefetches, and tasks that write a buffer besides the one they read), in topological order.
    fills: dict[str, list[Task]] = {}
    for t in g.nodes:
        where = filled_slot(g, t)
        if where is not None:
            fills.setdefault(where, []).append(t)
    for lst in fills.values():
        lst.sort(key=topo.__getitem__)
    next_fill = {p: lst[i + 1] if i + 1 < len(lst) else None for lst in fills.values() for i, p in enumerate(lst)}

    for t in g.nodes:
        a = g.nodes[t]
        if a.get("resident"):  # a buffer that holds its unit for the whole run: never filled, never evicted
            continue
        if t.kind in COMPUTE_KINDS or t.kind in (TaskKind.OFFLOAD, TaskKind.STATE_OFFLOAD, TaskKind.ALL_GATHER,
                                                 TaskKind.REDUCE_SCATTER) or (
            t.kind is TaskKind.OPTIMIZER and a.get("device") == "gpu"
        ):
            src = a.get("weights")
            if src is None:
                _fail(schedule, f"{t.id} reads a GPU buffer but no PREFETCH fills it", [t])
            if src not in g or filled_slot(g, src) != a.get("slot"):
                _fail(schedule, f"{t.id} reads slot {a.get('slot')} but its weights come from {src}", [t, src])
            if not before(src, t):
                _fail(schedule, f"{t.id} may start before {src.id} has filled slot {a['slot']}", [src, t])
            nxt = next_fill.get(src)
            if nxt is not None and not before(t, nxt):
                _fail(
                    schedule,
                    f"slot {a['slot']} may be refilled by {nxt.id} while {t.id} still reads it "
                    f"(add an edge {t.id} -> {nxt.id} or more buffers)",
                    [t, nxt],
                )

    # A copy streamed from the host after a GPU update must wait for the update to be written back.
    for t in g.nodes:
        if t.kind is not TaskKind.OPTIMIZER or g.nodes[t].get("device") != "gpu":
            continue
        back = next((w for w in g.successors(t) if w.kind is TaskKind.STATE_OFFLOAD and w.unit == t.unit), None)
        for p in g.nodes:
            if p.kind is TaskKind.PREFETCH and p.unit == t.unit and before(t, p) and (back is None or
                                                                                   not before(back, p)):
                _fail(schedule, f"{p.id} streams layer {t.unit} from the host after its GPU update {t.id}, but may "
                      f"start before {back.id if back else 'a STATE_OFFLOAD'} has brought the new weights back",
                      [t, p] + ([back] if back else []))

    norm = next((t for t in g.nodes if t.kind is TaskKind.CLIP_NORM), None)
    offloads = {t.unit: t for t in g.nodes if t.kind is TaskKind.OFFLOAD}
    redos = {t.unit: t for t in g.nodes if t.kind is TaskKind.CLIP_REDO}  # speculative clipping (CLIP_REDO)
    copies_in: dict[int, list[Task]] = {}  # a unit's PREFETCHes and STATE_PREFETCHes: what a next-step redo precedes
    for t in g.nodes:
        if t.kind in (TaskKind.PREFETCH, TaskKind.STATE_PREFETCH):
            copies_in.setdefault(t.unit, []).append(t)
    for t in g.nodes:
        if t.kind is not TaskKind.OPTIMIZER:
            continue
        off = offloads.get(t.unit)
        if off is None:
            _fail(schedule, f"{t.id} updates unit {t.unit} whose gradients are never offloaded", [t])
        if g.nodes[t].get("step_offset", 0) == 0:
            if not before(off, t):
                _fail(schedule, f"{t.id} may run before {off.id} has brought its gradients to the host", [off, t])
            redo = redos.get(t.unit)
            if redo is not None and g.nodes[redo].get("step_offset", 0) == -1:
                # the redo of the last step's update, in this step (the step boundary puts it after that step's
                # norm and update): before the gradients it reads are overwritten and the copies of what it changes
                late = [r for r in [off, *copies_in.get(t.unit, [])] if not before(redo, r)]
                if norm is None or late:
                    _fail(schedule, f"{redo.id} redoes the last step's update of unit {t.unit} in this step, but "
                          + (f"{late[0].id} may run before it" if late else "the step takes no global norm"),
                          [redo] + late[:1])
            elif redos and (redo is None or norm is None or not before(t, redo) or not before(norm, redo)):
                _fail(schedule, f"{t.id} runs before the global gradient norm is known, but no CLIP_REDO after both "
                      f"it and the norm fixes it up (speculative clipping)", [t] + ([redo] if redo else []))
            if not redos and norm is not None and not before(norm, t):
                _fail(schedule, f"{t.id} may run before the global gradient norm {norm.id} (exact clipping)",
                      [norm, t])
        else:
            if not before(t, off):
                _fail(schedule, f"{t.id} reads the previous step's gradients but {off.id} may overwrite them first",
                      [t, off])
            first = next((p for p in g.successors(t) if p.kind is TaskKind.PREFETCH), None)
            if first is None and not g.nodes[t].get("fills") and schedule.spec is not None:
                _fail(schedule, f"{t.id} updates weights that no PREFETCH waits for", [t])
    _validate_gradient_ring(schedule, before)
    if norm is not None:
        missing = [o for o in offloads.values() if not before(o, norm)]
        if missing:
            _fail(schedule, f"the global norm {norm.id} may be taken before " + ", ".join(o.id for o in missing),
                  [norm, *missing])


def _validate_gradient_ring(schedule: Schedule, before) -> None:
    """Gradient ring (Placement.ring_tiles): an OFFLOAD into a ring tile comes after every reader of the tile's
    previous unit (its update, its state copy, the tied embedding's update)."""
    p = schedule.placement
    if p is None or not getattr(p, "ring_tiles", ()):
        return
    g, previous = schedule.graph, {}
    for unit, tile in p.ring_tiles:
        off = next(t for t in g.nodes if t.kind is TaskKind.OFFLOAD and t.unit == unit)
        for reader in p.landing_readers(previous[tile]) if tile in previous else []:
            if reader not in g or not before(reader, off):
                _fail(schedule, f"{off.id} lands gradients in ring tile {tile} while {reader.id} may still read the "
                      f"gradients of the tile's previous unit (add an edge {reader.id} -> {off.id})",
                      [t for t in (reader, off) if t in g])
        previous[tile] = unit
