"""The rotary position tables of a step, from the spec's family (`model/llama/rope.py` for the Llama shapes)."""
from __future__ import annotations

import torch
from torch import Tensor

from megatrain.model.spec import ModelSpec


def rope_cos_sin(spec: ModelSpec, seq_len: int, device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables for positions 0..seq_len-1, each (T, head_dim), in `dtype` on `device`: computed once per
    sequence length and shared by every layer of a step."""
    return spec.family.layer().rope_cos_sin(spec, seq_len, device, dtype)
