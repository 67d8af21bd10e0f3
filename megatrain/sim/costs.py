"""Cost model: how long each task of a Program takes on a HardwareProfile.

Compute tasks (F, R, B on the compute stream) take a measured table's time where the profile has one for the
model's signature, kind, unit class and compute dtype, otherwise `flops / (matmul rate x efficiency)`; tasks of
no FLOPs (the embedding's gather and scatter-add) are memory bound: `tokens x hidden x 8 bytes / GPU memory rate`.
Optimizer tasks take `params / AdamW rate` (CPU threads or GPU), the global norm `params / clip-norm rate`.
Every task pays its stream's launch overhead. Copies and CPU updates are not given a duration here: they are
flows of host-memory bytes (`copy_cost`, `cpu_update`) that the engine's fluid model (hostmem.py) shares.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from collections.abc import Callable

from megatrain.ir.program import Program, ProgramTask
from megatrain.ir.streams import COPY_STREAMS
from megatrain.ir.tasks import TaskKind
from megatrain.sim.collectives import collective_s
from megatrain.sim.profile import COMPUTE_KINDS, HardwareProfile, ProfileError, model_signature, unit_class

_WARNED_EAGER_FALLBACK: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class CopyCost:
    """A copy: a fixed delay (launch overhead + latency), then `nbytes` at `rate_Bps` when alone on the link."""

    direction: str
    delay_s: float
    nbytes: int
    rate_Bps: float


@dataclass(frozen=True)
class UpdateCost:
    """A CPU update: a fixed delay (launch overhead), then `nbytes` of host memory, `alone_s` when alone."""

    delay_s: float
    nbytes: float
    alone_s: float
    nvme_s: float = 0.0  # seconds of NVMe drive time (state_tier): reading the unit's state and writing it back


class CostModel:
    """Durations of a Program's tasks under a profile (memoised: every layer of a model costs the same)."""

    def __init__(self, program: Program, profile: HardwareProfile, clip_activates: bool = False):
        self.program, self.profile = program, profile
        self.clip_activates = clip_activates  # speculative clipping: price the redos of a step that clips
        self.spec = program.model
        self.signature = model_signature(self.spec)
        self.placement = program.placement
        self.dtype = program.placement.compute_dtype
        self._memo: dict[tuple, float] = {}

    # ---- compute ---------------------------------------------------------------------------------------------
    def compute_s(self, task: ProgramTask) -> float:
        """Seconds of an F / R / B task, without launch overhead."""
        key = (task.kind, unit_class(task.unit), task.tokens, task.flops)
        if key not in self._memo:
            self._memo[key] = self._compute_s(task)
        return self._memo[key]

    def _compute_s(self, task: ProgramTask) -> float:
        p, uclass = self.profile, unit_class(task.unit)
        tables = self._tables(task.kind, uclass)
        seq = self.program.seq
        if tables:
            # A layer's backward is priced at its FLOPs over those of the backward the table timed (1 for most; the
            # tiled MLP's recompute adds work, a layer that kept its forward's graph does no recompute: 2/3).
            # profiling/fit.py takes measured backwards back to the table's work by the same ratio.
            extra = 1.0
            if task.kind == TaskKind.BACKWARD and task.unit >= 0:
                extra = task.flops / self.spec.task_flops(task.kind, task.unit, task.tokens / seq, seq)
            exact = [t for t in tables if t.seq == seq]
            if exact:
                return exact[0].at(task.tokens) * extra
            # Nearest measured sequence length, rescaled by the analytic FLOPs at the two lengths (attention
            # grows with seq, the matmuls do not).
            t = min(tables, key=lambda t: (abs(t.seq - seq), t.seq))
            here = self.spec.unit_forward_flops(task.unit, task.tokens / seq, seq)
            there = self.spec.unit_forward_flops(task.unit, task.tokens / t.seq, t.seq)
            return t.at(task.tokens) * (here / there if there else 1.0) * extra
        if task.flops > 0:
            return task.flops / (p.matmul_rate(self.dtype) * p.efficiency[uclass])
        # Embedding gather (forward) / scatter-add (backward): activations read and written, fp32 gradient.
        return task.tokens * self.spec.hidden_size * 8 / p.gpu_memory_Bps

    def estimated(self, task: ProgramTask) -> bool:
        """Whether a compute task (F / R / B) is priced without a measured table: from its FLOPs (or, for the
        embedding, its bytes) at the profile's rates, an estimate the outputs say they rest on (sim/estimates.py)."""
        return not self._tables(task.kind, unit_class(task.unit))

    def _tables(self, kind: str, uclass: str):
        """The profile's tables for a task: compiled-layer tables when the Program compiles its layers. Without
        them the eager tables are used (a slower, conservative prediction), and the simulator says so once."""
        compiled = self.placement.compiled_layers and uclass == "layer"
        tables = self.profile.tables_for(self.signature, kind, uclass, self.dtype, compiled)
        if compiled and not tables:
            tables = self.profile.tables_for(self.signature, kind, uclass, self.dtype)
            if tables and (self.profile.name, self.signature) not in _WARNED_EAGER_FALLBACK:
                _WARNED_EAGER_FALLBACK.add((self.profile.name, self.signature))
                warnings.warn(f"profile {self.profile.name} has no compiled-layer compute tables for "
                              f"{self.signature}; predicting compile_layers=true with the eager timings (slower "
                              f"than the compiled layer): profile with `--set compile_layers=true`", stacklevel=4)
        return tables

    # ---- all tasks -------------------------------------------------------------------------------------------
    def duration_s(self, task: ProgramTask) -> float:
        """Seconds of a task, launch overhead included, by its kind's registered cost (COSTS). A copy's is its
        time alone on the link; the engine shares the link as flows instead (`copy_cost`)."""
        return COSTS[TaskKind(task.kind)](self, task)

    def conversion_passes(self) -> int:
        """bf16 <-> fp32 passes a CPU update makes besides AdamW: the streaming-copy refresh (weight_wire bf16)
        and the gradients' conversion into the fp32 scratch (grad_wire bf16)."""
        p = self.placement
        # bf16 moments: m and v are widened to fp32 and rounded back (two passes each way, counted as two)
        return (p.weight_wire == "bf16") + (p.grad_wire == "bf16") + 2 * (p.state_dtype == "bf16")

    def nvme_s(self, params: int) -> float:
        """Drive seconds of a host update whose state is on the NVMe tier: read it before, write it back after
        (the drive does one at a time: reads and writes share it)."""
        p = self.placement
        if p.state_tier == "host":
            return 0.0
        moments = 2 * (2 if p.state_dtype == "bf16" else 4)
        per_param = moments + (4 if p.state_tier == "nvme-all" else 0)  # + the fp32 master
        return params * per_param * (1 / self.profile.nvme_read_Bps + 1 / self.profile.nvme_write_Bps)

    def cpu_update(self, task: ProgramTask) -> UpdateCost:
        """The host-memory flow of a CPU update: its bytes (AdamW + conversion passes) and its time alone."""
        p, passes = self.profile, self.conversion_passes()
        alone = task.params / p.cpu_adam_rate() + passes * task.params / p.cpu_convert_params_per_s
        return UpdateCost(p.overhead(task.stream, task.kind), p.cpu_update_bytes(task.params, passes), alone,
                          self.nvme_s(task.params))

    def copy_cost(self, task: ProgramTask) -> CopyCost:
        """The copy a task on the h2d / d2h stream performs: priced by the direction its bytes go (a copy moved to the
        other stream keeps its direction's curve; the host-memory model shares bandwidth by stream, so two copies of
        one direction on the two streams share only the duplex limit, an approximation)."""
        curve = self.profile.h2d if TaskKind(task.kind).copy == "h2d" else self.profile.d2h
        return CopyCost(task.stream, self.profile.overhead(task.stream, task.kind) + curve.latency_s, task.bytes,
                        curve.rate(task.bytes))

    def slowed_beside(self, task: ProgramTask) -> tuple[float, dict[str, float]]:
        """How many times longer a compute task (F, R, B on the compute stream) takes while a copy is in flight
        (the profile's `compute_beside_copy` for its kind) and while each collective is (`compute_beside_collective`,
        by collective): (1.0, {}) for every other task, and where the profile has neither."""
        if task.stream != "compute" or task.kind not in COMPUTE_KINDS:
            return 1.0, {}
        return self.profile.compute_beside_copy.get(task.kind, 1.0), self.profile.compute_beside_collective

    def collective(self, task: ProgramTask) -> str | None:
        """The collective a task runs ("G", "Z"), None for a task that runs none."""
        op = TaskKind(task.kind).collective
        return None if op is None else op.value

    def is_copy(self, task: ProgramTask) -> bool:
        return task.stream in COPY_STREAMS

    def is_cpu_optimizer(self, task: ProgramTask) -> bool:
        """CPU AdamW work shares host memory bandwidth with the copies. Speculative clipping, in a step that
        clips: a host unit's update waits for the norm (the executor defers it once the norms landed so far exceed
        the max, which the step that clips is assumed to show from its first gradients), so its V does the update
        and its U nothing; in a step that does not clip, V does nothing."""
        if task.stream != "cpu":
            return False
        deferred = self.clip_activates and self.placement.speculative_clip
        return task.kind == (TaskKind.CLIP_REDO if deferred else TaskKind.OPTIMIZER)

    def defers_device_update(self, task: ProgramTask) -> bool:
        """A resident unit's GPU update in a step that clips, with the host redos in the next step
        (`placement.redo_next_step`): the executor defers it as it does the host's (after a step that clipped, which
        the step that clips is assumed to follow), so its V does one update and its U nothing; otherwise its V undoes
        and redoes the speculative update."""
        return (self.clip_activates and self.placement.redo_next_step and task.stream == "compute"
                and self.placement.unit(task.unit).resident)


