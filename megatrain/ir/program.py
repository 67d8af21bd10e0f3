"""Program: a schedule lowered onto streams, the one thing both the simulator and the executor interpret.

`lower()` makes every policy decision a DAG leaves open: which stream each task runs on, the order of each
stream's queue (a CUDA stream is in-order, so a task enqueued early blocks those behind it), which tasks of
other streams it waits for, and the GPU memory the run needs. Interpreters only follow it.

Streams: "h2d" (host -> GPU copies), "compute" (GPU kernels), "d2h" (GPU -> host copies), "cpu" (host threads).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import networkx as nx

from ..spec import ModelSpec
from .builders import gpu_slot_bytes
from .dag import Schedule
from .knobs import ScheduleKnobs, offloaded_checkpoints
from .tasks import Task, TaskKind

STREAMS = ("h2d", "compute", "d2h", "cpu")

_STREAM_OF_KIND = {
    TaskKind.PREFETCH: "h2d",
    TaskKind.STATE_PREFETCH: "h2d",
    TaskKind.ACT_PREFETCH: "h2d",
    TaskKind.FORWARD: "compute",
    TaskKind.RECOMPUTE: "compute",
    TaskKind.BACKWARD: "compute",
    TaskKind.OFFLOAD: "d2h",
    TaskKind.STATE_OFFLOAD: "d2h",
    TaskKind.ACT_OFFLOAD: "d2h",
    TaskKind.CLIP_NORM: "cpu",
}


@dataclass(frozen=True)
class ProgramTask:
    """One task as the interpreters see it. `waits` are tasks of *other* streams that must finish first."""

    id: str
    kind: str  # TaskKind value: "P", "F", ...
    unit: int | None
    micro: int | None
    stream: str
    waits: tuple[str, ...]
    slot: str | None
    bytes: int
    flops: float
    tokens: int
    params: int
    step_offset: int = 0
    fills: str | None = None  # a buffer the task writes besides `slot` (GPU update -> weight slot, kept gradients)

    @property
    def task(self) -> Task:
        return Task.parse(self.id)


@dataclass(frozen=True)
class GpuMemoryPlan:
    """GPU bytes the Program needs: buffers (slots), checkpoints, the working set of one task, head logits."""

    slot_bytes: dict[str, int]
    checkpoint_bytes: int
    working_bytes: int
    logits_bytes: int

    @property
    def buffers_bytes(self) -> int:
        return sum(self.slot_bytes.values())

    @property
    def peak_bytes(self) -> int:
        return self.buffers_bytes + self.checkpoint_bytes + max(self.working_bytes, self.logits_bytes)


@dataclass
class Program:
    """Per-stream ordered queues of tasks, their cross-stream waits and the GPU memory plan."""

    model: ModelSpec
    batch: int
    seq: int
    knobs: ScheduleKnobs
    name: str
    tasks: dict[str, ProgramTask]
    streams: dict[str, list[str]]
    memory: GpuMemoryPlan
    _index: dict[str, tuple[str, int]] = field(default=None, repr=False, compare=False)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def position(self, task_id: str) -> tuple[str, int]:
        """(stream, index in that stream's queue) of a task."""
        if self._index is None:
            self._index = {t: (s, i) for s, q in self.streams.items() for i, t in enumerate(q)}
        return self._index[task_id]

    def ordered(self) -> list[ProgramTask]:
        """All tasks, stream by stream, in queue order."""
        return [self.tasks[t] for s in STREAMS for t in self.streams[s]]

    # -- JSON --
    def to_dict(self) -> dict:
        return {
            "format": "megatrain.ir.program/1",
            "name": self.name,
            "model": self.model.to_dict(),
            "batch": self.batch,
            "seq": self.seq,
            "knobs": self.knobs.to_dict(),
            "streams": self.streams,
            "tasks": [asdict(self.tasks[t]) for s in STREAMS for t in self.streams[s]],
            "memory": asdict(self.memory),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> Program:
        if d.get("format") != "megatrain.ir.program/1":
            raise ValueError(f"not a megatrain Program (format={d.get('format')!r})")
        tasks = {}
        for t in d["tasks"]:
            t = dict(t)
            t["waits"] = tuple(t["waits"])
            tasks[t["id"]] = ProgramTask(**t)
        return cls(
            model=ModelSpec.from_dict(d["model"]),
            batch=d["batch"],
            seq=d["seq"],
            knobs=ScheduleKnobs.from_dict(d["knobs"]),
            name=d["name"],
            tasks=tasks,
            streams={s: list(d["streams"][s]) for s in STREAMS},
            memory=GpuMemoryPlan(**d["memory"]),
        )

    @classmethod
    def from_json(cls, text: str) -> Program:
        return cls.from_dict(json.loads(text))


def stream_of(schedule: Schedule, task: Task) -> str:
    if task.kind is TaskKind.OPTIMIZER:
        return "compute" if schedule.attrs(task).get("device") == "gpu" else "cpu"
    return _STREAM_OF_KIND[task.kind]


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
    for t in topo:
        pos[t] = len(queues[stream[t]])
        queues[stream[t]].append(t.id)

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
    return Program(
        model=schedule.spec,
        batch=schedule.batch,
        seq=schedule.seq,
        knobs=schedule.knobs,
        name=schedule.name,
        tasks=tasks,
        streams=queues,
        memory=plan_gpu_memory(schedule.spec, schedule.batch, schedule.seq, schedule.knobs),
    )


def plan_gpu_memory(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs) -> GpuMemoryPlan:
    """GPU bytes of a step: the buffers, the checkpointed activations, and the larger of a layer's working set
    and the head's logits chunk.

    - checkpoints: the input of every r-th layer for every micro-batch, in the compute dtype; with
      `offload_checkpoints` only two blocks' worth of the offloaded ones stay on the GPU, plus the
      `gpu_checkpoints` kept there;
    - working set of a layer's recompute + backward (per micro-batch, r layers deep): inputs of the norms,
      q/k/v, attention output, the MLP's gate/up/activation, and the gradient flowing down (estimated from the
      tensors autograd saves; the measured peak is the check);
    - head: fp32 logits, their softmax and gradient for one chunk of `loss_chunk_tokens` tokens.
    """
    act = knobs.wire_bytes("compute_dtype")
    mb = batch // knobs.micro_batches
    tokens_mb = mb * seq
    d, f = spec.hidden_size, spec.intermediate_size
    r = knobs.recompute_block
    n_checkpoints = -(-spec.num_layers // r)
    if knobs.offload_checkpoints:  # two offloaded blocks' worth in flight, plus those kept on the GPU
        offloaded = len(offloaded_checkpoints(spec, knobs))
        n_checkpoints = min(offloaded, 2) + (n_checkpoints - offloaded)
    checkpoint = n_checkpoints * knobs.micro_batches * tokens_mb * d * act
    per_layer_saved = tokens_mb * (6 * d + 2 * (spec.q_dim + spec.kv_dim) + 4 * f) * act
    working = r * per_layer_saved + 2 * tokens_mb * d * 4  # + fp32 activation gradient in and out
    chunk = min(knobs.loss_chunk_tokens, tokens_mb)
    logits = 3 * chunk * spec.vocab_size * 4
    return GpuMemoryPlan(gpu_slot_bytes(spec, knobs), checkpoint, working, logits)
