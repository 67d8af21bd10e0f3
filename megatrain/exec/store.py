"""Host store: the model's parameters, optimizer state and gradient landing space, in host memory.

Per unit (embedding, each layer, head) one contiguous tile of each kind, in `unit_layout` order, so every copy
between host and GPU is one memcpy per unit:

    fp32 master     the weights the optimizer updates              4 B/param
    adam m, adam v  AdamW moments (fp32)                           8 B/param
    streaming copy  bf16 copy of the master, what PREFETCH sends   2 B/streamed param (weight_wire="bf16" only;
                    with "fp32" the master itself is streamed)
    gradients       landing space of OFFLOAD, in the grad wire dtype   4 | 2 B/streamed param; with a gradient
                    ring (HostLayout.grad_ring = K) instead K tiles, each the size of the largest unit, that the
                    units share in turn (the Program makes each OFFLOAD wait for the readers of its tile's
                    previous unit): with weight_wire="fp32" the store is then master + m + v, 12 B/param
    adam m, v in bf16  HostLayout.state_dtype="bf16": 2 + 2 B/param; the update widens them to fp32 chunk by
                    chunk in a small scratch (optim.adamw_update_bf16_state)

Layers resident on the GPU (HostLayout.resident_layers) have master and moments here (what checkpoints and schedule
switches read, synced from the GPU first) but no streaming copy and no landing tile: they are never streamed and
their gradients stay on the GPU.

Each kind is ONE host allocation carved into page-aligned tiles, so pinning does not go through torch's caching
host allocator (which rounds every block up to a power of two, up to 2x the memory). Only what DMA touches is
pinned (CUDA: cudaHostRegister of the tile range): the streaming copy (or the master for fp32 wire), the gradients,
and master + moments of the layers a GPU optimizer updates. The CPU backend pins nothing.

Tied embeddings: the embedding owns the one master and moments of the shared matrix. The head's optimizer state
covers only its norm; its lm_head exists as streaming copy (refreshed from the embedding's master after the
embedding's update) and as landing gradient, which is added into the embedding's before its update.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from megatrain.ir.dag import ScheduleError
from megatrain.ir.hostlayout import HostLayout, host_component_names
from megatrain.ir.placement import EXECUTED_STATE_TIERS
from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.exec.backend import PAGE, Backend, CpuBackend
from megatrain.model.layout import UnitLayout, unit_layout
from megatrain.units import GiB

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def optimizer_offset(spec: ModelSpec, unit: int) -> int:
    """Where the unit's own parameters start in its tile: 0, except the tied head (its lm_head is the embedding)."""
    if unit == HEAD and spec.tie_word_embeddings:
        return unit_layout(spec, HEAD).decay_numel
    return 0


