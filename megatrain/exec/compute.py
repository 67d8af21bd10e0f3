"""FORWARD, RECOMPUTE and BACKWARD: the layer math on the weights a task's buffer holds.

Weights are bound to the layer functions as views of the buffer (`UnitLayout.views`); when the wire dtype differs
from the compute dtype the flat weights are cast once per task (the one copy). Gradients of all micro-batches
accumulate in the buffer's fp32 area, zeroed by micro-batch 0. The decoder layer runs eager or compiled, as the
placement's `layer_kernel` says, with its norm + MLP half in tiles of `mlp_tile_tokens` at long sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.ir.program import Program, ProgramTask
from megatrain.model.layout import UnitLayout
from megatrain.model.spec import EMBED, HEAD
from megatrain.exec.activations import Activations
from megatrain.exec.buffers import DeviceBuffers
from megatrain.exec.head import embed_backward, embed_forward, head_loss_backward
from megatrain.exec.layers import KeptGraph, layer_functions
from megatrain.exec.store import TORCH_DTYPES, HostStore


@dataclass
class StepBatch:
    """One step's batch on the device, split into micro-batches, and what the loss needs."""

    ids: tuple[torch.Tensor, ...]  # M x (mb, T) int64
    targets: tuple[torch.Tensor, ...]  # M x (mb, T) int64, -100 = no loss
    n_valid: int  # target tokens of the whole batch
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def loss_scale(self) -> float:
        return 1.0 / self.n_valid


def bind_weights(layout: UnitLayout, flat: torch.Tensor, compute_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named weight views of a unit's flat weights `flat` (numel,) as a task binds them: views (no copy) when
    `flat` is in the compute dtype; otherwise the layer's weights cast once before binding (so the autograd leaves
    are in the compute dtype and gradients keep its precision), the embedding's not at all (it casts only the rows it
    gathers), and of the head's only the norm (`head_loss_backward` casts lm_head once itself; the norm is an
    autograd leaf). The executor and the profiler's unit bodies both bind through this function."""
    if flat.dtype == compute_dtype or layout.unit == EMBED:
        return layout.views(flat)
    if layout.unit == HEAD:
        w = layout.views(flat)
        w["norm.weight"] = w["norm.weight"].to(compute_dtype)
        return w
    return layout.views(flat.to(compute_dtype))


class LayerCompute:
    """Bodies of F, R and B tasks over the device buffers and the step's activations."""

    def __init__(self, program: Program, store: HostStore, buffers: DeviceBuffers, acts: Activations):
        p = program.placement
        self.spec, self.store, self.buffers, self.acts = p.model, store, buffers, acts
        self.compute_dtype = TORCH_DTYPES[p.compute_dtype]
        self.loss_chunk_tokens = p.loss_chunk_tokens
        self.layer_forward, self.layer_backward = layer_functions(p.compiled_layers, p.mlp_tile_tokens)
        # layers whose forward keeps its graph for the backward (no recompute; resolve.py allows no MLP tiles with
        # them, so `layer_forward` is the plain or compiled layer those graphs differentiate)
        self.graph_layers = frozenset(p.graph_layers)
        self.batch: StepBatch | None = None
        self.loss_sums: dict[int, torch.Tensor] = {}

    def begin_step(self, batch: StepBatch) -> None:
        self.batch, self.loss_sums = batch, {}

    # ---- buffers -----------------------------------------------------------------------------------------------
    def weights(self, task: ProgramTask) -> dict[str, torch.Tensor]:
        """HF-named weight views of the task's buffer, in the compute dtype where the layer math needs it."""
        layout = self.store.layouts[task.unit]
        return bind_weights(layout, self.buffers.holding(task).w[:layout.numel], self.compute_dtype)

    def grads(self, task: ProgramTask) -> dict[str, torch.Tensor]:
        layout = self.store.layouts[task.unit]
        buf = self.buffers.holding(task)
        if task.micro == 0:  # the first micro-batch of the step starts the accumulation
            buf.g[:layout.numel].zero_()
        return layout.views(buf.g[:layout.numel])

    # ---- tasks -------------------------------------------------------------------------------------------------
    def forward(self, t: ProgramTask) -> None:
        u, m, b, acts = t.unit, t.micro, self.batch, self.acts
        w = self.weights(t)
        if u == HEAD:  # loss forward and backward, fused and chunked
            loss_sum, grad_x, _ = head_loss_backward(w, acts.hidden.pop(m), b.targets[m], self.spec,
                                                     self.loss_chunk_tokens, b.loss_scale, self.grads(t))
            self.loss_sums[m], acts.grad_hidden[m] = loss_sum, grad_x
            return
        if u == EMBED:
            acts.produced(0, m, embed_forward(w["embed_tokens.weight"], b.ids[m], self.compute_dtype))  # (mb, T, d)
        elif u in self.graph_layers:
            graph = KeptGraph(w, acts.hidden[m], b.cos, b.sin, self.spec, self.layer_forward)
            acts.graphs[(u, m)] = graph
            acts.produced(u + 1, m, graph.output)  # (mb, T, d)
        else:
            acts.produced(u + 1, m, self.layer_forward(w, acts.hidden[m], b.cos, b.sin, self.spec))  # (mb, T, d)

    def recompute(self, t: ProgramTask) -> None:
        x = self.acts.layer_input(t.unit, t.micro, pop=False)
        self.acts.recomputed[(t.unit + 1, t.micro)] = self.layer_forward(self.weights(t), x, self.batch.cos,
                                                                         self.batch.sin, self.spec)

    def backward(self, t: ProgramTask) -> None:
        u, m, acts = t.unit, t.micro, self.acts
        if u == EMBED:
            embed_backward(acts.grad_hidden.pop(m), self.batch.ids[m], self.grads(t)["embed_tokens.weight"])
            return
        x = acts.layer_input(u, m, pop=True)
        if u in self.graph_layers:
            acts.grad_hidden[m] = acts.graphs.pop((u, m)).backward(acts.grad_hidden[m], self.grads(t))
            return
        acts.grad_hidden[m] = self.layer_backward(self.weights(t), x, self.batch.cos, self.batch.sin, self.spec,
                                                  acts.grad_hidden[m], self.grads(t))
