"""The Llama / Mistral / Qwen2 decoder layer as a stateless function of (weights, activations).

No nn.Module owns the weights: `w` maps HF local names (`self_attn.q_proj.weight`, ...) to views of whatever flat
buffer the runtime bound (a GPU slot, a host tile; see `layout.UnitLayout.views`). Nothing is copied out of that
buffer; a weight whose dtype differs from the activations (fp32 master streamed, bf16 compute) is cast where it is
used, and that cast is the only copy.

The math follows transformers' `LlamaDecoderLayer` op for op (pre-norm, RMSNorm in fp32, rotate-half RoPE,
SDPA causal attention, SwiGLU), so that in fp32 our outputs match HF's to matmul rounding. A sliding window
(Mistral, Qwen2: `spec.sliding_window`) is a banded additive mask on the same SDPA call (`window_mask`).

At long sequences the post-attention half (RMSNorm + SwiGLU) runs in sequence tiles (`mlp_tile_tokens`): its
(B, T, ffn) intermediates exist for one tile at a time, in the forward and in the backward (`TiledNormMLP`, which
saves only its input and recomputes each tile in its backward). Attention goes through SDPA with `is_causal=True`
and no mask, which on CUDA in bf16 is the flash kernel: O(T) memory, no (T, T) tensor; a sliding window shorter
than T adds one (T, T) mask per layer call (the memory-efficient kernel; the planner counts the mask).

This is the family's layer math (`LlamaFamily.layer()`): `decoder_layer` and `rope_cos_sin`. How the executor
differentiates it (recompute from the checkpoint, local backward) and compiles it is the executor's
(`exec/layers.py`), the same for every family.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from megatrain.model.llama.rope import apply_rope, rope_cos_sin
from megatrain.model.llama.shape import masked_window

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec

__all__ = ["decoder_layer", "rope_cos_sin", "rms_norm", "attention", "window_mask", "TiledNormMLP"]

# SDPA grew `enable_gqa` in torch 2.5: K/V heads are shared by query groups inside the kernel instead of being
# materialized n_rep times (HF does the same when no mask is passed).
_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as HF's LlamaRMSNorm: statistics in fp32, normalized value cast back, then scaled. (..., d)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * h.to(x.dtype)


def _linear(x: Tensor, w: Mapping[str, Tensor], name: str, bias: bool = False) -> Tensor:
    weight = w[f"{name}.weight"].to(x.dtype)  # no-op (same tensor) when the dtypes agree
    b = w[f"{name}.bias"].to(x.dtype) if bias else None
    return F.linear(x, weight, b)


def window_mask(seq: int, window: int, device, dtype: torch.dtype) -> Tensor:
    """Additive (T, T) mask of causal sliding-window attention, as transformers' `sliding_window_causal_mask_function`:
    query q sees key k iff q - window < k <= q (the `window` latest tokens, itself included); 0 where seen, -inf
    elsewhere, in the compute dtype. Every row sees at least its diagonal, so no softmax row is empty.

    The (T, T) view sits in rows padded to a multiple of 16 elements: CUDA's memory-efficient SDPA kernel wants
    the mask's row stride aligned and would otherwise copy the whole mask into a padded one (the planner counts
    the padded rows: `LlamaFamily.layer_working_set`)."""
    padded = -(-seq // 16) * 16
    q = torch.arange(seq, device=device)[:, None]  # (T, 1)
    k = torch.arange(padded, device=device)[None, :]  # (1, Tp)
    seen = (k <= q) & (k > q - window)  # (T, Tp); columns >= T are future keys, never seen
    mask = torch.zeros((seq, padded), device=device, dtype=dtype).masked_fill_(~seen, float("-inf"))
    return mask[:, :seq]  # (T, T), row stride Tp


def attention(w: Mapping[str, Tensor], h: Tensor, cos: Tensor, sin: Tensor, spec: ModelSpec) -> Tensor:
    """Causal grouped-query self-attention of the normalized input h (B, T, d) -> (B, T, d); with a sliding window
    (`spec.sliding_window` shorter than T) each query sees only the window's latest keys (`window_mask`)."""
    B, T, _ = h.shape
    hd, n_rep = spec.head_dim, spec.num_heads // spec.num_kv_heads
    bias = spec.qkv_bias  # Qwen2: q/k/v have biases, o_proj does not
    q = _linear(h, w, "self_attn.q_proj", bias).view(B, T, spec.num_heads, hd).transpose(1, 2)  # (B, nh, T, hd)
    k = _linear(h, w, "self_attn.k_proj", bias).view(B, T, spec.num_kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
    v = _linear(h, w, "self_attn.v_proj", bias).view(B, T, spec.num_kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # HF passes scaling=head_dim**-0.5 explicitly; so do we, so that the scale is the same float.
    if masked_window(spec, T):
        # A mask rules out the flash kernel (CUDA takes the memory-efficient one, O(T) beyond the mask itself);
        # K/V are expanded to every query head as HF does with a mask, since not every masked kernel takes GQA.
        if n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hd)
        mask = window_mask(T, spec.sliding_window, h.device, q.dtype)  # (T, T), broadcast over B and heads
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5)
    elif n_rep == 1:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5)
    elif _SDPA_HAS_GQA:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5, enable_gqa=True)
    else:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5)
    y = y.transpose(1, 2).reshape(B, T, spec.q_dim)  # (B, T, nh*hd)
    return _linear(y, w, "self_attn.o_proj")  # (B, T, d)


