"""The runtime's operating point: its copies and its CPU update, measured on its own objects.

A profile measured on buffers of its own, at sizes of its own, with an update loop of its own, priced the runtime's
updates and gradient offloads too slow (issue 24: 0.69x and 0.51x the profile's time on an H100 host). Here the
profiler builds what the runtime builds for a 2-layer cut of the model (the host store of the schedule's layout, its
Program, its GPU buffers and its `Updates`) and measures, on the workers that stand in for the runtime's stream
threads:

- the copies as the runtime issues them: a layer's weights in the weight wire dtype from the store's pinned
  streaming tiles (what PREFETCH copies, `HostStore.stream_segments`) into a device buffer of the layer's size, and
  its gradients from an fp32 device area into the store's pinned landing tile in the gradient wire dtype (what
  OFFLOAD copies, cast on the device first when the wire is bf16); each alone, both at once (the runtime overlaps a
  PREFETCH with an OFFLOAD), and beside a running CPU update (`copies.measure_pair`, `host.measure_contention`);
- the CPU update as the runtime runs it: `exec.updates.Updates.update` on the layer's U task (host AdamW over the
  store's gradient chunks, bf16 moments through its scratch, the streaming-copy refresh), at the runtime's update
  threads, alone and beside each copy mix, at the schedule's weight wire and at the other one (the bf16 wire's
  update also refreshes the streaming copy: its own bytes in the host fit);
- the redo of speculative clipping (`Updates.clip_redo` of an update that has to be clipped after all: undo, then
  the update again with the clip coefficient), alone.

These fill the profile's copy curves at the runtime's sizes, its duplex cap, the host memory fit and the CPU
update rate (profiling/assemble.py says which number goes where).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.compile.lower import lower
from megatrain.compile.resolve import resolve_host_layout
from megatrain.exec.backend import Backend
from megatrain.exec.buffers import DeviceBuffers
from megatrain.exec.optim import AdamWConfig, UpdatePlan
from megatrain.exec.store import HostStore
from megatrain.exec.updates import Updates
from megatrain.ir.placement import WIRE_DTYPES
from megatrain.ir.program import ProgramTask
from megatrain.model.spec import ModelSpec
from megatrain.profiling import copies, host
from megatrain.profiling.bench import Worker, median
from megatrain.profiling.overhead import profile_cut

UPDATE_PATH = "exec.updates.Updates.update"  # what the update measurement calls (recorded, and tested)
REDO_PATH = "exec.updates.Updates.clip_redo"
_CFG = AdamWConfig(lr=1e-5, weight_decay=0.1)
CUT_VOCAB = 2048  # the vocabulary of the cut measured here (RuntimeCut): its embedding and head are not measured


def conversion_passes(store: HostStore) -> int:
    """bf16 <-> fp32 passes of the store's CPU update besides AdamW (as sim/costs.py counts them): the streaming
    copy's refresh, the bf16 gradients' widening, and bf16 moments (widened and rounded back: two)."""
    lay = store.layout
    return (lay.weight_wire == "bf16") + (lay.grad_wire == "bf16") + 2 * (lay.state_dtype == "bf16")


class RuntimeCut:
    """The runtime's objects for a 2-layer cut of `spec` under `knobs`: host store, Program, buffers, updates; and
    device buffers of one layer's size for the copies. Built in the calling thread (a Worker's, on CUDA)."""

    def __init__(self, spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: Backend):
        self.cut, knobs = profile_cut(spec, knobs)
        # Only a decoder layer is measured; the embedding and head only size the cut's store and buffers. At
        # llama3-8b's 128 K vocabulary they were 1.05 B of the cut's 1.5 B parameters, most of the 16 s this
        # measurement took on an H200 (issue 24: `--quick` <= 60 s), so the cut gets a small vocabulary.
        self.cut = replace(self.cut, vocab_size=min(self.cut.vocab_size, CUT_VOCAB))
        # The layer measured: the first streamed one (every decoder layer of a model has the same shape).
        self.unit = knobs.resident_layers
        self.backend = backend
        self.store = HostStore(self.cut, resolve_host_layout(self.cut, knobs), backend)
        self.program = lower(build_schedule(self.cut, batch, seq, knobs))
        self.buffers = DeviceBuffers(self.program, self.store, backend)
        self.updates = Updates(self.program, self.store, self.buffers, backend, _CFG)
        # Values of a trained layer's scale (no denormals; AdamW's speed does not depend on them).
        self.store.master(self.unit).fill_(0.02)
        self.store.grad(self.unit).fill_(1e-3)
        self.store.refresh_stream(self.unit)
        self.params = self.store.master(self.unit).numel()
        self.passes = conversion_passes(self.store)
        # PREFETCH's copy: the streaming segments of the layer into a device buffer in the weight wire dtype.
        segs = self.store.stream_segments(self.unit)
        numel = self.store.layouts[self.unit].numel
        self.weights = backend.empty(numel * self.store.wire_dtype.itemsize).view(self.store.wire_dtype)
        self._in = [(self.weights[off:off + src.numel()], src) for off, src in segs]
        self.weight_bytes = sum(src.numel() * src.element_size() for _, src in segs)
        # OFFLOAD's copy: the fp32 gradient area into the pinned landing tile, in the gradient wire dtype.
        self.grads = backend.empty(4 * numel).view(torch.float32).fill_(1e-3)
        self.landing = self.store.grad(self.unit)
        self.grad_bytes = self.landing.numel() * self.landing.element_size()
        self.update_task = self._host_task("U")
        backend.synchronize()  # the fills above are done before another stream's copy reads them

    def _host_task(self, kind: str) -> ProgramTask:
        """The Program's task of `kind` on the measured layer, as a host task of this step (a schedule that updates
        layers on the GPU still updates some units on the host; the host path is the one priced by the rate)."""
        found = [t for t in self.program.tasks.values() if t.kind == kind and t.unit == self.unit]
        if not found:
            raise AssertionError(f"the Program of {self.cut.name} has no {kind} task of layer {self.unit}")
        return replace(found[0], stream="cpu", step_offset=0, fills=None)

    def copy_in(self) -> None:
        for dst, src in self._in:
            dst.copy_(src, non_blocking=True)

    def copy_out(self) -> None:
        wire = self.grads if self.landing.dtype == torch.float32 else self.grads.to(self.landing.dtype)
        self.landing.copy_(wire, non_blocking=True)

    def update(self) -> None:
        """One host update of the layer by the runtime's own task body (a fresh plan: nothing clipped or skipped)."""
        plan = UpdatePlan(step=0, lr=_CFG.lr)
        self.updates.begin_step(plan, plan)
        self.updates.update(self.update_task)

    def redo(self) -> None:
        """One CLIP_REDO of the layer's host update in a step that clips: undo, then update with the coefficient."""
        plan = UpdatePlan(step=0, lr=_CFG.lr, clip_coef=0.5, applied_units=[self.unit])
        # undo divides by the bias correction of a step >= 1
        self.store.steps[self.unit] = max(1, self.store.steps[self.unit])
        self.updates.begin_step(plan, plan)
        self.updates.clip_redo(self.update_task)


