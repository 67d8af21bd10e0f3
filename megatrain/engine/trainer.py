"""The streamed trainer: a host store, a Program for the batch shape, and the runtime that runs it, step by step.

    trainer = StreamedTrainer(PRESETS["debug"], "overlap", optim=AdamWConfig(lr=1e-3), backend="cpu")
    result = trainer.step(ids, targets)      # (B, T) int64 each; targets already shifted, -100 = no loss
    trainer.flush()                          # "overlap": apply the last step's update (runs in the next step)
    state = trainer.state_dict()             # HF names, fp32

Every schedule gives the same numbers as a plain PyTorch loop (AdamW, decay on matrices only, global-norm
clipping); the schedule changes speed, never results. With "overlap", the update of step n's gradients runs at the
start of step n+1, each layer's update just before its prefetch, so the parameters after N steps are those of a
plain loop once `flush()` has applied the last one (`tiles()` and `state_dict()` flush first).
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import pandas as pd
import torch

from megatrain.exec.backend import Backend, get_backend
from megatrain.io.hf_io import state_dict_from_tiles
from megatrain.exec.optim import AdamWConfig, UpdatePlan
from megatrain.exec.runtime import Runtime
from megatrain.exec.store import HostStore
from megatrain.exec.strategies import host_store
from megatrain.exec.work import StepWork
from megatrain.parallel.world import World
from megatrain.model.init import init_into
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import ScheduleKnobs, knobs_for
from megatrain.ir.placement import DEFAULT_STRATEGY
from megatrain.ir.program import Program
from megatrain.compile.lower import lower
from megatrain.compile.resolve import resolve_host_layout
from megatrain.model.spec import ModelSpec
from megatrain.plan.machine import host_memory
from megatrain.plan.memory import plan_host_memory
from megatrain.units import GiB


CLIPPED = "clipped"  # timeline.attrs key: whether the step's global norm exceeded the max (`step`)


@dataclass
class StepResult:
    """What one training step did. `update` is the plan of this step's gradients: with "overlap" it is applied
    during the next step (or `flush()`), so its `applied_units` fill in then."""

    step: int
    loss: float
    tokens: int  # valid target tokens
    grad_norm: float | None  # global norm before clipping (None with clip=0)
    skipped: bool  # non-finite gradients: this step's update is not applied
    time_s: float
    timeline: pd.DataFrame
    update: UpdatePlan
    # the global norm exceeded the clipping max (or was not finite): what a share of clipping steps counts
    # (StepFacts.clip_share) and live calibration prices; also `timeline.attrs[CLIPPED]`
    clipped: bool = False


class HostMemoryShort(MemoryError):
    """A schedule switch whose host layout would not fit the host's memory (nothing was changed)."""


