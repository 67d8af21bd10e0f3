"""Rotary position embedding in Hugging Face's rotate-half layout.

HF Llama/Qwen2 checkpoints store q_proj/k_proj rows so that RoPE pairs dimension i with i + head_dim/2
("rotate half"), not the interleaved (2i, 2i+1) pairs of Meta's original code. Using the same layout here is what
lets checkpoints load with an identity name map.

The tables are computed exactly as transformers 4.4x-5.x computes them (`LlamaRotaryEmbedding` and
`modeling_rope_utils`): inverse frequencies in fp32, then `positions * inv_freq` in fp32, cos/sin in fp32, and only
then the cast to the compute dtype. Matching the op order matters: in fp32 our cos/sin tables are bitwise equal to
HF's, so logits agree to rounding of the matmuls alone.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec


def rope_inv_freq(spec: ModelSpec) -> Tensor:
    """Inverse frequencies (head_dim / 2,) in fp32 on the CPU, with `spec.rope_scaling` applied.

    default: theta^(-2i/d). linear: divided by `factor` (position interpolation). llama3: Llama 3.1's
    wavelength-dependent scaling (long wavelengths divided by `factor`, short ones kept, a smooth blend between).
    """
    dim = spec.head_dim
    # HF: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), base a Python float.
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = spec.rope_scaling
    if rs.rope_type == "default":
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    if rs.rope_type == "llama3":
        old_context_len = rs.original_max_position_embeddings
        low_freq_wavelen = old_context_len / rs.low_freq_factor
        high_freq_wavelen = old_context_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are interpolated by `factor`; short ones are kept as they are.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
        # In between, blend the two linearly in 1/wavelength.
        smooth = (old_context_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / rs.factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    # ModelSpec validates rope_type; this guards a spec built around the validation.
    raise ValueError(f"rope_type {rs.rope_type!r} is not implemented; use default, linear or llama3")


def rope_cos_sin(spec: ModelSpec, seq_len: int, device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables for positions 0..seq_len-1, each (T, head_dim), in `dtype` on `device`.

    Row t is `[cos(t * f), cos(t * f)]` with f the inverse frequencies (rotate-half layout); the same tables serve
    every layer of a step, so callers compute them once per sequence length.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    inv_freq = rope_inv_freq(spec).to(device)  # (hd/2,) fp32
    positions = torch.arange(seq_len, device=device, dtype=torch.int64).float()  # HF: position_ids.float()
    freqs = positions[:, None] * inv_freq[None, :]  # (T, hd/2) fp32
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    # HF multiplies by attention_scaling, which is 1.0 for default/linear/llama3 (an exact no-op), so it is omitted.
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(..., hd) -> (..., hd): [x1, x2] -> [-x2, x1], the partner of each dimension in HF's layout."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate queries or keys x (B, heads, T, hd) by the tables cos/sin (T, hd)."""
    return x * cos + rotate_half(x) * sin  # (B, heads, T, hd); cos/sin broadcast over B and heads