def measure_operating_point(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: Backend,
                            w: dict[str, Worker], threads: int, budget_s: float, quick: bool) -> dict:
    """The record of the runtime's copies and update (module docstring). `w`: the workers by stream.

    The update beside the copies is measured at both weight wires (`contention` at the schedule's, `contention_other`
    at the other one): the bf16 wire's update also refreshes the streaming copy, and that pass, not AdamW, is what
    the copies slow down (profiling/host.fit_host_memory_wires), so one wire's fit misprices the other's."""
    cut = w["cpu"].call(RuntimeCut, spec, batch, seq, knobs, backend)
    try:
        rec: dict = {"unit": cut.unit, "params": cut.params, "passes": cut.passes, "threads": threads,
                     "weight_bytes": cut.weight_bytes, "grad_bytes": cut.grad_bytes,
                     "update_path": UPDATE_PATH, "redo_path": REDO_PATH}
        rec["copies"] = copies.measure_pair(w["h2d"], w["d2h"], cut.copy_in, cut.copy_out, cut.weight_bytes,
                                            cut.grad_bytes, quick)
        c = _contention(cut, w, threads, budget_s, quick)
        rec["contention"] = c
        before = w["cpu"].call(torch.get_num_threads)
        try:
            w["cpu"].call(torch.set_num_threads, threads)
            # a few calls: the undo is plain torch ops, many times the fused update's time (x20 on a CPU host)
            rec["redo_s"] = median(w["cpu"].time(cut.redo, 2 if quick else 4, warmup=1))
        finally:
            w["cpu"].call(torch.set_num_threads, before)
        rec["redo_over_update"] = rec["redo_s"] / c["update_alone_s"]
    finally:
        w["cpu"].call(_release, cut)
    other = replace(knobs, weight_wire=next(w for w in WIRE_DTYPES if w != knobs.weight_wire))
    cut = w["cpu"].call(RuntimeCut, spec, batch, seq, other, backend)
    try:
        rec["contention_other"] = _contention(cut, w, threads, budget_s / 2, quick)
        rec["contention_other"]["weight_wire"] = other.weight_wire
    finally:
        w["cpu"].call(_release, cut)
    return rec


def _contention(cut: RuntimeCut, w: dict[str, Worker], threads: int, budget_s: float, quick: bool) -> dict:
    """The cut's update alone and beside its own copies, and the copies beside it (host.measure_contention)."""
    c = host.measure_contention(w["cpu"], cut.update, threads, w["h2d"], w["d2h"], cut.copy_in, cut.copy_out,
                                cut.weight_bytes, budget_s, quick, out_bytes=cut.grad_bytes)
    c.update(params=cut.params, passes=cut.passes, source="operating point")
    return c


def _release(cut: RuntimeCut) -> None:
    """Drop the cut's device buffers in the thread that allocated them (the store unpins when collected)."""
    cut.buffers = cut.updates = cut.weights = cut.grads = None
