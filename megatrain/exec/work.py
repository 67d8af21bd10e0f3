"""What each task of a Program does: the bodies the runtime enqueues, over GPU slots, the host store and the
activations of one step.

GPU side (allocated once): one flat buffer per slot of the Program ("w0".."w{k-1}", "embed", "head": the unit's
weights in the wire dtype followed by an fp32 gradient area; "s0".."s{n-1}": master, m, v and gradient of a layer for
a GPU update; "g<layer>": the gradients a GPU-updated layer keeps on the GPU until its update). Weights are bound to
the layer functions as views of the slot (`UnitLayout.views`); when the wire dtype differs from the compute dtype the
flat weights are cast once per task (the one copy). Gradients of all micro-batches
accumulate in the slot's fp32 area (zeroed by micro-batch 0), and OFFLOAD sends them to the host once per step.

Activations: the running hidden state of each micro-batch; checkpoints, the inputs of the first layer of each
recompute block, kept per (layer, micro) in the compute dtype (on the host between ACT_OFFLOAD and ACT_PREFETCH);
the inputs RECOMPUTE rebuilds for a block's inner layers; the activation gradient flowing down.

Optimizer tasks read an `UpdatePlan` (learning rate, clip coefficient, skip): the current step's (step_offset 0),
set by CLIP_NORM, or the previous step's (step_offset -1, placement "overlap").
"""
from __future__ import annotations

import math

import torch

from ..ir.builders import resident_slot
from ..ir.knobs import offloaded_checkpoints, resident_units
from ..ir.program import Program, ProgramTask
from ..spec import EMBED, HEAD
from .backend import Backend, ExecError
from .head import embed_backward, embed_forward, head_loss_backward
from .layers import layer_functions
from .optim import AdamWConfig, UpdatePlan, adamw_update, clip_coefficient, global_norm
from .rope import rope_cos_sin
from .store import TORCH_DTYPES, HostRegion, HostStore


class Slot:
    """One GPU buffer. Weight slots: `w` (numel,) in the wire dtype and `g` (numel,) fp32 for gradients.
    State slots ("s<i>", `state=True`): `raw` holds master, m, v and gradient of a layer, each (numel,) fp32; after
    the update the gradient area stages the new streaming copy for STATE_OFFLOAD. Kept-gradient buffers ("g<layer>",
    `grad_only=True`): `g` (numel,) fp32 only. Resident units (`resident=True`): `w` is the fp32 master itself,
    `g` its gradients, `m` and `v` the Adam moments, all (numel,) fp32, for the whole run.

    `w` and `g` are two allocations, not one: autograd's version counter belongs to a storage, so accumulating
    into a gradient area that shared the weights' storage would invalidate the weight views autograd saved."""

    def __init__(self, backend: Backend, numel: int, wire: torch.dtype, state: bool = False,
                 grad_only: bool = False, resident: bool = False):
        self.m = self.v = None
        if resident:
            self.w = backend.empty(4 * numel).view(torch.float32)
            self.g = backend.empty(4 * numel).view(torch.float32)
            moments = backend.empty(8 * numel).view(torch.float32)
            self.m, self.v = moments[:numel], moments[numel:]
            self.nbytes = 16 * numel
        elif state:
            self.raw = backend.empty(16 * numel)
            self.w = self.g = None
            self.nbytes = 16 * numel
        elif grad_only:
            self.w = None
            self.g = backend.empty(4 * numel).view(torch.float32)
            self.nbytes = 4 * numel
        else:
            self.w = backend.empty(numel * wire.itemsize).view(wire)
            self.g = backend.empty(4 * numel).view(torch.float32)
            self.nbytes = numel * (wire.itemsize + 4)
        self.unit: int | None = None  # occupant, as of the issuing order


