"""A data-parallel rank's host store: its slice of every unit's tiles.

Rank r of N owns elements `[r*s, (r+1)*s)` of each unit's flat tile, `s = shard_numel(n, N)` (equal slices, page
aligned; the last rank's slice is padded with zeros past the unit's end). Every kind (master, m, v, streaming
copy, gradient landing) holds only that slice, so the host memory of the node is one model's, not N. The update
code reads a slice exactly as it reads a whole tile: the fused AdamW is element-wise and the weight-decayed prefix
of a slice is its intersection with the unit's (`decay_numel`).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from megatrain.exec.backend import Backend
from megatrain.exec.optim import decayed_in
from megatrain.exec.store import HostStore
from megatrain.model.init import init_unit
from megatrain.compile.resolve import check_model_shards
from megatrain.ir.hostlayout import HostLayout
from megatrain.ir.placement import shard_numel
from megatrain.model.spec import ModelSpec
from megatrain.parallel.world import World


class ShardedHostStore(HostStore):
    """The slices of rank `world.rank`; `tiles()` / `full_tile()` gather the whole model on every rank."""

    def __init__(self, spec: ModelSpec, layout: HostLayout, world: World, backend: Backend | None = None,
                 tiles: Mapping[int, torch.Tensor] | None = None):
        check_model_shards(spec)  # the resolver's rule (a ScheduleError, which is a ValueError)
        self.world = world
        super().__init__(spec, layout, backend, tiles)

    def _tile_sizes(self) -> tuple[dict[int, int], dict[int, int]]:
        sizes = {u: shard_numel(self.layouts[u].numel, self.world.size) for u in self.units}
        return sizes, dict(sizes)

    def shard(self, unit: int) -> tuple[int, int]:
        """(first element, elements of real parameters) of this rank's slice of `unit` (the rest is padding)."""
        s, n = shard_numel(self.layouts[unit].numel, self.world.size), self.layouts[unit].numel
        lo = self.world.rank * s
        return lo, max(0, min(s, n - lo))

    def decay_numel(self, unit: int) -> int:
        lo, _ = self.shard(unit)
        return decayed_in(self.layouts[unit].decay_numel, lo, self.master(unit).numel())

    def load_unit(self, unit: int, full: torch.Tensor) -> None:
        """`HostStore.load` per unit: this rank's slice of the full tile into the master, padding zero (`load`
        refreshes the streaming copies once, after every unit)."""
        lo, valid = self.shard(unit)
        master = self.master(unit)
        master[:valid].copy_(full[lo:lo + valid])
        master[valid:].zero_()

    def load_slice(self, unit: int, full: torch.Tensor) -> None:
        """Copy this rank's slice of a full (numel,) tile into the master (padding zero) and the streaming copy."""
        self.load_unit(unit, full)
        self.refresh_stream(unit)

    def init_slices(self, seed: int, std: float = 0.02) -> None:
        """The seeded init of every unit (megatrain/model/init.py), drawn whole one unit at a time, keeping this rank's
        slice: the same weights as a one-GPU run of the same seed."""
        for unit in self.units:
            full = torch.empty(self.layouts[unit].numel)
            init_unit(self.spec, unit, full, seed, std)
            self.load_slice(unit, full)

    def full_tile(self, unit: int) -> torch.Tensor:
        """The unit's full fp32 tile, gathered from every rank (call it on every rank)."""
        return self.world.gather_slices(self.master(unit))[:self.layouts[unit].numel].clone()
