"""The activations of one step: the running hidden state, the checkpoints, recomputed inputs and the gradient
flowing down, and the host copies of offloaded checkpoints (ACT_OFFLOAD / ACT_PREFETCH).

Checkpoints are the inputs of the first layer of each recompute block (`placement.checkpoint_layers`), kept per
(layer, micro-batch) in the compute dtype; the offloaded ones (`placement.offloaded_checkpoints`) live on the host
between their ACT_OFFLOAD and ACT_PREFETCH.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatrain.ir.program import Program, ProgramTask
from megatrain.exec.backend import Backend, ExecError
from megatrain.exec.store import TORCH_DTYPES, HostRegion

if TYPE_CHECKING:
    from megatrain.exec.layers import KeptGraph


class Activations:
    """Per-step activation state, and the pinned host tiles of the offloaded checkpoints (allocated once)."""

    def __init__(self, program: Program, backend: Backend):
        p = program.placement
        self.backend = backend
        self.checkpoint_layers = set(p.checkpoint_layers)
        self.dtype = TORCH_DTYPES[p.compute_dtype]
        self.shape = (p.batch // p.micro_batches, p.seq, p.model.hidden_size)  # (mb, T, d)
        self.host: dict[tuple[int, int], torch.Tensor] = {}
        self._region: HostRegion | None = None
        keys = [(l0, m) for l0 in p.offloaded_checkpoints for m in range(p.micro_batches)]
        if keys:
            n = self.shape[0] * self.shape[1] * self.shape[2]
            self._region = HostRegion(backend, self.dtype, {i: n for i in range(len(keys))})
            self._region.pin(range(len(keys)))
            self.host = {key: self._region.tiles[i] for i, key in enumerate(keys)}
        self.reset()

    def reset(self) -> None:
        """Forget the previous step's activations."""
        self.hidden: dict[int, torch.Tensor] = {}  # micro -> running activation (mb, T, d)
        self.checkpoints: dict[tuple[int, int], torch.Tensor] = {}  # (layer, micro) -> its input
        self.recomputed: dict[tuple[int, int], torch.Tensor] = {}  # (layer, micro) -> input rebuilt by R
        self.grad_hidden: dict[int, torch.Tensor] = {}  # micro -> gradient w.r.t. the current activation
        self.graphs: dict[tuple[int, int], KeptGraph] = {}  # (layer, micro) -> its forward's graph (no recompute)

    @property
    def host_bytes(self) -> int:
        return self._region.payload_bytes if self._region else 0

    def produced(self, layer: int, micro: int, x: torch.Tensor) -> None:
        """`x` (mb, T, d) is the input of `layer` (L: the head's): the running state, and a checkpoint if kept."""
        self.hidden[micro] = x
        if layer in self.checkpoint_layers:
            self.checkpoints[(layer, micro)] = x

    def layer_input(self, layer: int, micro: int, pop: bool) -> torch.Tensor:
        store = self.checkpoints if layer in self.checkpoint_layers else self.recomputed
        key = (layer, micro)
        if key not in store:
            raise ExecError(f"the input of layer {layer}, micro-batch {micro} is not on the device "
                            "(no checkpoint, recompute or activation prefetch produced it)")
        return store.pop(key) if pop else store[key]

    # ---- ACT_OFFLOAD / ACT_PREFETCH ----------------------------------------------------------------------------
    def act_offload(self, t: ProgramTask) -> None:
        key = (t.unit, t.micro)
        x = self.checkpoints.pop(key)
        self.host[key].view(x.shape).copy_(x, non_blocking=True)
        self.backend.keep_alive(x, self.backend.stream(t.stream))  # allocated on compute, read here

    def act_prefetch(self, t: ProgramTask) -> None:
        key = (t.unit, t.micro)
        x = torch.empty(self.shape, dtype=self.dtype, device=self.backend.device)
        x.copy_(self.host[key].view(self.shape), non_blocking=True)
        self.backend.keep_alive(x, self.backend.stream("compute"))  # allocated here, read by compute
        self.checkpoints[key] = x
