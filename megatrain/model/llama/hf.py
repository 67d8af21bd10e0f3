"""Hugging Face config.json <-> ModelSpec fields for the Llama-shaped families (torch-free).

Reads both the transformers 4.x and 5.x shapes of the file: 5.x nests rope_theta and the scaling in
`rope_parameters` and writes `dtype`; 4.x has rope_theta top-level, `rope_scaling` (with "type" in old files,
"rope_type" in newer ones) and `torch_dtype`. Writes the 4.x shape, which both read.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from megatrain.model.fields import DTYPE_BYTES, SUPPORTED_ROPE_TYPES, RopeScaling, SpecError

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec

# HF's defaults for fields a config.json may omit (transformers LlamaConfig / MistralConfig / Qwen2Config).
LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048)
MISTRAL_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                        max_position_embeddings=4096 * 32)
QWEN2_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=32768)

_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def check_values(c: dict) -> None:
    """Types and ranges of the values megatrain reads (a SpecError naming the field, never a traceback)."""
    for key in _INT_FIELDS:
        v = c.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not (isinstance(v, int) or isinstance(v, float) and v.is_integer()) or v <= 0:
            raise SpecError(f"config.json: {key}={v!r} must be a positive integer")
    for key in _FLOAT_FIELDS:
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v <= 0):
            raise SpecError(f"config.json: {key}={v!r} must be a positive number")
    for key in ("rope_parameters", "rope_scaling"):
        v = c.get(key)
        if v is not None and not isinstance(v, dict):
            raise SpecError(f"config.json: {key} must be an object (or null), got {type(v).__name__}")
        for k, x in (v or {}).items():
            if k not in ("rope_type", "type") and (isinstance(x, bool) or not isinstance(x, (int, float))):
                raise SpecError(f"config.json: {key}.{k}={x!r} must be a number")
    for key in ("tie_word_embeddings", "mlp_bias", "attention_bias"):
        v = c.get(key)
        if v is not None and not isinstance(v, bool):
            raise SpecError(f"config.json: {key}={v!r} must be true or false")
    for key in ("hidden_act", "dtype", "torch_dtype"):
        v = c.get(key)
        if v is not None and not isinstance(v, str):
            raise SpecError(f"config.json: {key}={v!r} must be a string")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise SpecError(f"hidden_act {act!r} is not supported; the SwiGLU MLP of megatrain uses silu")
    if c.get("mlp_bias"):
        raise SpecError("mlp_bias=true is not supported (no Llama/Qwen2 checkpoint uses it)")


def rope_of(c: dict) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) of a config with defaults filled in, either shape of the file."""
    rope_params = c.get("rope_parameters") or {}
    rope_theta = float(rope_params.get("rope_theta", c["rope_theta"]))
    scaling = dict(rope_params or c.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise SpecError(
            f"rope_type {rope_type!r} in config.json is not supported; megatrain implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_theta, RopeScaling(rope_type=rope_type, **{k: v for k, v in scaling.items() if k in known})


def spec_fields(c: dict, model_type: str, qkv_bias: bool) -> dict[str, Any]:
    """ModelSpec fields (all but `name`) of a checked config with defaults filled in."""
    heads = int(c["num_attention_heads"])
    rope_theta, rope = rope_of(c)
    dtype = c.get("dtype") or c.get("torch_dtype") or "float32"
    if dtype not in DTYPE_BYTES:
        raise SpecError(f"dtype {dtype!r} in config.json is not one of {', '.join(DTYPE_BYTES)}")
    return dict(
        model_type=model_type,
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        rms_norm_eps=float(c["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope,
        max_position_embeddings=int(c["max_position_embeddings"]),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        dtype=dtype,
    )


def common_config(spec: ModelSpec, architecture: str) -> dict:
    """The fields every Llama-shaped config.json has (transformers 4.x shape)."""
    return {
        "architectures": [architecture],
        "model_type": spec.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype,
    }


def with_rope_scaling(cfg: dict, spec: ModelSpec) -> dict:
    """`cfg` with the spec's rope_scaling added (none for the default RoPE)."""
    if spec.rope_scaling.rope_type != "default":
        rs = asdict(spec.rope_scaling)
        if spec.rope_scaling.rope_type == "linear":
            rs = {"rope_type": "linear", "factor": spec.rope_scaling.factor}
        cfg["rope_scaling"] = rs
    return cfg
