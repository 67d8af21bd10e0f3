"""GPU buffers of a Program, allocated from its placement's buffer table (one class per `BufferKind`).

    WEIGHTS     `w` (numel,) in the wire dtype and `g` (numel,) fp32: a unit's weights and the gradients its
                backward accumulates (the layer ring "w0".., "embed", "head")
    STATE       `raw` (16 numel bytes): fp32 master, m, v and gradient of a layer for a streamed GPU update; after
                the update the gradient area stages the new streaming copy for STATE_OFFLOAD ("s0"..)
    KEPT_GRADS  `g` (numel,) fp32: a GPU-updated layer's gradients, kept until its update ("g<layer>")
    RESIDENT    `w` the fp32 master itself, `g` its gradients, `m` and `v` the moments, all (numel,) fp32, for the
                whole run ("r<layer>", or "embed" / "head" when those are resident)

`w` and `g` are two allocations, not one: autograd's version counter belongs to a storage, so accumulating into a
gradient area that shared the weights' storage would invalidate the weight views autograd saved.
"""
from __future__ import annotations

import torch

from megatrain.ir.placement import Buffer, BufferKind
from megatrain.ir.program import Program, ProgramTask
from megatrain.exec.backend import Backend, ExecError
from megatrain.exec.store import TORCH_DTYPES, HostStore


class DeviceBuffer:
    """One GPU buffer; `unit` is its occupant as of the issuing order (fixed for kept and resident buffers)."""

    w: torch.Tensor | None = None
    g: torch.Tensor | None = None
    m: torch.Tensor | None = None
    v: torch.Tensor | None = None
    raw: torch.Tensor | None = None

    def __init__(self, spec: Buffer, backend: Backend, wire: torch.dtype):
        n = spec.numel
        self.kind, self.unit = spec.kind, spec.unit
        if spec.kind is BufferKind.WEIGHTS:
            self.w = backend.empty(n * wire.itemsize).view(wire)
            self.g = backend.empty(4 * n).view(torch.float32)
            self.nbytes = n * (wire.itemsize + 4)
        elif spec.kind is BufferKind.STATE:
            self.raw = backend.empty(16 * n)
            self.nbytes = 16 * n
        elif spec.kind is BufferKind.KEPT_GRADS:
            self.g = backend.empty(4 * n).view(torch.float32)
            self.nbytes = 4 * n
        else:  # RESIDENT
            self.w = backend.empty(4 * n).view(torch.float32)
            self.g = backend.empty(4 * n).view(torch.float32)
            moments = backend.empty(8 * n).view(torch.float32)
            self.m, self.v = moments[:n], moments[n:]
            self.nbytes = 16 * n
        if self.nbytes != spec.nbytes:
            raise AssertionError(f"buffer {spec.name}: allocated {self.nbytes} bytes, the Program plans {spec.nbytes}")

    def state_views(self, numel: int) -> list[torch.Tensor]:
        """fp32 master, m, v and gradient (or staging area) of the unit the buffer holds, each (numel,)."""
        if self.kind is BufferKind.RESIDENT:
            return [self.w, self.m, self.v, self.g]
        flat = self.raw.view(torch.float32)
        return [flat[i * numel:(i + 1) * numel] for i in range(4)]


class DeviceBuffers:
    """Every buffer of the Program's placement, by name; resident units loaded from (and synced to) the store."""

    def __init__(self, program: Program, store: HostStore, backend: Backend):
        self.placement, self.store, self.backend = program.placement, store, backend
        wire = TORCH_DTYPES[self.placement.weight_wire]
        self.by_name = {b.name: DeviceBuffer(b, backend, wire) for b in self.placement.buffers}
        self.resident = {b.unit: self.by_name[b.name] for b in self.placement.buffers if b.kind is BufferKind.RESIDENT}
        self.kept = {b.unit: self.by_name[b.name] for b in self.placement.buffers
                     if b.kind is BufferKind.KEPT_GRADS}
        self.load_resident()

    def __getitem__(self, name: str) -> DeviceBuffer:
        return self.by_name[name]

    def holding(self, task: ProgramTask) -> DeviceBuffer:
        """The buffer `task` reads, checked to hold the task's unit (as of the issuing order)."""
        buf = self.by_name[task.slot]
        if buf.unit != task.unit:
            raise ExecError(f"{task.id} reads slot {task.slot}, which holds unit {buf.unit}, not {task.unit}: "
                            "the Program's slot assignment is inconsistent")
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers (the Program's `memory.buffers_bytes`)."""
        return sum(b.nbytes for b in self.by_name.values())

    def load_resident(self) -> None:
        """Bring the resident units' master weights and Adam moments from the host store to their GPU buffers."""
        for u, buf in self.resident.items():
            buf.w.copy_(self.store.master(u))
            buf.m.copy_(self.store.exp_avg(u))
            buf.v.copy_(self.store.exp_avg_sq(u))
        self.backend.synchronize()

    def sync_resident_to_host(self) -> None:
        """Write the resident units' master weights and moments back to the host store (whose copies of those
        units are stale while the run goes on): before anyone reads the store, and before these buffers go."""
        for u, buf in self.resident.items():
            self.store.master(u).copy_(buf.w)
            self.store.exp_avg(u).copy_(buf.m)
            self.store.exp_avg_sq(u).copy_(buf.v)
        if self.resident:
            self.backend.synchronize()
            for u in self.resident:
                self.store.refresh_stream(u)
