"""Flat tiles: where each tensor of a unit lives inside the unit's one contiguous buffer.

Every store of a unit's parameters (host fp32 master, moments, the bf16 streaming copy, gradients, the GPU
slot) is one flat 1-D tensor in the same layout, so a copy between any two of them is one memcpy and the
layer functions get their weights as views (no copy) of whatever buffer they are bound to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from megatrain.model.spec import ModelSpec


@dataclass(frozen=True)
class TensorSlice:
    name: str  # HF name relative to the unit ("mlp.up_proj.weight")
    shape: tuple[int, ...]
    offset: int  # in elements
    numel: int


@dataclass(frozen=True)
class UnitLayout:
    """Layout of one unit's flat tile: matrices first (weight decay covers `decay_numel`), then 1-D tensors."""

    unit: int
    slices: tuple[TensorSlice, ...]
    numel: int
    decay_numel: int

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views (no copy) of `flat` (numel,) shaped as the unit's tensors, by HF local name."""
        if flat.dim() != 1 or flat.numel() < self.numel:
            raise ValueError(f"flat buffer of shape {tuple(flat.shape)} cannot hold unit {self.unit} "
                             f"({self.numel} elements)")
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slices}

    def slice_of(self, name: str) -> TensorSlice:
        for s in self.slices:
            if s.name == name:
                return s
        raise KeyError(f"unit {self.unit} has no tensor {name!r}; it has {[s.name for s in self.slices]}")


@lru_cache(maxsize=None)
def unit_layout(spec: ModelSpec, unit: int) -> UnitLayout:
    """The flat tile of `unit` as its family lists the unit's tensors (matrices first: checked here)."""
    slices, offset, decay = [], 0, 0
    for name, shape in spec.unit_tensors(unit):
        n = math.prod(shape)
        if len(shape) == 2 and offset != decay:
            raise ValueError(f"family {spec.model_type!r} lists matrix {name!r} of unit {unit} after a 1-D tensor; "
                             "unit_tensors must list matrices first (weight decay covers a prefix of the tile)")
        slices.append(TensorSlice(name, tuple(shape), offset, n))
        offset += n
        if len(shape) == 2:
            decay = offset  # matrices come first, so the decayed part is a prefix
    return UnitLayout(unit, tuple(slices), offset, decay)
