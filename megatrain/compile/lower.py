"""lower(): a schedule placed on streams. Every decision a DAG leaves open is made here: the stream of each task, the
order of each stream's queue (a CUDA stream is in-order, so a task enqueued early blocks those behind it), which
tasks of other streams it waits for, and the GPU memory plan the Program carries."""
from __future__ import annotations

import networkx as nx

from megatrain.compile.strategies import strategy_of
from megatrain.ir.dag import Schedule, ScheduleError
from megatrain.ir.program import Program, ProgramTask
from megatrain.ir.streams import COPY_STREAMS, OPTIONAL_STREAMS, STREAMS
from megatrain.ir.tasks import Task
from megatrain.plan.memory import plan_gpu_memory


def stream_of(schedule: Schedule, task: Task) -> str:
    """The stream a task runs on: by kind (an update: by its device), or the copy stream the schedule names."""
    attrs = schedule.attrs(task)
    default = task.kind.stream_on(attrs.get("device"))
    chosen = attrs.get("stream", default)
    if chosen != default and not (task.kind.copy and chosen in COPY_STREAMS):
        raise ScheduleError(f"{task.id} is set to run on stream {chosen!r}; a {task.kind.name} runs on {default!r}"
                            " (only copies move, between the h2d and d2h streams)")
    return chosen


def lower(schedule: Schedule) -> Program:
    """Place the schedule's tasks on streams, order each stream, derive the waits and the memory plan.

    Each stream's queue follows one topological order of the DAG that breaks ties by the builder's program
    order, so the result is deterministic. A wait on another stream's task is kept only for the latest task of
    that stream a task depends on: streams are in-order, so the earlier ones are implied.
    """
    g = schedule.graph
    topo = list(nx.lexicographical_topological_sort(g, key=lambda t: (g.nodes[t]["order"], t.id)))
    stream = {t: stream_of(schedule, t) for t in topo}
    queues: dict[str, list[str]] = {s: [] for s in STREAMS}
    pos: dict[Task, int] = {}
    by_stream: dict[str, list[Task]] = {s: [] for s in STREAMS}
    for t in topo:
        by_stream[stream[t]].append(t)
    strategy = strategy_of(schedule.placement) if schedule.placement is not None else None
    if strategy is not None and by_stream.get("comm"):  # data parallel: the strategy orders its collectives
        by_stream["comm"] = strategy.order_comm(g, by_stream)
    for s, q in by_stream.items():
        for t in q:
            pos[t] = len(queues[s])
            queues[s].append(t.id)

    for s in OPTIONAL_STREAMS:
        if not queues[s]:
            del queues[s]
    tasks = {}
    for t in topo:
        latest: dict[str, Task] = {}
        for p in g.predecessors(t):
            s = stream[p]
            if s != stream[t] and (s not in latest or pos[p] > pos[latest[s]]):
                latest[s] = p
        a = g.nodes[t]
        tasks[t.id] = ProgramTask(
            id=t.id,
            kind=t.kind.value,
            unit=t.unit,
            micro=t.micro,
            stream=stream[t],
            waits=tuple(sorted(p.id for p in latest.values())),
            slot=a.get("slot"),
            bytes=int(a.get("bytes", 0)),
            flops=float(a.get("flops", 0.0)),
            tokens=int(a.get("tokens", 0)),
            params=int(a.get("params", 0)),
            step_offset=int(a.get("step_offset", 0)),
            fills=a.get("fills"),
        )
    placement = schedule.placement
    knobs = schedule.knobs.to_dict() if schedule.knobs is not None else None
    return Program(placement=placement, name=schedule.name, tasks=tasks, streams=queues,
                   memory=plan_gpu_memory(placement), knobs=knobs)
