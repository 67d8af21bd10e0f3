"""Program: a schedule lowered onto streams, the one thing the simulator, the executor and the memory planner read.

`lower()` makes every decision a DAG leaves open: which stream each task runs on, the order of each stream's queue
(a CUDA stream is in-order, so a task enqueued early blocks those behind it), which tasks of other streams it waits
for, and the GPU memory the run needs. It copies the schedule's Placement (what lives where, the typed buffer table,
wires, kernel, clipping) into the Program, so interpreters follow the Program and read nothing upstream of it.

Streams (defined in ir/streams.py): "h2d" (host -> GPU copies), "compute" (GPU kernels), "d2h" (GPU -> host
copies), "cpu" (host threads), "comm" (collectives between data-parallel ranks; a Program has it only with world > 1).
Each task kind's stream is part of its definition (ir/tasks.py, TaskKind.stream).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from megatrain.model.spec import ModelSpec
from megatrain.ir.dag import Schedule, ScheduleError
from megatrain.ir.placement import OfPlacement, Placement
from megatrain.ir.streams import OPTIONAL_STREAMS, STREAMS  # noqa: F401  (re-exported: defined in ir/streams.py)
from megatrain.ir.tasks import Task

FORMAT = "megatrain.program/2"


@dataclass(frozen=True)
class GpuMemoryPlan:
    """GPU bytes a Program needs: its buffers (by name), checkpoints, the working set of one task, head logits,
    and the RoPE tables of the step."""

    slot_bytes: dict[str, int]
    checkpoint_bytes: int
    working_bytes: int  # the layer phase: the peak of one layer's recompute + backward (`layer_working_set`)
    logits_bytes: int  # the head phase: fused head + loss (`head_working_set`)
    rope_bytes: int = 0  # cos and sin, (seq, head_dim) each in the compute dtype, for the whole step
    graph_bytes: int = 0  # forward graphs kept to the backward (knob keep_activations: `layer_graph_bytes`)

    @property
    def buffers_bytes(self) -> int:
        return sum(self.slot_bytes.values())

    def to_dict(self) -> dict:
        """The fields as JSON; `graph_bytes` only when there are any, so that the JSON (and fingerprint) of a
        Program without kept graphs is what it was before the field."""
        return {k: v for k, v in asdict(self).items() if k != "graph_bytes" or v}

    @property
    def peak_bytes(self) -> int:
        return (self.buffers_bytes + self.checkpoint_bytes + self.rope_bytes + self.graph_bytes
                + max(self.working_bytes, self.logits_bytes))


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


@dataclass
class Program(OfPlacement):
    """Per-stream ordered queues of tasks, their cross-stream waits and the GPU memory plan."""

    placement: Placement
    name: str
    tasks: dict[str, ProgramTask]
    streams: dict[str, list[str]]
    memory: GpuMemoryPlan
    knobs: dict | None = None  # the schedule knobs it was built from, for display only (interpreters never read it)
    _index: dict[str, tuple[str, int]] = field(default=None, repr=False, compare=False)

    @property
    def stream_names(self) -> list[str]:
        """The streams this Program has, in STREAMS order."""
        return [s for s in STREAMS if s in self.streams]

    def position(self, task_id: str) -> tuple[str, int]:
        """(stream, index in that stream's queue) of a task."""
        if self._index is None:
            self._index = {t: (s, i) for s, q in self.streams.items() for i, t in enumerate(q)}
        return self._index[task_id]

    def listing(self) -> str:
        """The placement, then each stream's queue with the tasks of other streams each task waits for:
        `F3.0 [w1] <- P3`. Golden-file format."""
        lines = self.placement.describe().split("\n")
        for s in self.stream_names:
            lines.append(f"{s}:")
            for tid in self.streams[s]:
                t = self.tasks[tid]
                where = f" [{t.slot}->{t.fills}]" if t.fills else f" [{t.slot}]" if t.slot else ""
                lines.append(f"   {tid}{where}" + (f" <- {' '.join(t.waits)}" if t.waits else ""))
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """SHA-256 (hex) of what the interpreters run: every stream's queue, every task (kind, unit, waits, slot,
        bytes, FLOPs, ...) and the GPU memory plan; the definition tests/golden/program_hashes.json pins. Placement
        settings that change no task (the layer kernel, the hosts of a multi-host run) are not in it: a result
        records those with its knobs (megatrain/compile/record.py)."""
        d = {"tasks": [asdict(self.tasks[t]) for s in self.streams for t in self.streams[s]],
             "streams": self.streams, "memory": self.memory.to_dict()}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    # -- JSON --
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "model": self.model.to_dict(),
            "batch": self.batch,
            "seq": self.seq,
            "placement": self.placement.to_dict(),
            "knobs": self.knobs,
            "streams": self.streams,
            "tasks": [asdict(self.tasks[t]) for s in self.stream_names for t in self.streams[s]],
            "memory": self.memory.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> Program:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a megatrain Program of {FORMAT} (format={d.get('format')!r}); format 1 carries "
                             "no placement: lower its schedule again")
        tasks = {}
        for t in d["tasks"]:
            t = dict(t)
            t["waits"] = tuple(t["waits"])
            tasks[t["id"]] = ProgramTask(**t)
        model = ModelSpec.from_dict(d["model"])
        return cls(
            placement=Placement.from_dict(d["placement"], model, d["batch"], d["seq"]),
            knobs=d.get("knobs"),
            name=d["name"],
            tasks=tasks,
            streams={s: list(d["streams"][s]) for s in STREAMS if s in d["streams"]},
            memory=GpuMemoryPlan(**d["memory"]),
        )

    @classmethod
    def from_json(cls, text: str) -> Program:
        return cls.from_dict(json.loads(text))