def set_update_threads(backend: Backend, threads: int | None = None) -> int:
    """Threads of torch's intra-op pool, which runs the CPU AdamW updates.

    On CUDA the default leaves three cores free: the h2d, compute and d2h streams are driven by host threads that
    launch kernels and copies, and when the update's OpenMP threads occupy every core those launches starve (measured
    on the H200 host: a 7 ms layer forward took 66 ms while an update ran). On the CPU backend the stream threads
    are the parallelism and each runs its work with one intra-op thread: an OpenMP team per stream thread
    oversubscribes the cores (a debug-model layer forward took 1.9 ms in a stream thread with 2 intra-op threads on
    a 2-core machine, 0.49 ms with 1).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads is None:
        threads = max(1, cores - 3) if backend.name == "cuda" else 1
    torch.set_num_threads(threads)
    return threads


class StreamedTrainer:
    """Train `spec` from host memory with a schedule (a name from NAMED_SCHEDULES or ScheduleKnobs)."""

    def __init__(self, spec: ModelSpec, schedule: str | ScheduleKnobs = "overlap",
                 tiles: dict[int, torch.Tensor] | None = None, *, optim: AdamWConfig | None = None,
                 backend: str | Backend = "auto", timeout_s: float = 300.0, seed: int = 0,
                 cpu_threads: int | None = None, init: bool = True, world: World | None = None):
        self.spec = spec
        # Data parallel (world.size > 1): this rank trains on its rows of each global batch, holds its slices of
        # the host store, and its Programs gather weights and reduce-scatter gradients (megatrain/dist).
        self.world = world or World()
        self.schedule_name = schedule if isinstance(schedule, str) else "custom"
        self.knobs = knobs_for(schedule) if isinstance(schedule, str) else schedule
        self.optim = optim or AdamWConfig()
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.cpu_threads = set_update_threads(self.backend, cpu_threads)
        self.timeout_s = timeout_s
        layout = resolve_host_layout(spec, self.knobs)
        if self.world.distributed:  # this rank's share, as the strategy slices it (megatrain/parallel/sharded.py)
            self.store = host_store(DEFAULT_STRATEGY, spec, layout, self.world, self.backend, tiles)
        else:
            self.store = HostStore(spec, layout, self.backend, tiles)
        # Without tiles: a seeded random init written straight into the store (no second copy of the model), or,
        # with init=False, zeros for the caller to fill (`store.master(unit)`, then `store.refresh_stream(unit)`).
        if tiles is None and init and self.world.distributed:  # one unit at a time, keeping this rank's slice
            self.store.init_slices(seed)
        elif tiles is None and init:
            init_into(spec, self.store.master, seed)
            for unit in spec.units():
                self.store.refresh_stream(unit)
        self.step_count = 0
        self._shape: tuple[int, int] | None = None
        self._program: Program | None = None
        self._work: StepWork | None = None
        self._runtime: Runtime | None = None
        self._pending: UpdatePlan | None = None
        # Whether the last step's global norm exceeded the max: a fact of the run, not of its Program, so a schedule
        # switched to defers its speculative updates after a clipping step as the one before it would (otherwise its
        # first step speculates, and each update of it is undone and redone: auto's trials measured that as the
        # candidate's step, docs/peers.md "The fourth and fifth starts")
        self._last_step_clipped = False

    # ---- programs ------------------------------------------------------------------------------------------------
    def program(self, batch: int, seq: int) -> Program:
        """The Program for a batch shape (built once per shape; a new shape replaces the GPU buffers)."""
        if self._shape != (batch, seq):
            sched = build_schedule(self.spec, batch, seq, self.knobs, world=self.world.parallelism)
            sched.name = self.schedule_name
            self.use_program(lower(sched))
        return self._program

    def use_program(self, program: Program) -> None:
        """Run `program` for its batch shape from now on: a Program lowered from a schedule you built and edited
        yourself (megatrain/compile/edit.py). Its placement's host layout must be one the host store serves
        (`HostLayout.serves`: the same wires and GPU-updated units, at least the store's resident layers)."""
        if program.model != self.spec:
            raise ValueError(f"the Program trains {program.model.name}, this trainer {self.spec.name}")
        self._release_program()
        self.world.check_same("Program", program.to_json())  # before the first collective
        self._work = StepWork(program, self.store, self.backend, self.optim, self.world)
        self._work.updates.last_step_clipped = self._last_step_clipped
        self._program = program
        self._runtime = Runtime(program, self.backend, self._work, self.timeout_s)
        # Work on a step's gradients runs in the next step ("overlap" timing's updates, speculative clipping's host
        # redos): keep its plan pending.
        self._defers_update = any(t.step_offset == -1 for t in program.tasks.values())
        self._shape = (program.batch, program.seq)

    def _release_program(self) -> None:
        """Drop the running Program's buffers and threads (resident units' state synced to the host first)."""
        if self._work is not None:
            self._work.sync_resident_to_host()  # the next Program's buffers load them from the host
            self._last_step_clipped = self._work.updates.last_step_clipped
        if self._runtime is not None:
            self._runtime.close()  # its stream threads belong to the old Program
        # Free the old buffers before allocating new ones: the runtime holds the old StepWork too, so both go
        # (two Programs' rings at once do not fit a GPU the first one fills).
        replacing = self._work is not None
        self._work = self._runtime = None
        if replacing:  # a StepWork holds reference cycles (bodies bound to it): only the collector frees it
            gc.collect()

    def switch_schedule(self, knobs: ScheduleKnobs, batch: int, seq: int, name: str = "custom"
                        ) -> tuple[Program, UpdatePlan | None]:
        """Run `knobs` from the next step: the pending update (overlap timing) is applied first with the old
        Program, as a checkpoint does, then the new Program for (batch, seq) takes over (`use_program`). A schedule
        of a host layout this store does not serve (other wires, GPU-updated units, gradient ring, or fewer resident
        layers: `HostLayout.serves`) takes the store over in place
        (`HostStore.relayout`: the master and moments are kept, the rest rebuilt; one process and the same optimizer
        state dtype and tier only (ValueError), and HostMemoryShort when the larger layout would not fit the host;
        each refused before anything changes); if its Program then cannot start, the store goes back to the old
        layout before the error is raised. Returns the new Program and the update plan the flush applied (None if
        none was pending)."""
        layout = resolve_host_layout(self.spec, knobs)
        relayout = not self.store.layout.serves(layout)  # served: more resident layers than the store's, or same
        if relayout and self.world.distributed:
            raise ValueError(f"schedule {name} needs another host layout than the one this rank's store was built "
                             "for; a data-parallel run keeps its layout (start the run with it)")
        if relayout:  # refused (another optimizer state) before anything is flushed or released
            self.store.check_relayout(layout)
        sched = build_schedule(self.spec, batch, seq, knobs, world=self.world.parallelism)
        sched.name = name
        program = lower(sched)
        if relayout:
            self._check_relayout_fits(program, name)
        applied = self.flush()
        if relayout:
            old = self.store.layout
            self._release_program()
            self.store = self.store.relayout(layout)
            try:
                self.use_program(program)
            except BaseException:
                self._release_program()
                self.store = self.store.relayout(old)  # the caller may put the old Program back
                raise
        else:
            self.use_program(program)
        self.knobs, self.schedule_name = knobs, name
        return program, applied

    def _check_relayout_fits(self, program: Program, name: str) -> None:
        """HostMemoryShort, before anything is freed, when the new layout's store (the planner's figure,
        `plan_host_memory`) needs more than the running store's and the host has. The master and moments are taken
        over in place (`HostStore.relayout`) and are the same bytes in both layouts, so the difference is that of
        the rest: the gradient landing space, the streaming copy and the scratch buffers."""
        planned = plan_host_memory(program.placement, self.backend.name).store_bytes
        more = planned - self.store.store_bytes()
        if more <= 0:
            return
        limit = host_memory()
        if more > limit.usable_bytes:
            raise HostMemoryShort(f"schedule {name} needs {more / GiB:.2f} GiB more host memory for its layout "
                                  f"than the running one frees, and {limit.describe()} leaves "
                                  f"{limit.usable_bytes / GiB:.2f} GiB")

    # ---- training ------------------------------------------------------------------------------------------------
    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """One training step on a batch: ids and targets (B, T) int64 (targets[b, t] = ids[b, t+1], -100 = none)."""
        if ids.dim() != 2 or ids.shape != targets.shape:
            raise ValueError(f"ids and targets must both be (batch, seq); got {tuple(ids.shape)} and "
                             f"{tuple(targets.shape)}")
        n_valid = None
        if self.world.distributed:  # this rank's rows; the loss is normalised by the global batch's tokens
            ids, targets, n_valid = self._rank_rows(ids, targets)
        self.program(*ids.shape)
        index = self.step_count
        current = UpdatePlan(step=index, lr=self.optim.lr_at(index))
        self._work.begin_step(ids, targets, current, self._pending, n_valid)
        t0 = time.perf_counter()
        timeline = self._runtime.run(step=index)
        dt = time.perf_counter() - t0
        self._work.settle_device_skips(current)
        # whether the global norm exceeded the max (or was not finite): live calibration prices such steps
        clipped = self._program.placement.clip_max_norm is not None and (current.skip or current.clip_coef < 1.0)
        timeline.attrs[CLIPPED] = clipped
        self._pending = current if self._defers_update else None
        self.step_count += 1
        self.last_timeline = timeline
        return StepResult(step=index, loss=self.world.sum(self._work.loss()), tokens=self._work.n_valid,
                          grad_norm=current.grad_norm, skipped=current.skip, time_s=dt, timeline=timeline,
                          update=current, clipped=clipped)

    def _rank_rows(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's contiguous rows of a global batch and the global batch's valid target tokens."""
        n, r = self.world.size, self.world.rank
        if ids.shape[0] % n:
            raise ValueError(f"a global batch of {ids.shape[0]} rows does not split over {n} ranks; use a batch "
                             f"size that is a multiple of {n}")
        rows = ids.shape[0] // n
        n_valid = int((targets != -100).sum())
        return ids[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], n_valid

    def flush(self) -> UpdatePlan | None:
        """Bring the host store up to date: apply a pending update (placement "overlap": the last step's; with
        speculative clipping, the last step's redos of host units), and
        copy the units that live on the GPU (resident_embeddings / resident_layers) back to the host. Returns the
        plan applied, or None."""
        plan, self._pending = self._pending, None
        if plan is not None:
            self._work.flush_update(plan)
        if self._work is not None:
            self._work.sync_resident_to_host()
        return plan

    # ---- state ---------------------------------------------------------------------------------------------------
    def tiles(self) -> dict[int, torch.Tensor]:
        """Copies of the fp32 master tiles ({unit: (numel,)}), after applying any pending update."""
        self.flush()
        return self.store.tiles()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 tensors of the current weights (tied: no lm_head.weight), after any pending update."""
        return state_dict_from_tiles(self.spec, self.tiles())

    def host_bytes_by_component(self) -> dict[str, int]:
        """Host bytes of the store by component (planner names), plus offloaded checkpoints when the schedule has
        them (known once a batch shape is set)."""
        out = self.store.bytes_by_component()
        if self._work is not None and self._work.act_host_bytes():
            out["offloaded checkpoints"] = self._work.act_host_bytes()
        return out
