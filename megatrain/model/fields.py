"""The words a model's shape is written in, shared by `ModelSpec` and every family (torch-free, imports nothing).

Unit ids: the model is streamed as decoder layers 0..L-1 plus two non-layer units, the embedding (`EMBED`) and the
head (`HEAD`: final norm, lm_head, loss). `SpecError` is the one error of a configuration megatrain cannot train.
"""
from __future__ import annotations

from dataclasses import dataclass

EMBED = -1
HEAD = -2

# The kinds of the two non-layer units; a family names the kinds of its decoder layers (`Family.layer_kind`).
EMBED_KIND = "embed"
HEAD_KIND = "head"

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class SpecError(ValueError):
    """A model configuration megatrain cannot train; the message says what and what to do."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF's `rope_scaling` / `rope_parameters` describe it."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