class HostRegion:
    """One host allocation of a dtype, carved into page-aligned tiles by unit; optionally pinned by tile range."""

    def __init__(self, backend: Backend, dtype: torch.dtype, sizes: Mapping[int, int]):
        self.backend, self.dtype = backend, dtype
        item = dtype.itemsize
        self.order = list(sizes)
        self.offsets: dict[int, int] = {}  # byte offsets, page aligned
        off = 0
        for u in self.order:
            self.offsets[u] = off
            off += -(-sizes[u] * item // PAGE) * PAGE
        self.nbytes = off
        self.payload_bytes = sum(sizes.values()) * item
        self.raw = backend.host_region(self.nbytes)  # (nbytes,) uint8
        self.tiles = {u: self.raw[self.offsets[u]:self.offsets[u] + sizes[u] * item].view(dtype) for u in self.order}
        self.pinned_bytes = 0
        self._pinned: list[torch.Tensor] = []
        self._finalizer = weakref.finalize(self, _unpin_all, backend, self._pinned)

    def pin(self, units) -> None:
        """Pin the tiles of `units` (runs of consecutive tiles become one registration)."""
        if not self.backend.pins_host_memory:
            return
        want = [u in set(units) for u in self.order]
        i = 0
        while i < len(self.order):
            if not want[i]:
                i += 1
                continue
            j = i
            while j + 1 < len(self.order) and want[j + 1]:
                j += 1
            lo = self.offsets[self.order[i]]
            hi = self.offsets[self.order[j + 1]] if j + 1 < len(self.order) else self.nbytes
            view = self.raw[lo:hi]
            self.backend.pin(view)
            self._pinned.append(view)
            self.pinned_bytes += hi - lo
            i = j + 1

    def unpin_all(self) -> None:
        """Unpin every pinned tile range now (the region stays allocated and may be pinned again)."""
        _unpin_all(self.backend, self._pinned)
        self.pinned_bytes = 0


def _unpin_all(backend: Backend, views: list[torch.Tensor]) -> None:
    for v in views:
        backend.unpin(v)
    views.clear()


class HostStore:
    """Master weights, AdamW moments, streaming copies and gradient landing space of every unit."""

    def __init__(self, spec: ModelSpec, layout: HostLayout, backend: Backend | None = None,
                 tiles: Mapping[int, torch.Tensor] | None = None, *, adopt: HostStore | None = None):
        """`adopt`: a spent store whose master, moments and step counts this one takes over (`relayout`)."""
        if layout.state_tier not in EXECUTED_STATE_TIERS:
            raise ScheduleError(f"state_tier={layout.state_tier!r} is planned only, not executed: `megatrain plan` "
                                "and `simulate` model the NVMe tier, but the executor keeps the optimizer state in "
                                "host memory; train with state_tier='host' (see `megatrain plan` for the layouts "
                                "that fit without it: grad_ring, weight_wire=fp32, state_dtype=bf16)")
        self.spec, self.layout = spec, layout
        self.backend = backend or CpuBackend()
        self.units = spec.units()  # EMBED, 0..L-1, HEAD: layers are consecutive tiles in every region
        self.layouts: dict[int, UnitLayout] = {u: unit_layout(spec, u) for u in self.units}
        self.opt_lo = {u: optimizer_offset(spec, u) for u in self.units}
        self.gpu_units = set(layout.gpu_streamed_units)
        self.grad_dtype = TORCH_DTYPES[layout.grad_wire]
        self.wire_dtype = TORCH_DTYPES[layout.weight_wire]
        own, full = self._tile_sizes()

        state_dtype = TORCH_DTYPES[layout.state_dtype]
        if adopt is not None:  # the state is the adopted store's: nothing to allocate or zero
            self._master, self._m, self._v = adopt._master, adopt._m, adopt._v
            fresh: tuple[HostRegion | None, ...] = ()
        else:
            self._master = HostRegion(self.backend, torch.float32, own)
            self._m = HostRegion(self.backend, state_dtype, own)
            self._v = HostRegion(self.backend, state_dtype, own)
            fresh = (self._master, self._m, self._v)
        # Gradient landing: a tile per unit that lands (not the resident layers), or a ring of tiles the units share
        # in turn ({unit: tile}).
        streamed = {u: full[u] for u in layout.host_tiled(self.units)}
        self._ring_of = dict(layout.ring_tiles)
        if layout.grad_ring:
            self._grad = HostRegion(self.backend, self.grad_dtype,
                                    {t: layout.ring_tile_elements for t in range(layout.grad_ring)})
        else:
            self._grad = HostRegion(self.backend, self.grad_dtype, streamed)
        # bf16 moments are widened into these fp32 buffers (m, v) for the update, a chunk at a time.
        self._state_scratch = (HostRegion(self.backend, torch.float32, {0: layout.state_scratch_elements,
                                                                         1: layout.state_scratch_elements})
                               if layout.state_scratch_elements else None)
        self._stream = HostRegion(self.backend, torch.bfloat16, streamed) if layout.weight_wire == "bf16" else None
        # bf16 gradients are converted to fp32 for the update chunk by chunk in this one reused buffer.
        self._scratch = (HostRegion(self.backend, torch.float32, {0: layout.grad_scratch_elements})
                         if layout.grad_scratch_elements else None)
        # A parallel fill first-touches every page from the update's own thread team, so the pages are spread over
        # the host's memory nodes as the update's threads will read them, and faulted in now rather than during
        # the first step. It comes before pinning, because cudaHostRegister faults the pages from this one thread,
        # as the seeded init would for the master.
        for r in (*fresh, self._grad, self._stream, self._scratch, self._state_scratch):
            if r is not None:
                r.raw.zero_()
        # Pin only what DMA touches.
        self._grad.pin(self._grad.order)
        if self._stream is not None:
            self._stream.pin(self._stream.order)
            self._master.pin(self.gpu_units)
        else:
            self._master.pin(self.units)
        self._m.pin(self.gpu_units)
        self._v.pin(self.gpu_units)

        self.steps = {u: 0 for u in self.units}  # AdamW step count per unit (skipped steps do not count)
        self._tied_merged = False
        if adopt is not None:
            self.steps, self._tied_merged = dict(adopt.steps), adopt._tied_merged
            for u in self.units:  # the new streaming copy (if any) from the adopted master
                self.refresh_stream(u)
        if tiles is not None:
            self.load(tiles)

    def relayout(self, layout: HostLayout) -> HostStore:
        """This store's master weights, AdamW moments and step counts under another host layout (other wires, other
        GPU-updated units, a gradient ring or not), without a second copy of them: the master and moment regions are
        taken over and re-pinned as the new layout pins them; the gradient landing space, the streaming copy and the
        scratch buffers are dropped before the new layout's are allocated, so the peak is the larger layout, not
        both. Call between steps (no update pending, no Program holding views of this store); this store is spent
        afterwards. Host memory is the caller's to check (`StreamedTrainer.switch_schedule` checks the planner's
        figures). One process's store only: a sharded store's slices are the strategy's (ValueError)."""
        self.check_relayout(layout)
        for r in (self._master, self._m, self._v):  # pinned again as the new layout pins them
            r.unpin_all()
        self._grad = self._stream = self._scratch = self._state_scratch = None  # freed here (unpinned by finalizer)
        return HostStore(self.spec, layout, self.backend, adopt=self)

    def check_relayout(self, layout: HostLayout) -> None:
        """ValueError when `relayout(layout)` would be refused: a data-parallel rank's store, or another optimizer
        state (dtype, tier). Changes nothing, so a caller checks before it releases anything
        (`StreamedTrainer.switch_schedule`)."""
        if type(self) is not HostStore:
            raise ValueError(f"{type(self).__name__}: a data-parallel rank's store keeps its layout (relayout is for "
                             "one process)")
        same = ("state_dtype", "state_tier")
        if any(getattr(layout, k) != getattr(self.layout, k) for k in same):
            raise ValueError(f"relayout keeps the optimizer state as it is ({', '.join(same)}): "
                             f"{self.layout.state_dtype}/{self.layout.state_tier} -> "
                             f"{layout.state_dtype}/{layout.state_tier}")

    def _tile_sizes(self) -> tuple[dict[int, int], dict[int, int]]:
        """Elements per unit of the optimizer's tiles (master, moments) and of the full tiles (streaming copy,
        gradients); a data-parallel rank's store holds slices (megatrain/parallel/shard.py)."""
        own = {u: self.layouts[u].numel - self.opt_lo[u] for u in self.units}
        return own, {u: self.layouts[u].numel for u in self.units}

    # ---- tiles ---------------------------------------------------------------------------------------------------
    def master(self, unit: int) -> torch.Tensor:
        """fp32 master of the unit's own parameters (the tied head: its norm only)."""
        return self._master.tiles[unit]

    def exp_avg(self, unit: int) -> torch.Tensor:
        return self._m.tiles[unit]

    def exp_avg_sq(self, unit: int) -> torch.Tensor:
        return self._v.tiles[unit]

    def grad(self, unit: int) -> torch.Tensor:
        """Landing space of the unit's gradients (full tile, grad wire dtype): its own tile, or with a gradient ring
        the front of the ring tile the Program assigned it (valid until the tile's next unit lands)."""
        if self.layout.grad_ring:
            if unit not in self._ring_of:
                raise KeyError(f"unit {unit} has no gradient landing tile in the ring (its gradients stay on the GPU)")
            return self._grad.tiles[self._ring_of[unit]][:self.layouts[unit].numel]
        if unit not in self._grad.tiles:
            raise KeyError(f"unit {unit} is resident on the GPU: its gradients stay in its resident buffer (no "
                           "landing tile on the host)")
        return self._grad.tiles[unit]

    @property
    def state_scratch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(fp32 m, fp32 v) widening buffers of bf16 moments; None with fp32 moments."""
        if self._state_scratch is None:
            return None
        return self._state_scratch.tiles[0], self._state_scratch.tiles[1]

    def decay_numel(self, unit: int) -> int:
        """Length of the weight-decayed prefix of `master(unit)`."""
        return max(0, self.layouts[unit].decay_numel - self.opt_lo[unit])

    def stream_segments(self, unit: int) -> list[tuple[int, torch.Tensor]]:
        """What PREFETCH copies into a GPU slot: (element offset in the slot, host source) pairs."""
        if self._stream is not None:
            return [(0, self._stream.tiles[unit])]
        if self.opt_lo[unit]:  # tied head on fp32 wire: lm_head from the embedding's master, then the norm
            return [(0, self.master(EMBED)), (self.opt_lo[unit], self.master(unit))]
        return [(0, self.master(unit))]

    def refresh_stream(self, unit: int) -> None:
        """Bring the streaming copy up to date after the unit's master changed (none: a resident layer's)."""
        if self._stream is None or unit not in self._stream.tiles:
            return
        lo = self.opt_lo[unit]
        self._stream.tiles[unit][lo:].copy_(self.master(unit))
        if unit == EMBED and self.spec.tie_word_embeddings:
            self._stream.tiles[HEAD][:self.opt_lo[HEAD]].copy_(self.master(EMBED))

    def stream_tile(self, unit: int) -> torch.Tensor | None:
        """The unit's bf16 streaming copy; None with the fp32 wire (the master is streamed) or for a resident layer."""
        return None if self._stream is None else self._stream.tiles.get(unit)

    # ---- gradients -----------------------------------------------------------------------------------------------
    def gradients_landing(self, unit: int) -> None:
        """Called when OFFLOAD(unit) (re)fills the landing space: a tied merge from before is void."""
        if unit == EMBED:
            self._tied_merged = False

    def optimizer_grad(self, unit: int) -> torch.Tensor:
        """fp32 gradient of `master(unit)`; may be a view of the landing space that the caller scales in place.

        Tied embeddings: the embedding's gradient is its own plus the head's lm_head gradient (what autograd
        gives the shared parameter); with an fp32 wire the sum is formed in place, once per step.
        """
        g = self.grad(unit)[self.opt_lo[unit]:]
        tied_embed = unit == EMBED and self.spec.tie_word_embeddings
        head_lm = self.grad(HEAD)[:self.opt_lo[HEAD]] if tied_embed else None
        if self.grad_dtype == torch.float32:
            if tied_embed and not self._tied_merged:
                g.add_(head_lm)
                self._tied_merged = True
            return g
        g = g.float()
        if tied_embed:
            g.add_(head_lm.float())
        return g

    def optimizer_grad_chunks(self, unit: int):
        """(lo, hi, fp32 gradient of master(unit)[lo:hi]) covering the unit: one view of the landing space for
        fp32 gradients; for bf16 gradients, chunks converted into the store's scratch buffer (each chunk is valid
        until the next one is produced)."""
        if self.grad_dtype == torch.float32:
            g = self.optimizer_grad(unit)
            yield 0, g.numel(), g
            return
        g = self.grad(unit)[self.opt_lo[unit]:]
        head_lm = self.grad(HEAD)[:self.opt_lo[HEAD]] if unit == EMBED and self.spec.tie_word_embeddings else None
        scratch = self._scratch.tiles[0]
        for lo in range(0, g.numel(), scratch.numel()):
            hi = min(lo + scratch.numel(), g.numel())
            chunk = scratch[:hi - lo]
            chunk.copy_(g[lo:hi])
            if head_lm is not None:
                chunk.add_(head_lm[lo:hi])
            yield lo, hi, chunk

    # ---- whole-model access --------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, tiles: Mapping[int, torch.Tensor]) -> None:
        """Set the master weights from full per-unit tiles ({unit: (numel,) tensor}); zero the optimizer state."""
        for u in self.units:
            if u not in tiles:
                raise KeyError(f"no tile for unit {u} (EMBED={EMBED}, HEAD={HEAD}); expected units {self.units}")
            t = tiles[u].reshape(-1)
            if t.numel() != self.layouts[u].numel:
                raise ValueError(f"tile of unit {u} has {t.numel()} elements, the layout has {self.layouts[u].numel}")
            self.load_unit(u, t)
        for r in (self._m, self._v):
            r.raw.zero_()
        self.steps = {u: 0 for u in self.units}
        for u in self.units:
            self.refresh_stream(u)

    def load_unit(self, unit: int, full: torch.Tensor) -> None:
        """Set the unit's master from its full (numel,) tile (a sharded store takes its slice: dist/shard.py)."""
        self.master(unit).copy_(full[self.opt_lo[unit]:])

    def full_tile(self, unit: int) -> torch.Tensor:
        """A copy of the unit's full fp32 tile (the tied head's lm_head taken from the embedding)."""
        if self.opt_lo[unit]:
            return torch.cat([self.master(EMBED), self.master(unit)])
        return self.master(unit).clone()

    def tiles(self) -> dict[int, torch.Tensor]:
        """Copies of every unit's full fp32 tile, the input of `hf_io.state_dict_from_tiles`."""
        return {u: self.full_tile(u) for u in self.units}

    # ---- accounting ----------------------------------------------------------------------------------------------
    def _regions(self) -> dict[str, HostRegion | None]:
        names = host_component_names(self.layout)
        return {
            names["master"]: self._master,
            names["m"]: self._m,
            names["v"]: self._v,
            names["stream"]: self._stream,
            names["grads"]: self._grad,
            **({names["grad_scratch"]: self._scratch} if self._scratch is not None else {}),
            **({names["state_scratch"]: self._state_scratch} if self._state_scratch is not None else {}),
        }

    def bytes_by_component(self) -> dict[str, int]:
        """Payload bytes by component; equal to the memory planner's figures (`ir.memory.plan_host_memory`)."""
        return {k: (r.payload_bytes if r else 0) for k, r in self._regions().items()}

    def allocated_bytes(self) -> int:
        """Bytes actually allocated: the payload plus page alignment of each tile (< 4 KiB per tile and kind)."""
        return sum(r.nbytes + PAGE for r in self._regions().values() if r)

    def store_bytes(self) -> int:
        """Payload bytes of every component: the planner's `HostMemoryPlan.store_bytes` of this layout."""
        return sum(self.bytes_by_component().values())

    def pinned_bytes(self) -> int:
        return sum(r.pinned_bytes for r in self._regions().values() if r)

    def __repr__(self) -> str:
        total = self.store_bytes()
        return (f"HostStore({self.spec.name}, {len(self.units)} units, {total / GiB:.3f} GiB, "
                f"pinned {self.pinned_bytes() / GiB:.3f} GiB)")

