"""The decoder layer as the executor runs it, for every model family: the family's forward, its local backward
(recompute from the checkpoint, then differentiate), eager or compiled, with the norm + MLP half tiled or not.

The layer math itself is the family's (`spec.family.layer().decoder_layer`, e.g. `model/llama/layer.py`); this
module only dispatches by the spec's family and adds what is the same for every family:

`layer_backward` is the local backward of the streaming executor: it recomputes the layer once from its
checkpointed input with the slot views as autograd leaves, takes `torch.autograd.grad`, and lets the graph die
before it returns. Forward (1x) + recompute (1x) + backward (2x) = 4 forward-equivalents = 8N FLOPs per token.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import Tensor

from megatrain.model.spec import ModelSpec

LayerFn = Callable[..., Tensor]


def decoder_layer(w: Mapping[str, Tensor], x: Tensor, cos: Tensor, sin: Tensor, spec: ModelSpec,
                  mlp_tile_tokens: int = 0) -> Tensor:
    """One decoder layer of `spec`'s family: x (B, T, d) -> (B, T, d) in x.dtype (see the family's layer module;
    w: HF local names -> weight views, cos/sin: `rope_cos_sin` tables, mlp_tile_tokens: the tiled MLP)."""
    return spec.family.layer().decoder_layer(w, x, cos, sin, spec, mlp_tile_tokens=mlp_tile_tokens)


def layer_backward(w: Mapping[str, Tensor], x: Tensor, cos: Tensor, sin: Tensor, spec: ModelSpec,
                   grad_out: Tensor, grad_acc: Mapping[str, Tensor], layer: LayerFn | None = None) -> Tensor:
    """Local backward of one layer from its checkpointed input; returns grad_x (B, T, d) in x.dtype.

    Recomputes the layer once with leaves `w[name].detach().requires_grad_()` (same storage as the slot, no copy)
    and adds each weight gradient into `grad_acc[name]` (typically fp32 views of the slot's gradient area), so
    calling it once per micro-batch accumulates. The autograd graph is local to this call: `torch.autograd.grad`
    frees it, and no tensor returned or written holds on to it. `layer` is the forward to differentiate
    (`decoder_layer`, or its compiled form from `compiled_layer_functions`). It is a `KeptGraph` built and
    differentiated at once: the same forward and backward a layer that keeps its graph splits over two tasks.
    """
    return KeptGraph(w, x, cos, sin, spec, layer).backward(grad_out, grad_acc)


class KeptGraph:
    """A layer's forward run with its input and weights as autograd leaves, kept for its backward: `layer_backward`
    builds one and differentiates it at once (the recompute); a layer whose forward keeps its graph (knob
    keep_activations) builds it in its forward task and differentiates it in its backward task. The graph holds
    what the forward saved until `backward` frees it; the output handed to the next layer is detached, so each
    layer's graph stays its own."""

    def __init__(self, w: Mapping[str, Tensor], x: Tensor, cos: Tensor, sin: Tensor, spec: ModelSpec,
                 layer: LayerFn | None = None):
        if torch.is_inference_mode_enabled():
            raise RuntimeError("a layer's backward cannot run under torch.inference_mode(); use torch.no_grad() "
                               "instead")
        self.names = list(w)
        with torch.enable_grad():
            self.x_leaf = x.detach().requires_grad_()
            self.leaves = [w[n].detach().requires_grad_() for n in self.names]  # views of the same storage
            self.out = (layer or decoder_layer)(dict(zip(self.names, self.leaves)), self.x_leaf, cos, sin, spec)

    @property
    def output(self) -> Tensor:
        """The layer's output (B, T, d), detached: the next layer's input."""
        return self.out.detach()

    def backward(self, grad_out: Tensor, grad_acc: Mapping[str, Tensor]) -> Tensor:
        """Each weight gradient added into `grad_acc[name]` (fp32 += the compute dtype, in place); returns grad_x
        (B, T, d) in the input's dtype. The graph is freed."""
        missing = [n for n in self.names if n not in grad_acc]
        if missing:
            raise KeyError(f"grad_acc has no accumulator for {missing}; it needs one per weight of the layer")
        if grad_out.shape != self.x_leaf.shape:
            raise ValueError(f"grad_out has shape {tuple(grad_out.shape)}, the layer input has "
                             f"{tuple(self.x_leaf.shape)}")
        grads = torch.autograd.grad(self.out, [self.x_leaf, *self.leaves], grad_out.to(self.out.dtype))
        dtype = self.x_leaf.dtype
        self.out = self.x_leaf = self.leaves = None
        with torch.no_grad():
            for n, g in zip(self.names, grads[1:]):
                grad_acc[n].add_(g)
        return grads[0].to(dtype)


def layer_functions(compiled: bool, mlp_tile_tokens: int = 0) -> tuple[LayerFn, LayerFn]:
    """(forward, local backward) of a decoder layer: eager, or compiled (`compiled_layer_functions`), with the
    norm + MLP half in tiles of `mlp_tile_tokens` tokens (0: untiled)."""
    forward, backward = compiled_layer_functions() if compiled else (decoder_layer, layer_backward)
    if not mlp_tile_tokens:
        return forward, backward
    tiled = partial(forward, mlp_tile_tokens=mlp_tile_tokens)
    return tiled, partial(layer_backward, layer=tiled)


# The compiled form of each family's forward, by function (Llama, Mistral and Qwen2 share one).
_compiled: dict[LayerFn, LayerFn] = {}


def _compiled_forward(layer: LayerFn) -> LayerFn:
    if layer not in _compiled:
        import torch._dynamo  # noqa: F401 (torch's compiler, loaded only when a compiled layer is asked for)

        # One graph per activation shape and grad mode (the profiler times several token counts): allow many,
        # and fail loudly past the limit rather than fall back to eager and silently change the timings.
        cfg = torch._dynamo.config
        limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # renamed in 2.6
        setattr(cfg, limit, max(getattr(cfg, limit), 64))
        if hasattr(cfg, "fail_on_recompile_limit_hit"):
            cfg.fail_on_recompile_limit_hit = True
        _compiled[layer] = torch.compile(layer, dynamic=False)
    return _compiled[layer]


def compiled_decoder_layer(w: Mapping[str, Tensor], x: Tensor, cos: Tensor, sin: Tensor, spec: ModelSpec,
                           mlp_tile_tokens: int = 0) -> Tensor:
    """`decoder_layer` through `torch.compile`: the family is looked up eagerly, its layer runs compiled."""
    forward = _compiled_forward(spec.family.layer().decoder_layer)
    return forward(w, x, cos, sin, spec, mlp_tile_tokens=mlp_tile_tokens)


def compiled_layer_functions() -> tuple[LayerFn, LayerFn]:
    """(forward, local backward) with the family's decoder layer compiled by `torch.compile` (Inductor).

    The compiled layer fuses what eager mode runs as separate memory-bound kernels (RMSNorm's fp32 statistics,
    rotate-half RoPE, SiLU * up, residual adds) in the forward and in the backward AOTAutograd derives; the matmuls
    and SDPA attention stay the same kernels. The compiled graph is shared by every layer and call of the process:
    weights are inputs, not constants, so a new slot or layer does not recompile, only a new activation shape
    (batch, sequence length) or dtype does. Fusion reorders fp32 arithmetic inside the norms, so results agree
    with the eager layer to rounding, not bitwise.
    """
    return compiled_decoder_layer, partial(layer_backward, layer=compiled_decoder_layer)