# ---- the cost of each task kind ----------------------------------------------------------------------------------
Cost = Callable[[CostModel, ProgramTask], float]
COSTS: dict[TaskKind, Cost] = {}  # tests/test_vocabulary.py checks every TaskKind has one


def register_cost(*kinds: TaskKind) -> Callable[[Cost], Cost]:
    """Register a function as the cost (seconds, launch overhead included) of tasks of `kinds` (one per kind)."""
    def put(fn: Cost) -> Cost:
        for k in kinds:
            if k in COSTS:
                raise ValueError(f"task kind {k.name} has a cost already")
            COSTS[k] = fn
        return fn
    return put


@register_cost(TaskKind.FORWARD, TaskKind.RECOMPUTE, TaskKind.BACKWARD)
def _compute_cost(cm: CostModel, task: ProgramTask) -> float:
    return cm.profile.overhead(task.stream, task.kind) + cm.compute_s(task)


@register_cost(TaskKind.OPTIMIZER, TaskKind.CLIP_REDO)
def _update_cost(cm: CostModel, task: ProgramTask) -> float:
    """A GPU update on its params; a GPU redo undoes and updates again, `clip_redo_updates` updates' time (only in a
    step that clips; `adamw_undo` is several element-wise passes where the update is one fused kernel), unless the
    update was deferred to it (`CostModel.defers_device_update`: then one update, and U nothing); a CPU update
    its time alone on host memory (the engine shares it with the copies); a CPU task that does nothing this step,
    its launch only."""
    p, over = cm.profile, cm.profile.overhead(task.stream, task.kind)
    if task.stream == "compute":
        update = task.params / p.gpu_adam_params_per_s
        if cm.defers_device_update(task):  # U waits for the norm; V applies it once
            return over + (update if task.kind == TaskKind.CLIP_REDO else 0.0)
        if task.kind == TaskKind.OPTIMIZER:
            return over + update
        return over + (p.clip_redo_updates * update if cm.clip_activates else 0.0)
    if cm.is_cpu_optimizer(task):
        u = cm.cpu_update(task)
        return u.delay_s + max(u.alone_s, u.nvme_s)
    return over


@register_cost(TaskKind.CLIP_NORM)
def _norm_cost(cm: CostModel, task: ProgramTask) -> float:
    return cm.profile.overhead(task.stream, task.kind) + task.params / cm.profile.clip_norm_params_per_s


@register_cost(*(k for k in TaskKind if k.collective))
def _collective_cost(cm: CostModel, task: ProgramTask) -> float:  # data parallel (sim/collectives.py)
    op = TaskKind(task.kind).collective
    return cm.profile.overhead(task.stream, task.kind) + collective_s(cm.profile, op, task.bytes)


@register_cost(*(k for k in TaskKind if k.copy))
def _copy_alone_cost(cm: CostModel, task: ProgramTask) -> float:
    c = cm.copy_cost(task)
    return c.delay_s + (c.nbytes / c.rate_Bps if c.nbytes else 0.0)
