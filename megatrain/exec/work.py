"""What each task of a Program does: the bodies the runtime enqueues, dispatched by task kind.

    PREFETCH                     the unit's streaming copy into its GPU buffer                (here)
    FORWARD, RECOMPUTE, BACKWARD the layer math on the buffer's weights          (exec/compute.py)
    OFFLOAD, CLIP_NORM, OPTIMIZER, CLIP_REDO, STATE_PREFETCH, STATE_OFFLOAD   gradients and updates (exec/updates.py)
    ACT_OFFLOAD, ACT_PREFETCH    checkpoints to the host and back             (exec/activations.py)

Everything comes from the Program: its placement says which GPU buffers exist (exec/buffers.py), which layers keep
checkpoints and which go to the host, the layer kernel, the wires and the clipping.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from megatrain.ir.program import Program, ProgramTask
from megatrain.ir.tasks import TaskKind
from megatrain.exec.activations import Activations
from megatrain.exec.backend import Backend
from megatrain.exec.buffers import DeviceBuffers
from megatrain.exec.compute import LayerCompute, StepBatch
from megatrain.exec.optim import AdamWConfig, UpdatePlan
from megatrain.exec.rope import rope_cos_sin
from megatrain.exec.store import HostStore
# A parallel strategy (megatrain/parallel/) registers the bodies it replaces in exec/strategies.py: exec never
# imports it.
from megatrain.exec.strategies import parallel_handlers
from megatrain.exec.updates import Updates

Body = Callable[[ProgramTask], None]

# The body of each task kind on one GPU: kind -> how a StepWork finds it. Registered below, next to the bodies'
# owners; tests/test_vocabulary.py checks that every TaskKind has one here or from a parallel strategy.
BODIES: dict[TaskKind, Callable[[StepWork], Body]] = {}


def register_body(kind: TaskKind, find: Callable[[StepWork], Body]) -> None:
    """Register how a StepWork finds the body of `kind` (one per kind)."""
    if kind in BODIES:
        raise ValueError(f"task kind {kind.name} has a body already")
    BODIES[kind] = find


class StepWork:
    """Task bodies for one Program over a host store; `begin_step` binds a batch, then the runtime calls it."""

    def __init__(self, program: Program, store: HostStore, backend: Backend, cfg: AdamWConfig,
                 world=None):
        self.program, self.store, self.backend = program, store, backend
        self.spec = program.model
        if store.spec != self.spec or not store.layout.serves(program.placement.host_layout):
            raise ValueError(f"the host store was built for another model or host layout than the Program "
                             f"(store {store.layout}, Program {program.placement.host_layout}); build the store "
                             "from the Program's placement")
        self.buffers = DeviceBuffers(program, store, backend)
        self.acts = Activations(program, backend)
        self.compute = LayerCompute(program, store, self.buffers, self.acts)
        self.updates = Updates(program, store, self.buffers, backend, cfg)
        # keyed by the letter: a ProgramTask's kind is the plain str (a str Enum hashes by its name)
        self.handlers: dict[str, Body] = {k.value: find(self) for k, find in BODIES.items()}
        if program.placement.world > 1:  # data parallel: the strategy's bodies (registered by megatrain/parallel/)
            factory = parallel_handlers(program.placement.strategy, program.placement.world)
            if world is None or world.size != program.placement.world:
                raise ValueError(f"the Program runs data parallel over {program.placement.world} ranks; pass the "
                                 "World of this process (megatrain.parallel.world.World.from_env)")
            self.handlers.update({TaskKind(k).value: body
                                  for k, body in factory(self, world).items()})
        missing = sorted({t.kind for t in program.tasks.values()} - set(self.handlers))
        if missing:
            raise ValueError(f"the Program has task kinds {missing} that no body is registered for (exec/work.py "
                             "register_body, or a parallel strategy's register_parallel_handlers)")
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.n_valid = 0

    def __call__(self, task: ProgramTask) -> None:
        self.handlers[task.kind](task)

    # ---- step --------------------------------------------------------------------------------------------------
    def begin_step(self, ids: torch.Tensor, targets: torch.Tensor, current: UpdatePlan,
                   pending: UpdatePlan | None, n_valid: int | None = None) -> None:
        """Bind one batch (ids, targets: (B, T) int64, targets -100 = no loss) and the update plans; `n_valid`:
        the loss's denominator when it is not this batch's own count (data parallel: the global batch's)."""
        p, M = self.program, self.program.placement.micro_batches
        if tuple(ids.shape) != (p.batch, p.seq) or tuple(targets.shape) != (p.batch, p.seq):
            raise ValueError(f"batch has ids {tuple(ids.shape)} and targets {tuple(targets.shape)}; this Program "
                             f"runs (batch, seq) = ({p.batch}, {p.seq})")
        n_valid = int((targets != -100).sum()) if n_valid is None else n_valid
        if n_valid == 0:
            raise ValueError("every target of the batch is -100: there is no token to compute a loss on")
        dev = self.backend.device
        if p.seq not in self._rope:
            self._rope[p.seq] = rope_cos_sin(self.spec, p.seq, dev, self.compute.compute_dtype)
        cos, sin = self._rope[p.seq]
        self.n_valid = n_valid
        self.acts.reset()
        self.compute.begin_step(StepBatch(ids.to(dev, torch.int64).chunk(M), targets.to(dev, torch.int64).chunk(M),
                                          n_valid, cos, sin))
        self.updates.begin_step(current, pending)

    def loss(self) -> float:
        """Mean loss over the batch's valid tokens (call after the step's work is done)."""
        return float(sum(float(v) for v in self.compute.loss_sums.values())) / self.n_valid

    # ---- PREFETCH ----------------------------------------------------------------------------------------------
    def prefetch(self, t: ProgramTask) -> None:
        buf = self.buffers[t.slot]
        for off, src in self.store.stream_segments(t.unit):
            buf.w[off:off + src.numel()].copy_(src, non_blocking=True)
        buf.unit = t.unit

    # ---- what the trainer needs --------------------------------------------------------------------------------
    def gpu_bytes(self) -> int:
        """Bytes of all GPU buffers (the Program's `memory.buffers_bytes`)."""
        return self.buffers.nbytes

    def act_host_bytes(self) -> int:
        return self.acts.host_bytes

    def sync_resident_to_host(self) -> None:
        self.buffers.sync_resident_to_host()

    def settle_device_skips(self, plan: UpdatePlan) -> None:
        self.updates.settle_device_skips(plan)

    def flush_update(self, plan: UpdatePlan) -> None:
        self.updates.flush_update(plan)


# ---- the one-GPU body of each kind -------------------------------------------------------------------------------
register_body(TaskKind.PREFETCH, lambda w: w.prefetch)
register_body(TaskKind.FORWARD, lambda w: w.compute.forward)
register_body(TaskKind.RECOMPUTE, lambda w: w.compute.recompute)
register_body(TaskKind.BACKWARD, lambda w: w.compute.backward)
register_body(TaskKind.OFFLOAD, lambda w: w.updates.offload)
register_body(TaskKind.CLIP_NORM, lambda w: w.updates.clip_norm)
register_body(TaskKind.OPTIMIZER, lambda w: w.updates.update)
register_body(TaskKind.CLIP_REDO, lambda w: w.updates.clip_redo)
register_body(TaskKind.STATE_PREFETCH, lambda w: w.updates.state_prefetch)
register_body(TaskKind.STATE_OFFLOAD, lambda w: w.updates.state_offload)
register_body(TaskKind.ACT_OFFLOAD, lambda w: w.acts.act_offload)
register_body(TaskKind.ACT_PREFETCH, lambda w: w.acts.act_prefetch)
# ALL_GATHER and REDUCE_SCATTER exist only in data-parallel Programs: the parallel strategy registers them.