class StepWork:
    """Task bodies for one Program over a host store; `begin_step` binds a batch, then the runtime calls it."""

    def __init__(self, program: Program, store: HostStore, backend: Backend, cfg: AdamWConfig):
        self.program, self.store, self.backend, self.cfg = program, store, backend, cfg
        self.spec = spec = program.model
        k = self.knobs = program.knobs
        if store.spec != spec or store.knobs.weight_wire != k.weight_wire or store.knobs.grad_wire != k.grad_wire:
            raise ValueError("the host store was built for another model or wire dtypes than the Program")
        self.compute_dtype = TORCH_DTYPES[k.compute_dtype]
        self.wire_dtype = TORCH_DTYPES[k.weight_wire]
        self.exact_norm = "N" in program.tasks
        self.layer_forward, self.layer_backward = layer_functions(k.compile_layers)
        if cfg.max_grad_norm is not None and not self.exact_norm:
            raise ValueError(f"max_grad_norm={cfg.max_grad_norm} needs a schedule with clip='exact'; this one has "
                             f"clip={k.clip!r} (set max_grad_norm=None, or use an exact-clipping schedule)")
        self.handlers = {"P": self.prefetch, "F": self.forward, "R": self.recompute, "B": self.backward,
                         "O": self.offload, "N": self.clip_norm, "U": self.update, "S": self.state_prefetch,
                         "W": self.state_offload, "X": self.act_offload, "Y": self.act_prefetch}
        self.resident = resident_units(spec, k)
        self.slots = self._allocate_slots()
        self.load_resident()
        self.checkpoint_layers = set(range(0, spec.num_layers, k.recompute_block))
        self.unit_index = {u: i for i, u in enumerate(store.units)}
        # Per-unit gradient norms, computed on the device by OFFLOAD and landed next to the gradients.
        self.unit_norms = torch.zeros(len(store.units), dtype=torch.float32, pin_memory=backend.pins_host_memory)
        # The same norms on the device, for GPU updates that must skip non-finite gradients without a host wait.
        self.device_norms = torch.zeros(len(store.units), dtype=torch.float32, device=backend.device)
        self.act_host: dict[tuple[int, int], torch.Tensor] = {}
        self._act_region: HostRegion | None = None
        if k.offload_checkpoints:
            self._allocate_act_host()
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.current: UpdatePlan | None = None
        self.pending: UpdatePlan | None = None

    # ---- allocation --------------------------------------------------------------------------------------------
    def _allocate_slots(self) -> dict[str, Slot]:
        names = {n for t in self.program.tasks.values() for n in (t.slot, t.fills) if n}
        numel = {u: self.store.layouts[u].numel for u in self.store.units}
        layer = numel[0] if self.spec.num_layers else 0
        slots = {}
        for u in self.resident:
            slots[resident_slot(u)] = Slot(self.backend, numel[u], torch.float32, resident=True)
            slots[resident_slot(u)].unit = u
        for name in sorted(names - set(slots)):
            if name[0] == "s" and name[1:].isdigit():  # master, m, v, gradient of one layer, all fp32
                slots[name] = Slot(self.backend, layer, torch.float32, state=True)
            elif name[0] == "g" and name[1:].isdigit():  # a layer's gradients kept on the GPU, fp32
                slots[name] = Slot(self.backend, layer, torch.float32, grad_only=True)
            else:
                n = numel[EMBED] if name == "embed" else numel[HEAD] if name == "head" else layer
                slots[name] = Slot(self.backend, n, self.wire_dtype)
        return slots

    def _allocate_act_host(self) -> None:
        M, p = self.knobs.micro_batches, self.program
        n = (p.batch // M) * p.seq * self.spec.hidden_size
        keys = [(l0, m) for l0 in offloaded_checkpoints(self.spec, self.knobs) for m in range(M)]
        self._act_region = HostRegion(self.backend, self.compute_dtype, {i: n for i in range(len(keys))})
        self._act_region.pin(range(len(keys)))
        self.act_host = {key: self._act_region.tiles[i] for i, key in enumerate(keys)}

    def load_resident(self) -> None:
        """Bring the resident units' master weights and Adam moments from the host store to their GPU buffers."""
        for u in self.resident:
            slot = self.slots[resident_slot(u)]
            slot.w.copy_(self.store.master(u))
            slot.m.copy_(self.store.exp_avg(u))
            slot.v.copy_(self.store.exp_avg_sq(u))
        self.backend.synchronize()

    def sync_resident_to_host(self) -> None:
        """Write the resident units' master weights and moments back to the host store (whose copies of those
        units are stale while the run goes on): before anyone reads the store, and before this StepWork goes."""
        for u in self.resident:
            slot = self.slots[resident_slot(u)]
            self.store.master(u).copy_(slot.w)
            self.store.exp_avg(u).copy_(slot.m)
            self.store.exp_avg_sq(u).copy_(slot.v)
        if self.resident:
            self.backend.synchronize()
            for u in self.resident:
                self.store.refresh_stream(u)

    def gpu_bytes(self) -> int:
        """Bytes of all slot buffers (the Program's `memory.buffers_bytes`)."""
        return sum(s.nbytes for s in self.slots.values())

    def act_host_bytes(self) -> int:
        return self._act_region.payload_bytes if self._act_region else 0

    # ---- step --------------------------------------------------------------------------------------------------
    def begin_step(self, ids: torch.Tensor, targets: torch.Tensor, current: UpdatePlan,
                   pending: UpdatePlan | None) -> None:
        """Bind one batch (ids, targets: (B, T) int64, targets -100 = no loss) and the update plans."""
        p, M = self.program, self.knobs.micro_batches
        if tuple(ids.shape) != (p.batch, p.seq) or tuple(targets.shape) != (p.batch, p.seq):
            raise ValueError(f"batch has ids {tuple(ids.shape)} and targets {tuple(targets.shape)}; this Program "
                             f"runs (batch, seq) = ({p.batch}, {p.seq})")
        n_valid = int((targets != -100).sum())
        if n_valid == 0:
            raise ValueError("every target of the batch is -100: there is no token to compute a loss on")
        dev = self.backend.device
        self.ids = ids.to(dev, torch.int64).chunk(M)  # M x (mb, T)
        self.targets = targets.to(dev, torch.int64).chunk(M)
        self.n_valid, self.loss_scale = n_valid, 1.0 / n_valid
        if p.seq not in self._rope:
            self._rope[p.seq] = rope_cos_sin(self.spec, p.seq, dev, self.compute_dtype)
        self.cos, self.sin = self._rope[p.seq]
        self.hidden: dict[int, torch.Tensor] = {}  # micro -> running activation (mb, T, d)
        self.checkpoints: dict[tuple[int, int], torch.Tensor] = {}  # (layer, micro) -> its input
        self.recomputed: dict[tuple[int, int], torch.Tensor] = {}  # (layer, micro) -> input rebuilt by R
        self.grad_hidden: dict[int, torch.Tensor] = {}  # micro -> gradient w.r.t. the current activation
        self.loss_sums: dict[int, torch.Tensor] = {}
        self.current, self.pending = current, pending

    def loss(self) -> float:
        """Mean loss over the batch's valid tokens (call after the step's work is done)."""
        return float(sum(float(v) for v in self.loss_sums.values())) / self.n_valid

    def __call__(self, task: ProgramTask) -> None:
        self.handlers[task.kind](task)

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _slot(self, task: ProgramTask) -> Slot:
        slot = self.slots[task.slot]
        if slot.unit != task.unit:
            raise ExecError(f"{task.id} reads slot {task.slot}, which holds unit {slot.unit}, not {task.unit}: "
                            "the Program's slot assignment is inconsistent")
        return slot

    def _weights(self, task: ProgramTask) -> dict[str, torch.Tensor]:
        """HF-named weight views of the task's slot, in the compute dtype where the layer math needs it."""
        layout = self.store.layouts[task.unit]
        flat = self._slot(task).w[:layout.numel]
        if flat.dtype == self.compute_dtype or task.unit == EMBED:  # the embedding casts only the rows it gathers
            return layout.views(flat)
        if task.unit == HEAD:  # head_loss_backward casts lm_head once itself; the norm is an autograd leaf here
            w = layout.views(flat)
            w["norm.weight"] = w["norm.weight"].to(self.compute_dtype)
            return w
        # Cast before binding, so the autograd leaves are in the compute dtype and gradients keep its precision.
        return layout.views(flat.to(self.compute_dtype))

    def _grads(self, task: ProgramTask) -> dict[str, torch.Tensor]:
        layout = self.store.layouts[task.unit]
        slot = self._slot(task)
        if task.micro == 0:  # the first micro-batch of the step starts the accumulation
            slot.g[:layout.numel].zero_()
        return layout.views(slot.g[:layout.numel])

    def _layer_input(self, layer: int, micro: int, pop: bool) -> torch.Tensor:
        store = self.checkpoints if layer in self.checkpoint_layers else self.recomputed
        key = (layer, micro)
        if key not in store:
            raise ExecError(f"the input of layer {layer}, micro-batch {micro} is not on the device "
                            "(no checkpoint, recompute or activation prefetch produced it)")
        return store.pop(key) if pop else store[key]

    def _stream(self, name: str):
        return self.backend.stream(name)

    # ---- copies ------------------------------------------------------------------------------------------------
    def prefetch(self, t: ProgramTask) -> None:
        slot = self.slots[t.slot]
        for off, src in self.store.stream_segments(t.unit):
            slot.w[off:off + src.numel()].copy_(src, non_blocking=True)
        slot.unit = t.unit

    def offload(self, t: ProgramTask) -> None:
        n = self.store.layouts[t.unit].numel
        g = self._slot(t).g[:n]
        i = self.unit_index[t.unit]
        resident = t.unit in self.resident  # its gradients stay where they are: only their norm is taken
        if not resident:
            self.store.gradients_landing(t.unit)
            landing = self.store.grad(t.unit)
        wire = g if resident or landing.dtype == g.dtype else g.to(landing.dtype)  # rounded on the device
        # The norm of what lands (and is applied), computed where the gradients are, in fp32; kept on the device
        # too, for GPU updates that decide a skip there.
        norm = torch.linalg.vector_norm(wire, dtype=torch.float32).reshape(1)
        self.device_norms[i:i + 1].copy_(norm)
        self.unit_norms[i:i + 1].copy_(norm, non_blocking=True)
        if resident:
            return
        if t.fills:  # kept on the GPU for its update there: a device copy, in the values the wire would carry
            self.slots[t.fills].g.copy_(wire, non_blocking=True)
        else:
            landing.copy_(wire, non_blocking=True)

    def act_offload(self, t: ProgramTask) -> None:
        key = (t.unit, t.micro)
        x = self.checkpoints.pop(key)
        self.act_host[key].view(x.shape).copy_(x, non_blocking=True)
        self.backend.keep_alive(x, self._stream("d2h"))  # allocated on compute, read here

    def act_prefetch(self, t: ProgramTask) -> None:
        key = (t.unit, t.micro)
        shape = (self.program.batch // self.knobs.micro_batches, self.program.seq, self.spec.hidden_size)
        x = torch.empty(shape, dtype=self.compute_dtype, device=self.backend.device)
        x.copy_(self.act_host[key].view(shape), non_blocking=True)
        self.backend.keep_alive(x, self._stream("compute"))  # allocated here, read by compute
        self.checkpoints[key] = x

    # ---- compute -----------------------------------------------------------------------------------------------
    def forward(self, t: ProgramTask) -> None:
        u, m = t.unit, t.micro
        w = self._weights(t)
        if u == HEAD:  # loss forward and backward, fused and chunked
            loss_sum, grad_x, _ = head_loss_backward(w, self.hidden.pop(m), self.targets[m], self.spec,
                                                     self.knobs.loss_chunk_tokens, self.loss_scale, self._grads(t))
            self.loss_sums[m], self.grad_hidden[m] = loss_sum, grad_x
            return
        if u == EMBED:
            x = embed_forward(w["embed_tokens.weight"], self.ids[m], self.compute_dtype)  # (mb, T, d)
            nxt = 0
        else:
            x = self.layer_forward(w, self.hidden[m], self.cos, self.sin, self.spec)  # (mb, T, d)
            nxt = u + 1
        self.hidden[m] = x
        if nxt in self.checkpoint_layers:
            self.checkpoints[(nxt, m)] = x

    def recompute(self, t: ProgramTask) -> None:
        x = self._layer_input(t.unit, t.micro, pop=False)
        self.recomputed[(t.unit + 1, t.micro)] = self.layer_forward(self._weights(t), x, self.cos, self.sin,
                                                                    self.spec)

    def backward(self, t: ProgramTask) -> None:
        u, m = t.unit, t.micro
        if u == EMBED:
            embed_backward(self.grad_hidden.pop(m), self.ids[m], self._grads(t)["embed_tokens.weight"])
            return
        x = self._layer_input(u, m, pop=True)
        self.grad_hidden[m] = self.layer_backward(self._weights(t), x, self.cos, self.sin, self.spec,
                                                  self.grad_hidden[m], self._grads(t))

    # ---- optimizer ---------------------------------------------------------------------------------------------
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
            plan.clip_coef = clip_coefficient(plan.grad_norm, self.cfg.max_grad_norm)

    def _plan(self, t: ProgramTask) -> UpdatePlan | None:
        return self.pending if t.step_offset == -1 else self.current

    def _unit_finite(self, unit: int) -> bool:
        """Without a global norm (clip="none"), a unit is updated only if its own gradients are finite."""
        units = [EMBED, HEAD] if self.spec.tie_word_embeddings and unit == EMBED else [unit]
        return all(math.isfinite(float(self.unit_norms[self.unit_index[u]])) for u in units)

    def _should_apply(self, unit: int, plan: UpdatePlan | None, on_device: bool = False) -> UpdatePlan | None:
        if plan is None or plan.skip or unit in plan.skipped_units:
            return None
        if not self.exact_norm and on_device:  # the kernel skips it if need be (`_device_skip`)
            return plan
        if not self.exact_norm and not self._unit_finite(unit):
            plan.skipped_units.append(unit)
            return None
        return plan

    def update(self, t: ProgramTask) -> None:
        """AdamW on one unit: on the host tiles (cpu stream) or on a GPU state slot (compute stream)."""
        # A GPU update of this step's gradients without a global norm ("arrival-split") cannot read the unit's norm
        # on the host yet (it is still landing): the device decides the skip.
        on_device = t.stream != "cpu" and t.step_offset == 0 and not self.exact_norm
        plan = self._should_apply(t.unit, self._plan(t), on_device)
        if t.stream == "cpu":
            if plan is not None:  # None: step 0 of "overlap" (no gradients yet), or a skipped step / unit
                self._host_update(t.unit, plan)
            return
        u, store = t.unit, self.store
        master, m, v, g = self._state_views(t)
        if plan is not None:
            store.steps[u] += 1
            found_inf = self._device_skip(u) if on_device else None
            adamw_update(master, self._kept_grads(u, g), m, v, store.steps[u], store.decay_numel(u), plan.lr,
                         self.cfg, plan.clip_coef, found_inf)
            plan.applied_units.append(u)
            if on_device:
                plan.device_checked.append(u)
            if store.stream_tile(u) is not None and u not in self.resident:  # stage the streaming copy for W
                g.view(torch.bfloat16)[:master.numel()].copy_(master)
        if t.fills:  # "overlap-split": the (updated) master is the weights of this layer's forward
            slot = self.slots[t.fills]
            slot.w[:master.numel()].copy_(master)  # cast to the wire dtype, as the host's streaming copy is
            slot.unit = u

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

    def _host_update(self, u: int, plan: UpdatePlan) -> None:
        store = self.store
        store.steps[u] += 1
        master, m, v, decay = store.master(u), store.exp_avg(u), store.exp_avg_sq(u), store.decay_numel(u)
        for lo, hi, g in store.optimizer_grad_chunks(u):
            adamw_update(master[lo:hi], g, m[lo:hi], v[lo:hi], store.steps[u], min(max(decay - lo, 0), hi - lo),
                         plan.lr, self.cfg, plan.clip_coef)
        store.refresh_stream(u)
        plan.applied_units.append(u)

    def flush_update(self, plan: UpdatePlan) -> None:
        """Apply `plan` (the last step's gradients, in the landing space or kept on the GPU) to every unit on the
        host, in forward order: the end of an "overlap" run, whose updates otherwise run in the next step."""
        kept = [(int(name[1:]), slot) for name, slot in self.slots.items() if slot.w is None and slot.g is not None]
        for u, slot in kept:
            self.store.grad(u).copy_(slot.g)
        if kept:
            self.backend.synchronize()
        for u in self.store.units:
            if self._should_apply(u, plan) is not None:
                self._host_update(u, plan)

    def _state_views(self, t: ProgramTask) -> list[torch.Tensor]:
        n = self.store.layouts[t.unit].numel
        if t.unit in self.resident:
            slot = self._slot(t)
            return [slot.w, slot.m, slot.v, slot.g]
        flat = self._slot(t).raw.view(torch.float32)
        return [flat[i * n:(i + 1) * n] for i in range(4)]  # master, m, v, gradient (or staging)

    def _kept_grads(self, unit: int, streamed: torch.Tensor) -> torch.Tensor:
        """The gradients of a GPU update: kept on the GPU ("g<layer>") or streamed into the state slot."""
        kept = self.slots.get(f"g{unit}")
        return kept.g if kept is not None else streamed

    def state_prefetch(self, t: ProgramTask) -> None:
        self.slots[t.slot].unit = t.unit
        master, m, v, g = self._state_views(t)
        u, store = t.unit, self.store
        master.copy_(store.master(u), non_blocking=True)
        m.copy_(store.exp_avg(u), non_blocking=True)
        v.copy_(store.exp_avg_sq(u), non_blocking=True)
        if f"g{u}" in self.slots:  # the gradients stayed on the GPU
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