def mlp(w: Mapping[str, Tensor], h: Tensor) -> Tensor:
    """SwiGLU: down(silu(gate(h)) * up(h)). (B, T, d) -> (B, T, d) through (B, T, ffn)."""
    return _linear(F.silu(_linear(h, w, "mlp.gate_proj")) * _linear(h, w, "mlp.up_proj"), w, "mlp.down_proj")


_MLP_WEIGHTS = ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight")


def norm_mlp(w: Mapping[str, Tensor], h: Tensor, eps: float) -> Tensor:
    """The post-attention half of a layer without its residual: mlp(rms_norm(h)). (..., d) -> (..., d)."""
    return mlp(w, rms_norm(h, w["post_attention_layernorm.weight"], eps))


class TiledNormMLP(torch.autograd.Function):
    """`norm_mlp` over tiles of `tile` tokens, saving only its input h for the backward.

    Forward: each tile's output is computed without a graph. Backward: each tile is recomputed under autograd and
    differentiated at once, so only one tile's (tile, ffn) intermediates exist at a time (a loop over tiles inside
    autograd would save every tile's). The norm is per token and the matmuls are per row, so the outputs equal the
    untiled ones to matmul rounding; weight gradients are summed over tiles in fp32 and returned in the weights'
    dtype, as one matmul over all tokens would give them. Costs one more forward of the MLP per backward.
    """

    @staticmethod
    def forward(ctx, h: Tensor, eps: float, tile: int, *weights: Tensor) -> Tensor:
        ctx.eps, ctx.tile = eps, tile
        ctx.save_for_backward(h, *weights)
        w = dict(zip(_MLP_WEIGHTS, weights))
        hf = h.reshape(-1, h.shape[-1])  # (N, d) tokens of every sequence: the math is per token
        out = torch.empty_like(hf)
        for s in range(0, hf.shape[0], tile):
            out[s:s + tile] = norm_mlp(w, hf[s:s + tile], eps)  # (n, d) through (n, ffn)
        return out.view_as(h)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        h, *weights = ctx.saved_tensors
        hf, gf = h.reshape(-1, h.shape[-1]), grad_out.reshape(-1, h.shape[-1])  # (N, d)
        grad_h = torch.empty_like(hf)
        acc = [torch.zeros(wt.shape, dtype=torch.float32, device=wt.device) for wt in weights]
        for s in range(0, hf.shape[0], ctx.tile):
            with torch.enable_grad():
                x = hf[s:s + ctx.tile].detach().requires_grad_()
                leaves = [wt.detach().requires_grad_() for wt in weights]  # same storage, no copy
                y = norm_mlp(dict(zip(_MLP_WEIGHTS, leaves)), x, ctx.eps)  # (n, d); the tile's graph
                gx, *gw = torch.autograd.grad(y, [x, *leaves], gf[s:s + ctx.tile])
            grad_h[s:s + ctx.tile] = gx
            for a, g in zip(acc, gw):
                a.add_(g)  # fp32 sum over tiles
        return grad_h.view_as(h), None, None, *(a.to(wt.dtype) for a, wt in zip(acc, weights))


def post_attention(w: Mapping[str, Tensor], h: Tensor, spec: ModelSpec, mlp_tile_tokens: int = 0) -> Tensor:
    """h + mlp(rms_norm(h)) for the residual stream h (B, T, d); in tiles of `mlp_tile_tokens` tokens when that is
    positive and below the B*T tokens of h (`TiledNormMLP`), else in one piece."""
    eps = spec.rms_norm_eps
    if not 0 < mlp_tile_tokens < h.shape[0] * h.shape[1]:
        return h + norm_mlp(w, h, eps)
    return h + _tiled_norm_mlp(h, eps, mlp_tile_tokens, *(w[n] for n in _MLP_WEIGHTS))


# In the compiled layer this part runs eagerly (a graph break): dynamo does not trace autograd.grad in a backward.
@torch.compiler.disable
def _tiled_norm_mlp(h: Tensor, eps: float, tile: int, *weights: Tensor) -> Tensor:
    return TiledNormMLP.apply(h, eps, tile, *weights)


def decoder_layer(w: Mapping[str, Tensor], x: Tensor, cos: Tensor, sin: Tensor, spec: ModelSpec,
                  mlp_tile_tokens: int = 0) -> Tensor:
    """One pre-norm decoder layer: x (B, T, d) -> (B, T, d) in x.dtype.

    w: HF local names -> weight views (any float dtype; cast to x.dtype at use). cos/sin: (T, head_dim) tables
    from `rope_cos_sin` in x.dtype (or castable to it). mlp_tile_tokens > 0: the norm + MLP half in tiles of that
    many tokens (`post_attention`); 0: in one piece.
    """
    if x.dim() != 3 or x.shape[-1] != spec.hidden_size:
        raise ValueError(f"decoder_layer expects x of shape (B, T, {spec.hidden_size}), got {tuple(x.shape)}")
    if cos.shape != (x.shape[1], spec.head_dim):
        raise ValueError(f"rope tables have shape {tuple(cos.shape)}; expected (T={x.shape[1]}, "
                         f"head_dim={spec.head_dim}): build them with rope_cos_sin(spec, T, ...)")
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    h = x + attention(w, rms_norm(x, w["input_layernorm.weight"], spec.rms_norm_eps), cos, sin, spec)
    return post_attention(w, h, spec, mlp_tile_tokens)
