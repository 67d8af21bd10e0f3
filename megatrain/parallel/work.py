"""Bodies of the tasks that change under data parallelism: PREFETCH of the rank's slice, ALL_GATHER,
REDUCE_SCATTER (with the unit's norm) and OFFLOAD of the slice. Compute, updates and the global norm are the
one-GPU bodies, reading the rank's slices of the host store (megatrain/parallel/shard.py).

A slot of an n-element unit holds N equal slices of s elements (N*s >= n, megatrain/compile/collectives.py); rank r's is
`[r*s, (r+1)*s)`. All collectives run on the `comm` stream thread, in Program order, so every rank issues the same
sequence. NCCL (CUDA) gathers and reduce-scatters in place; gloo (the CPU backend, CI) has no reduce-scatter, so
there it all-reduces the slot and keeps the slice: same sums, more bytes. megatrain/parallel/sharded.py registers
these bodies with the executor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatrain.ir.placement import shard_numel
from megatrain.ir.program import ProgramTask
from megatrain.parallel.shard import ShardedHostStore
from megatrain.parallel.world import World


class ShardedCopies:
    """P, G, Z and O bodies for rank `world.rank`; `norms` are the Updates' per-unit norm tensors (host, device)."""

    def __init__(self, world: World, store: ShardedHostStore, buffers, updates, backend):
        self.world, self.store, self.buffers, self.updates, self.backend = world, store, buffers, updates, backend
        self.nccl = dist.get_backend(world.device_group) == "nccl"

    def _span(self, unit: int) -> tuple[int, int, int]:
        """(n, s, lo): the unit's elements, the slice length, where this rank's slice starts in the slot."""
        n = self.store.layouts[unit].numel
        s = shard_numel(n, self.world.size)
        return n, s, self.world.rank * s

    # ---- PREFETCH: the rank's slice of the streaming copy --------------------------------------------------------
    def prefetch(self, t: ProgramTask) -> None:
        buf = self.buffers[t.slot]
        _, s, lo = self._span(t.unit)
        (_, src), = self.store.stream_segments(t.unit)  # untied units: one segment, the slice
        buf.w[lo:lo + s].copy_(src, non_blocking=True)
        buf.unit = t.unit

    def _collective(self, t: ProgramTask, start) -> None:
        """Issue a collective (`start()` returns its Work) and wait for it; a peer that died is the world's one line
        naming it (World.guard), not the backend's address."""
        # NCCL: the comm stream waits for the collective; gloo: done
        self.world.guard(f"running {t.id} on stream {t.stream}", lambda: start().wait())

    # ---- ALL_GATHER: the other ranks' slices into the slot ---------------------------------------------------------
    def gather(self, t: ProgramTask) -> None:
        buf = self.buffers.holding(t)
        _, s, lo = self._span(t.unit)
        w = buf.w[:s * self.world.size]
        if self.nccl:
            self._collective(t, lambda: dist.all_gather_into_tensor(w, w[lo:lo + s], group=self.world.device_group,
                                                                    async_op=True))
        else:
            self._collective(t, lambda: dist.all_gather(list(w.split(s)), w[lo:lo + s].clone(),
                                                        group=self.world.device_group, async_op=True))

    # ---- REDUCE_SCATTER: this rank's slice of the summed gradients, and the unit's norm ---------------------------
    def reduce_scatter(self, t: ProgramTask) -> None:
        buf = self.buffers.holding(t)
        n, s, lo = self._span(t.unit)
        N, group = self.world.size, self.world.device_group
        g = buf.g[:s * N]
        g[n:].zero_()  # the padding past the unit's end (never written by the backward)
        if self.nccl:
            self._collective(t, lambda: dist.reduce_scatter_tensor(g[lo:lo + s], g, group=group, async_op=True))
        else:
            self._collective(t, lambda: dist.all_reduce(g, group=group, async_op=True))
        # The norm of what lands (in the grad wire's values), from the slices' squared norms, identical on every
        # rank: clipping and the non-finite skip decide the same everywhere.
        wire = self._wire(g[lo:lo + s])
        sq = torch.linalg.vector_norm(wire, dtype=torch.float32).square().reshape(1)
        self._collective(t, lambda: dist.all_reduce(sq, group=group, async_op=True))
        i = self.updates.unit_index[t.unit]
        self.updates.device_norms[i:i + 1].copy_(sq.sqrt())
        self.updates.unit_norms[i:i + 1].copy_(self.updates.device_norms[i:i + 1], non_blocking=True)

    def _wire(self, g: torch.Tensor) -> torch.Tensor:
        dtype = self.store.grad_dtype
        return g if g.dtype == dtype else g.to(dtype)

    # ---- OFFLOAD: the slice to the host ---------------------------------------------------------------------------
    def offload(self, t: ProgramTask) -> None:
        buf = self.buffers.holding(t)
        _, s, lo = self._span(t.unit)
        self.store.gradients_landing(t.unit)
        self.store.grad(t.unit).copy_(self._wire(buf.g[lo:lo + s]), non_blocking=True)
