"""Gradients out and updates in: OFFLOAD, CLIP_NORM, OPTIMIZER, STATE_PREFETCH and STATE_OFFLOAD, and the skip
bookkeeping of non-finite gradients.

OFFLOAD takes each unit's gradient norm where the gradients are (fp32, in the values the wire carries) and lands it
on the host and on the device. Optimizer tasks read an `UpdatePlan` (learning rate, clip coefficient, skip): the
current step's (step_offset 0), set by CLIP_NORM, or the previous step's (step_offset -1: "overlap" timing's updates,
and speculative clipping's redos of host units, which run at the start of the next step).
Without a global norm (no clipping) each unit is skipped on its own when its gradients are not finite; a GPU update
of this step's gradients decides that on the device, and the host settles the bookkeeping after the step.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatrain.ir.placement import UpdateSite
from megatrain.ir.program import Program, ProgramTask
from megatrain.ir.tasks import TaskKind
from megatrain.model.spec import EMBED, HEAD
from megatrain.exec.backend import Backend
from megatrain.exec.buffers import DeviceBuffers
from megatrain.exec.optim import (AdamWConfig, UpdatePlan, adamw_undo, adamw_update, adamw_update_bf16_state, clip_coefficient,
                    decayed_in, global_norm)
from megatrain.exec.store import HostStore


class Updates:
    """Bodies of O, N, U, V, S and W tasks over the host store and the device buffers."""

    def __init__(self, program: Program, store: HostStore, buffers: DeviceBuffers, backend: Backend,
                 cfg: AdamWConfig):
        self.placement = program.placement
        self.spec, self.store, self.buffers, self.backend, self.cfg = program.model, store, buffers, backend, cfg
        self.max_norm = self.placement.clip_max_norm  # None: no global norm (per-unit skips)
        # Speculative clipping: updates run unclipped as gradients land (skipping a unit whose own gradients are
        # not finite, as without clipping); CLIP_REDO fixes them once the global norm is known.
        self.speculative = self.placement.speculative_clip
        self.unit_skips = self.max_norm is None or self.speculative
        self.unit_index = {u: i for i, u in enumerate(store.units)}
        # The units whose norms have landed when a unit's gradients have: its own and those of every OFFLOAD
        # before it in the d2h queue (a stream completes in order), as indices into unit_norms. Their norms bound
        # the global norm from below, except a tied embedding's and head's (the shared matrix's gradient is the
        # sum of both: its norm is not theirs), which are left out.
        self.norms_landed_with: dict[int, list[int]] = {}
        landed: list[int] = []
        tied = (EMBED, HEAD) if self.spec.tie_word_embeddings else ()
        for tid in program.streams.get("d2h", []):
            task = program.tasks[tid]
            if task.kind == "O":
                if task.unit not in tied:
                    landed.append(self.unit_index[task.unit])
                self.norms_landed_with[task.unit] = list(landed)
        # Per-unit gradient norms, computed on the device by OFFLOAD and landed next to the gradients.
        self.unit_norms = torch.zeros(len(store.units), dtype=torch.float32, pin_memory=backend.pins_host_memory)
        # The same norms on the device, for GPU updates that must skip non-finite gradients without a host wait.
        self.device_norms = torch.zeros(len(store.units), dtype=torch.float32, device=backend.device)
        self.current: UpdatePlan | None = None
        self.pending: UpdatePlan | None = None
        # Speculative clipping: whether the last global norm exceeded the max. Norms move slowly from step to step,
        # so after a step that clipped the host updates wait for the norm instead of being undone and redone.
        self.last_step_clipped = False
        self.previous_step_clipped = False  # last_step_clipped as the step began (`begin_step`)
        # Speculative clipping with the host redos in the next step (placement.redo_next_step): after a step that
        # clipped, a resident unit's update waits for the norm too (its V applies it once, clipped) instead of being
        # undone and redone on the GPU (3.7 updates' time a unit on an H200: docs/performance.md, attempt 9)
        self.defers_resident = self.speculative and self.placement.redo_next_step
        # Speculative clipping: the host units whose CLIP_REDO runs in the next step (the last step's plan), in
        # program order; `flush_update` runs them when no next step comes.
        self.next_step_redo_units = [program.tasks[tid].unit for tid in program.streams.get("cpu", [])
                                     if program.tasks[tid].kind == TaskKind.CLIP_REDO
                                     and program.tasks[tid].step_offset == -1]

    def begin_step(self, current: UpdatePlan, pending: UpdatePlan | None) -> None:
        self.current, self.pending = current, pending
        # what the GPU updates of this step read: the compute stream's U may be issued after this step's CLIP_NORM
        # has set last_step_clipped (the streams race), and the choice to defer must not depend on that race
        self.previous_step_clipped = self.last_step_clipped

    # ---- OFFLOAD -----------------------------------------------------------------------------------------------
    def offload(self, t: ProgramTask) -> None:
        n = self.store.layouts[t.unit].numel
        g = self.buffers[t.slot].g[:n]
        i = self.unit_index[t.unit]
        resident = self.placement.unit(t.unit).resident  # its gradients stay where they are: only the norm
        if not resident:
            self.store.gradients_landing(t.unit)
        # Gradients kept on the GPU (t.fills) have no host landing tile (none in a gradient ring): the wire dtype
        # is the store's gradient dtype either way.
        landing = None if resident or t.fills else self.store.grad(t.unit)
        wire = g if resident or self.store.grad_dtype == g.dtype else g.to(self.store.grad_dtype)  # on the device
        # The norm of what lands (and is applied), computed where the gradients are, in fp32; kept on the device
        # too, for GPU updates that decide a skip there.
        norm = torch.linalg.vector_norm(wire, dtype=torch.float32).reshape(1)
        self.device_norms[i:i + 1].copy_(norm)
        self.unit_norms[i:i + 1].copy_(norm, non_blocking=True)
        if resident:
            return
        if t.fills:  # kept on the GPU for its update there: a device copy, in the values the wire would carry
            self.buffers[t.fills].g.copy_(wire, non_blocking=True)
        else:
            landing.copy_(wire, non_blocking=True)

    # ---- CLIP_NORM ---------------------------------------------------------------------------------------------
    def clip_norm(self, t: ProgramTask) -> None:
        """Global gradient norm from the per-unit norms; sets the clip coefficient, or marks the step skipped."""
        plan, store, spec = self.current, self.store, self.spec
        norms = [float(self.unit_norms[self.unit_index[u]]) for u in store.units
                 if not (spec.tie_word_embeddings and u in (EMBED, HEAD))]
        if spec.tie_word_embeddings:  # the shared matrix's gradient is the sum of both; its norm is not separable
            norms.append(float(torch.linalg.vector_norm(store.optimizer_grad(EMBED))))
            norms.append(float(torch.linalg.vector_norm(store.optimizer_grad(HEAD))))
        plan.grad_norm = global_norm(norms)
        if not math.isfinite(plan.grad_norm):
            plan.skip = True
        else:
            plan.clip_coef = clip_coefficient(plan.grad_norm, self.max_norm)
        self.last_step_clipped = plan.skip or plan.clip_coef < 1.0

    # ---- OPTIMIZER ---------------------------------------------------------------------------------------------
    def _plan(self, t: ProgramTask) -> UpdatePlan | None:
        return self.pending if t.step_offset == -1 else self.current

    def _unit_finite(self, unit: int) -> bool:
        """Without a global norm, a unit is updated only if its own gradients are finite."""
        units = [EMBED, HEAD] if self.spec.tie_word_embeddings and unit == EMBED else [unit]
        return all(math.isfinite(float(self.unit_norms[self.unit_index[u]])) for u in units)

    def _should_apply(self, unit: int, plan: UpdatePlan | None, on_device: bool = False) -> UpdatePlan | None:
        if plan is None or plan.skip or unit in plan.skipped_units:
            return None
        if self.unit_skips and on_device:  # the kernel skips it if need be (`_device_skip`)
            return plan
        if self.unit_skips and not self._unit_finite(unit):
            plan.skipped_units.append(unit)
            return None
        return plan

    def update(self, t: ProgramTask) -> None:
        """AdamW on one unit: on the host tiles (cpu stream) or on a GPU buffer (compute stream)."""
        # A GPU update of this step's gradients without a global norm (arrival timing) cannot read the unit's norm
        # on the host yet (it is still landing): the device decides the skip.
        on_device = t.stream != "cpu" and t.step_offset == 0 and self.unit_skips
        plan = self._should_apply(t.unit, self._plan(t), on_device)
        # A speculative update never clips: the norm may already be known when it runs (GPU streams race the
        # host's CLIP_NORM), but its CLIP_REDO assumes it ran unclipped.
        coef = 1.0 if self.speculative or plan is None else plan.clip_coef
        if t.stream == "cpu":
            if plan is not None and self.speculative and self._clipping_likely(t.unit):
                plan.deferred_units.append(t.unit)  # an update that would be undone: its CLIP_REDO applies it
            elif plan is not None:  # None: step 0 of "overlap" (no gradients yet), or a skipped step / unit
                self._host_update(t.unit, plan, coef)
            return
        u, store = t.unit, self.store
        if (plan is not None and self.defers_resident and self.previous_step_clipped
                and self.placement.unit(u).resident):
            plan.deferred_units.append(u)  # would be undone and redone on the GPU: its CLIP_REDO applies it once
            return
        master, m, v, g = self._state_views(t)
        if plan is not None:
            self._device_update(u, (master, m, v, g), plan, coef, self._device_skip(u) if on_device else None)
            if on_device:
                plan.device_checked.append(u)
            if store.stream_tile(u) is not None and self.placement.unit(u).update is UpdateSite.GPU_STREAMED:
                g.view(torch.bfloat16)[:master.numel()].copy_(master)  # stage the streaming copy for W
        if t.fills:  # "overlap" GPU update: the (updated) master is the weights of this layer's forward
            buf = self.buffers[t.fills]
            buf.w[:master.numel()].copy_(master)  # cast to the wire dtype, as the host's streaming copy is
            buf.unit = u

    def _device_update(self, u: int, views: Sequence[torch.Tensor], plan: UpdatePlan, coef: float,
                       found_inf: torch.Tensor | None = None) -> None:
        """AdamW of unit u on its device state (master, m, v, gradients: `_state_views`), counted as applied."""
        master, m, v, g = views
        self.store.steps[u] += 1
        kept = self.buffers.kept.get(u)  # gradients kept on the GPU, or streamed into the state buffer
        adamw_update(master, kept.g if kept is not None else g, m, v, self.store.steps[u], self.store.decay_numel(u),
                     plan.lr, self.cfg, coef, found_inf)
        plan.applied_units.append(u)

    def _device_skip(self, unit: int) -> torch.Tensor:
        """() fp32 on the device: 1 where the unit's gradient norm (landed by its OFFLOAD) is not finite.

        A slice, not a list index (which would copy an index tensor to the device in the per-layer loop). GPU
        updates are of decoder layers or of untied resident embeddings, so no tied pair has to be combined."""
        i = self.unit_index[unit]
        return (~torch.isfinite(self.device_norms[i:i + 1])).float().reshape(())

    def settle_device_skips(self, plan: UpdatePlan) -> None:
        """After the step: units whose GPU update the device skipped get the bookkeeping of a host skip (in
        skipped_units, not applied, step count not advanced)."""
        for u in plan.device_checked:
            if not self._unit_finite(u):
                self.store.steps[u] -= 1
                plan.applied_units.remove(u)
                plan.skipped_units.append(u)
        plan.device_checked.clear()

    def _host_update(self, u: int, plan: UpdatePlan, coef: float | None = None) -> None:
        store = self.store
        store.steps[u] += 1
        master, m, v, decay = store.master(u), store.exp_avg(u), store.exp_avg_sq(u), store.decay_numel(u)
        for lo, hi, g in store.optimizer_grad_chunks(u):
            args = (master[lo:hi], g, m[lo:hi], v[lo:hi], store.steps[u], decayed_in(decay, lo, hi - lo), plan.lr,
                    self.cfg)
            clip = plan.clip_coef if coef is None else coef
            if store.state_scratch is None:
                adamw_update(*args, clip)
            else:  # bf16 moments, widened through the store's fp32 scratch
                adamw_update_bf16_state(*args, store.state_scratch, clip)
        store.refresh_stream(u)
        plan.applied_units.append(u)

    # ---- CLIP_REDO ---------------------------------------------------------------------------------------------
    def _clipping_likely(self, unit: int) -> bool:
        """Speculative clipping: an unclipped update of this unit now would likely be undone, because the last
        step clipped, or certainly, because the norms landed with this unit's already exceed the max norm (or are
        not finite). Either way only the timing changes: a deferred update is applied exactly by its CLIP_REDO."""
        if self.last_step_clipped:
            return True
        partial = global_norm([float(self.unit_norms[i]) for i in self.norms_landed_with.get(unit, [])])
        return not partial <= self.max_norm  # NaN: not finite, the step will be skipped

    def clip_redo(self, t: ProgramTask) -> None:
        """Speculative clipping, once the global norm is known: a unit updated unclipped is undone and updated
        again with the clip coefficient when the norm exceeded the max, or only undone when the norm is not finite
        (the step is skipped); a deferred unit is updated, clipped, unless the step is skipped. A no-op in steps
        that needed no clipping: their speculative updates were exact. A host unit's redo runs at the start of the
        next step (step_offset -1), with the plan of the step it fixes."""
        self._clip_redo(t.unit, self._plan(t), t)

    def _clip_redo(self, u: int, plan: UpdatePlan | None, t: ProgramTask | None) -> None:
        """`clip_redo` of unit u under `plan`; t None: on the host (`flush_update`)."""
        if plan is not None and u in plan.deferred_units:  # applied once, clipped, unless the step is skipped
            if plan.skip:
                return
            if t is not None and t.stream != "cpu":  # a resident unit: on its GPU state
                self._device_update(u, self._state_views(t), plan, plan.clip_coef)
            else:
                self._host_update(u, plan)
            return
        if plan is None or u not in plan.applied_units or not (plan.skip or plan.clip_coef < 1.0):
            return
        if not self._unit_finite(u):
            return  # its own gradients were not finite: the device skipped its update (settled after the step)
        redo = None if plan.skip else plan.clip_coef
        if t is None or t.stream == "cpu":
            self._host_redo(u, plan, redo)
        else:
            master, m, v, g = self._state_views(t)
            self._redo(master, g, m, v, u, 0, plan, redo)
        if redo is None:  # undone: the step count goes back, as for an update that never ran
            self.store.steps[u] -= 1
            plan.applied_units.remove(u)
        else:
            plan.redone_units.append(u)

    def _host_redo(self, u: int, plan: UpdatePlan, coef: float | None) -> None:
        store = self.store
        master, m, v, decay = store.master(u), store.exp_avg(u), store.exp_avg_sq(u), store.decay_numel(u)
        for lo, hi, g in store.optimizer_grad_chunks(u):
            self._redo(master[lo:hi], g, m[lo:hi], v[lo:hi], u, lo, plan, coef)
        store.refresh_stream(u)

    def _redo(self, master, g, m, v, u: int, lo: int, plan: UpdatePlan, coef: float | None) -> None:
        """Undo the unit's unclipped update of this step on a (chunk of a) tile starting at element `lo`, then
        apply it again with `coef` (None: leave it undone)."""
        step, decay = self.store.steps[u], decayed_in(self.store.decay_numel(u), lo, master.numel())
        adamw_undo(master, g, m, v, step, decay, plan.lr, self.cfg)
        if coef is not None:
            adamw_update(master, g, m, v, step, decay, plan.lr, self.cfg, coef)

    def flush_update(self, plan: UpdatePlan) -> None:
        """Apply `plan` (the last step's gradients, in the landing space or kept on the GPU) to every unit on the
        host, in forward order: the end of an "overlap" run, whose updates otherwise run in the next step. With
        speculative clipping, run the last step's redos of the host units instead (their updates ran in it)."""
        if self.next_step_redo_units:
            for u in self.next_step_redo_units:
                self._clip_redo(u, plan, None)
            return
        for u, buf in self.buffers.kept.items():
            self.store.grad(u).copy_(buf.g)
        if self.buffers.kept:
            self.backend.synchronize()
        for u in self.store.units:
            if self._should_apply(u, plan) is not None:
                self._host_update(u, plan)

    # ---- STATE_PREFETCH / STATE_OFFLOAD ------------------------------------------------------------------------
    def _state_views(self, t: ProgramTask) -> list[torch.Tensor]:
        return self.buffers.holding(t).state_views(self.store.layouts[t.unit].numel)

    def state_prefetch(self, t: ProgramTask) -> None:
        self.buffers[t.slot].unit = t.unit
        master, m, v, g = self._state_views(t)
        u, store = t.unit, self.store
        master.copy_(store.master(u), non_blocking=True)
        m.copy_(store.exp_avg(u), non_blocking=True)
        v.copy_(store.exp_avg_sq(u), non_blocking=True)
        if u in self.buffers.kept:  # the gradients stayed on the GPU
            return
        landing = store.grad(u)
        if landing.dtype == torch.float32:
            g.copy_(landing, non_blocking=True)
        else:  # bf16 over the wire, widened on the device
            g.copy_(landing.to(self.backend.device, non_blocking=True))

    def state_offload(self, t: ProgramTask) -> None:
        plan = self._plan(t)
        if plan is None or plan.skip or t.unit not in plan.applied_units:
            return  # nothing changed on the device
        master, m, v, staged = self._state_views(t)
        u, store = t.unit, self.store
        store.master(u).copy_(master, non_blocking=True)
        store.exp_avg(u).copy_(m, non_blocking=True)
        store.exp_avg_sq(u).copy_(v, non_blocking=True)
        stream = store.stream_tile(u)
        if stream is not None:  # the streaming copy U staged in the gradient area
            stream.copy_(staged.view(torch.bfloat16)[:master.numel()], non_blocking=True)
