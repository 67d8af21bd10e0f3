"""Editing a schedule by hand: networkx operations on a built schedule, then validate, lower, simulate and run it.

    sched = build_schedule(spec, 8, 2048, "overlap")
    add_dependency(sched, "F2.0", "U3")              # U3 may start only once layer 2's forward is done
    move_to_stream(sched, "X4.0", "h2d")             # a copy queued on the other copy stream
    deeper = with_ring_buffers(sched, 4)             # a placement change (4 weight slots): the DAG is rebuilt
    sched.validate()                                 # ScheduleError with the offending region marked
    program = lower(sched)                           # then simulate(program, profile) / trainer.use_program(program)
    save_schedule(sched, "mine.json"); sched = load_schedule("mine.json")

The graph is a `networkx.DiGraph` of `Task`s (`sched.graph`), so any networkx operation works; these helpers take
task ids as text and keep the node attributes lowering reads consistent. A saved schedule is plain JSON (the
placement, the nodes with their attributes, the edges), readable and diffable.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import networkx as nx

from megatrain.model.spec import ModelSpec
from megatrain.compile.builders import build_from_placement
from megatrain.ir.dag import Schedule, ScheduleError
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.ir.placement import Placement, gpu_buffers
from megatrain.ir.tasks import Task

FORMAT = "megatrain.schedule/1"


def _task(sched: Schedule, task: Task | str) -> Task:
    t = Task.parse(task) if isinstance(task, str) else task
    if t not in sched.graph:
        raise ScheduleError(f"{t.id} is not a task of this schedule")
    return t


def add_dependency(sched: Schedule, before: Task | str, after: Task | str, why: str = "data") -> None:
    """`after` may start only once `before` is done (an edge of the DAG; lowering turns it into a wait)."""
    a, b = _task(sched, before), _task(sched, after)
    sched.graph.add_edge(a, b, why=why)
    if not nx.is_directed_acyclic_graph(sched.graph):
        sched.graph.remove_edge(a, b)
        raise ScheduleError(f"{a.id} -> {b.id} would close a cycle: {b.id} already comes before {a.id}")


def move_to_stream(sched: Schedule, task: Task | str, stream: str) -> None:
    """Queue a copy on the other copy stream ("h2d" or "d2h"); its bytes still go the same way (lowering refuses
    moves of any other task)."""
    sched.graph.nodes[_task(sched, task)]["stream"] = stream


def with_ring_buffers(sched: Schedule, buffers: int) -> Schedule:
    """The same step with `buffers` GPU weight slots: a placement change, so the DAG is built again (edits made
    to `sched` by hand are not carried over: make them on the result)."""
    p = sched.placement
    L = p.model.num_layers
    if not p.recompute_block <= buffers <= max(L, 1):
        raise ScheduleError(f"buffers={buffers}: the ring must hold a recompute block ({p.recompute_block}) and "
                            f"at most one slot per layer ({L})")
    changed = dataclasses.replace(p, ring_buffers=buffers)
    object.__setattr__(changed, "buffers", gpu_buffers(changed))
    knobs = dataclasses.replace(sched.knobs, buffers=buffers) if sched.knobs is not None else None
    return build_from_placement(changed, knobs, f"{sched.name}[buffers={buffers}]")


# ---- save / load ------------------------------------------------------------------------------------------------
def schedule_to_dict(sched: Schedule) -> dict:
    def attrs(a: dict) -> dict:
        return {k: (v.id if isinstance(v, Task) else v) for k, v in sorted(a.items())}

    g = sched.graph
    return {
        "format": FORMAT, "name": sched.name, "model": sched.spec.to_dict(), "batch": sched.batch, "seq": sched.seq,
        "knobs": sched.knobs.to_dict() if sched.knobs is not None else None,
        "placement": sched.placement.to_dict(),
        "tasks": [{"id": t.id, **attrs(g.nodes[t])} for t in sched.tasks()],
        "edges": sorted([a.id, b.id, g.edges[a, b].get("why", "data")] for a, b in g.edges),
    }


def schedule_from_dict(d: dict) -> Schedule:
    if d.get("format") != FORMAT:
        raise ScheduleError(f"not a saved megatrain schedule (format={d.get('format')!r}, expected {FORMAT})")
    spec = ModelSpec.from_dict(d["model"])
    placement = Placement.from_dict(d["placement"], spec, d["batch"], d["seq"])
    g = nx.DiGraph()
    for row in d["tasks"]:
        row = dict(row)
        task = Task.parse(row.pop("id"))
        if row.get("weights") is not None:
            row["weights"] = Task.parse(row["weights"])
        g.add_node(task, **row)
    for a, b, why in d["edges"]:
        g.add_edge(Task.parse(a), Task.parse(b), why=why)
    knobs = ScheduleKnobs.from_dict(d["knobs"]) if d.get("knobs") is not None else None
    return Schedule(g, spec, d["batch"], d["seq"], knobs, d["name"], placement=placement)


def save_schedule(sched: Schedule, path: str | Path) -> Path:
    """Write the schedule as JSON (placement, tasks with their attributes, edges)."""
    path = Path(path)
    path.write_text(json.dumps(schedule_to_dict(sched), indent=1) + "\n")
    return path


def load_schedule(path: str | Path, validate: bool = True) -> Schedule:
    """Read a schedule `save_schedule` wrote (and, by default, validate it)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ScheduleError(f"cannot read schedule {path}: {e}") from None
    sched = schedule_from_dict(d)
    if validate:
        sched.validate()
    return sched
