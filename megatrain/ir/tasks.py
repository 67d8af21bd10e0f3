"""Tasks of a training step and their compact text ids.

Every task has an id that round-trips through text, used in logs, traces, golden files and errors:

    P3      PREFETCH       host -> GPU copy of layer 3's weights into a GPU buffer slot for the forward
    P3b     PREFETCH       the same, again, for the backward (when the forward's copy was evicted)
    F3.1    FORWARD        layer 3 forward of micro-batch 1 (FH.m: head forward + loss + its backward, fused)
    R3.1    RECOMPUTE      layer 3 forward again inside a recompute block, to rebuild the next layer's input
    B3.1    BACKWARD       layer 3 recompute-once + local backward of micro-batch 1, grads into the slot
    O3      OFFLOAD        GPU -> host copy of layer 3's accumulated gradients
    N       CLIP_NORM      global gradient norm from the per-unit norms (exact clipping)
    U3      OPTIMIZER      AdamW on layer 3 (CPU threads, or the GPU when the schedule says so)
    V3      CLIP_REDO      speculative exact clipping: undo U3 and apply it again with the clip coefficient when the
                           global norm (N) turns out above the max norm, or just undo it when the norm is not finite
    S3      STATE_PREFETCH host -> GPU copy of master, moments and gradients for a GPU optimizer update
    W3      STATE_OFFLOAD  GPU -> host copy of the updated master, moments and streaming copy
    X3.1    ACT_OFFLOAD    GPU -> host copy of layer 3's checkpointed input (long context)
    Y3.1    ACT_PREFETCH   host -> GPU copy of it back before the backward needs it
    G3      ALL_GATHER     (world > 1) the ranks' slices of layer 3's weights gathered into the slot (G3b: backward)
    Z3      REDUCE_SCATTER (world > 1) the slot's gradients summed over the ranks, each keeping its slice, and the
                           unit's norm all-reduced from the slices' squared norms

Units are `E` (embedding), `H` (head) or a layer number.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from megatrain.ir.streams import COPY_STREAMS, STREAMS
from megatrain.model.spec import EMBED, HEAD


class Collective(str, Enum):
    """A collective operation between data-parallel ranks, as profiles key their `collectives` tables ("G", "Z",
    "A"). `bus_factor`: nccl-tests' busbw / algbw is bus_factor x (n-1)/n. `dtype`: what it moves, a dtype word or
    the Placement field that holds one. The all-reduce is no task of its own: it rides after each reduce-scatter
    (the unit's squared norm), so it is priced and measured but never scheduled."""

    ALL_GATHER = ("G", "all-gather", 1.0, "weight_wire")
    REDUCE_SCATTER = ("Z", "reduce-scatter", 1.0, "fp32")
    ALL_REDUCE = ("A", "all-reduce", 2.0, "fp32")

    def __new__(cls, letter: str, label: str, bus_factor: float, dtype: str):
        obj = str.__new__(cls, letter)
        obj._value_ = letter
        obj.label, obj.bus_factor, obj.dtype = label, bus_factor, dtype
        return obj


BY_DEVICE = "by device"  # a kind whose stream is its task's device's: "compute" on the GPU, "cpu" on the host
# What GPU idle time is charged to (analysis/summary.py): each kind names one; "other" also takes what no task held.
WAIT_CAUSES = ("weights", "optimizer", "gradients", "collectives", "other")


class TaskKind(str, Enum):
    """A kind of task, with everything that belongs to it: the letter of its ids, its stream (ir/streams.py, or
    BY_DEVICE), the direction its bytes go when it is a copy, the wait cause GPU idle time spent waiting on it is
    charged to (analysis/summary.py), its label and colour (traces, Gantt charts, reports), and the collective it
    runs (data parallel). Every other table of kinds derives from these; tests/test_vocabulary.py checks that the
    interpreters register a body (exec) and a cost (sim) for each.

    Compute kinds run on the stream whose idle time is explained, so no idle stretch is charged to one ("other")."""

    #                 letter stream     copy   wait cause     label                       colour
    PREFETCH = ("P", "h2d", "h2d", "weights", "prefetch weights", "#4c78a8")
    FORWARD = ("F", "compute", None, "other", "forward", "#54a24b")
    RECOMPUTE = ("R", "compute", None, "other", "recompute", "#a1d99b")
    BACKWARD = ("B", "compute", None, "other", "backward", "#2e7d32")
    OFFLOAD = ("O", "d2h", "d2h", "gradients", "offload gradients", "#f58518")
    CLIP_NORM = ("N", "cpu", None, "optimizer", "global norm", "#9d9d9d")
    OPTIMIZER = ("U", BY_DEVICE, None, "optimizer", "optimizer update", "#7b4fa3")
    CLIP_REDO = ("V", BY_DEVICE, None, "optimizer", "clip redo", "#c5b0d5")
    STATE_PREFETCH = ("S", "h2d", "h2d", "gradients", "prefetch optimizer state", "#9ecae9")
    STATE_OFFLOAD = ("W", "d2h", "d2h", "gradients", "offload optimizer state", "#eeca3b")
    ACT_OFFLOAD = ("X", "d2h", "d2h", "weights", "offload activations", "#b279a2")
    ACT_PREFETCH = ("Y", "h2d", "h2d", "weights", "prefetch activations", "#72b7b2")
    ALL_GATHER = ("G", "comm", None, "collectives", "all-gather weights", "#17becf", Collective.ALL_GATHER)
    REDUCE_SCATTER = ("Z", "comm", None, "collectives", "reduce-scatter gradients", "#bcbd22",
                      Collective.REDUCE_SCATTER)

    def __new__(cls, letter: str, stream: str, copy: str | None, cause: str, label: str, colour: str,
                collective: Collective | None = None):
        obj = str.__new__(cls, letter)
        obj._value_ = letter
        obj.stream, obj.copy, obj.cause, obj.label, obj.colour = stream, copy, cause, label, colour
        obj.collective = collective
        return obj

    def stream_on(self, device: str | None) -> str:
        """The stream of a task of this kind: its own, or (BY_DEVICE) "compute" for device "gpu", else "cpu"."""
        if self.stream == BY_DEVICE:
            return "compute" if device == "gpu" else "cpu"
        return self.stream


def _check_kinds() -> None:
    """Every kind's stream, copy direction and wait cause are words of their vocabularies (at import: a typo in
    the table above fails every run at once)."""
    for k in TaskKind:
        if k.stream != BY_DEVICE and k.stream not in STREAMS:
            raise ValueError(f"task kind {k.name}: stream {k.stream!r} is not one of {STREAMS} or {BY_DEVICE!r}")
        if k.copy is not None and k.copy not in COPY_STREAMS:
            raise ValueError(f"task kind {k.name}: copy direction {k.copy!r} is not one of {COPY_STREAMS}")
        if k.cause not in WAIT_CAUSES:
            raise ValueError(f"task kind {k.name}: wait cause {k.cause!r} is not one of {WAIT_CAUSES}")


_check_kinds()

# Units are of three classes: compute tables are kept per class, and a class runs only some compute kinds (the
# head's F is forward + loss + backward fused; the embedding has no recompute).
UNIT_CLASSES = ("layer", "embed", "head")
UNIT_CLASS_NAMES = {"layer": "", "embed": "embedding", "head": "head"}


def unit_class(unit: int) -> str:
    """"embed", "head" or "layer": compute tables are kept per class of unit."""
    return {EMBED: "embed", HEAD: "head"}.get(unit, "layer")


# Which kinds carry a micro-batch index and which a unit.
_HAS_MICRO = {TaskKind.FORWARD, TaskKind.RECOMPUTE, TaskKind.BACKWARD, TaskKind.ACT_OFFLOAD, TaskKind.ACT_PREFETCH}
_HAS_UNIT = set(TaskKind) - {TaskKind.CLIP_NORM}
_ID_RE = re.compile(r"^([A-Z])(E|H|\d+)?(b)?(?:\.(\d+))?$")


def unit_text(unit: int) -> str:
    return {EMBED: "E", HEAD: "H"}.get(unit, str(unit))


def parse_unit(text: str) -> int:
    return {"E": EMBED, "H": HEAD}.get(text) if text in ("E", "H") else int(text)


@dataclass(frozen=True, order=True)
class Task:
    """One node of a schedule: a kind, the unit it works on, and the micro-batch for compute tasks."""

    kind: TaskKind
    unit: int | None = None
    micro: int | None = None
    back: bool = False  # PREFETCH only: the second copy of a unit's weights, for its backward

    def __post_init__(self):
        if self.back and self.kind not in (TaskKind.PREFETCH, TaskKind.ALL_GATHER):
            raise ValueError("only PREFETCH and ALL_GATHER tasks have a backward variant")
        if (self.unit is not None) != (self.kind in _HAS_UNIT):
            raise ValueError(f"task kind {self.kind.name} {'needs' if self.kind in _HAS_UNIT else 'takes no'} unit")
        if (self.micro is not None) != (self.kind in _HAS_MICRO):
            raise ValueError(f"task kind {self.kind.name} {'needs' if self.kind in _HAS_MICRO else 'takes no'} micro")

    @property
    def id(self) -> str:
        s = self.kind.value
        if self.unit is not None:
            s += unit_text(self.unit)
        if self.back:
            s += "b"
        if self.micro is not None:
            s += f".{self.micro}"
        return s

    def __str__(self) -> str:
        return self.id

    @classmethod
    def parse(cls, text: str) -> Task:
        """Inverse of `.id`: `Task.parse("B3.1") == Task(TaskKind.BACKWARD, 3, 1)`."""
        m = _ID_RE.match(text.strip())
        if not m:
            raise ValueError(f"{text!r} is not a task id (examples: P3, F3.1, BH.0, O3, U3, N)")
        try:
            kind = TaskKind(m.group(1))
        except ValueError:
            raise ValueError(f"{text!r}: unknown task kind {m.group(1)!r}") from None
        unit = parse_unit(m.group(2)) if m.group(2) is not None else None
        micro = int(m.group(4)) if m.group(4) is not None else None
        try:
            return cls(kind, unit, micro, back=m.group(3) is not None)
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None


def P(u, back=False):
    return Task(TaskKind.PREFETCH, u, back=back)


def F(u, m):
    return Task(TaskKind.FORWARD, u, m)


def R(u, m):
    return Task(TaskKind.RECOMPUTE, u, m)


def B(u, m):
    return Task(TaskKind.BACKWARD, u, m)


def O(u):  # noqa: E743 - the letter is the task kind
    return Task(TaskKind.OFFLOAD, u)


def U(u):
    return Task(TaskKind.OPTIMIZER, u)


def S(u):
    return Task(TaskKind.STATE_PREFETCH, u)


def V(u):
    return Task(TaskKind.CLIP_REDO, u)


def W(u):
    return Task(TaskKind.STATE_OFFLOAD, u)


def X(u, m):
    return Task(TaskKind.ACT_OFFLOAD, u, m)


def Y(u, m):
    return Task(TaskKind.ACT_PREFETCH, u, m)


def G(u, back=False):
    return Task(TaskKind.ALL_GATHER, u, back=back)


def Z(u):
    return Task(TaskKind.REDUCE_SCATTER, u)


NORM = Task(TaskKind.CLIP_NORM)

COMPUTE_KINDS = {TaskKind.FORWARD, TaskKind.RECOMPUTE, TaskKind.BACKWARD}
# the collectives a Program holds as tasks ("G", "Z"; the all-reduce rides after each reduce-scatter)
SCHEDULED_COLLECTIVES = tuple(k.collective.value for k in TaskKind if k.collective)
COMPUTE_KINDS_OF_CLASS = {"layer": (TaskKind.FORWARD, TaskKind.RECOMPUTE, TaskKind.BACKWARD),
                          "embed": (TaskKind.FORWARD, TaskKind.BACKWARD), "head": (TaskKind.FORWARD,)}
