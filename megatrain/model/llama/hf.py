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
# A Mistral config.json without `sliding_window` gets transformers' default window of 4096 (an explicit null is
# full attention): `sliding_window_of` reads the key's presence, not this dict.
MISTRAL_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                        max_position_embeddings=4096 * 32)
MISTRAL_DEFAULT_WINDOW = 4096
QWEN2_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=32768)

# HF config fields that change a model's math and that megatrain does not implement: (field, the values that leave
# the math as megatrain computes it, what the field does). A config with another value is refused by name
# (`check_unsupported`); absent or null is always accepted. Fields of other architectures are listed too:
# transformers' Llama/Mistral/Qwen2 classes ignore them, but a config carrying them was written for a model whose
# math they change, and training it as a Llama would be silently wrong. Families add their own (`Family.
# unsupported_fields`). docs/training.md, "Model families and HF fields", lists them for users.
UNSUPPORTED_FIELDS: tuple[tuple[str, tuple, str], ...] = (
    ("hidden_act", ("silu",), "MLP activations other than silu (its MLP is SwiGLU)"),
    ("mlp_bias", (False,), "biases on the MLP projections"),
    ("attention_dropout", (0, 0.0), "dropout on the attention probabilities while training"),
    ("partial_rotary_factor", (1, 1.0), "RoPE on only part of each head's dimensions"),
    ("rotary_pct", (1, 1.0), "RoPE on only part of each head's dimensions (GPT-NeoX spelling)"),
    ("use_qk_norm", (False,), "RMSNorm on queries and keys"),
    ("qk_norm", (False,), "RMSNorm on queries and keys"),
    ("qk_layernorm", (False,), "LayerNorm on queries and keys"),
    ("attn_logit_softcapping", (), "tanh soft-capping of the attention logits"),
    ("final_logit_softcapping", (), "tanh soft-capping of the output logits"),
    ("logit_scale", (1, 1.0), "a scale on the output logits"),
    ("logits_scaling", (1, 1.0), "a divisor of the output logits"),
    ("embedding_multiplier", (1, 1.0), "a scale on the embeddings"),
    ("residual_multiplier", (1, 1.0), "a scale on each residual branch"),
    ("attention_multiplier", (), "an attention scale other than head_dim**-0.5"),
    ("query_pre_attn_scalar", (), "an attention scale other than head_dim**-0.5"),
    ("clip_qkv", (), "clipping of the q/k/v projections"),
    ("no_rope_layers", (), "layers without RoPE"),
    ("no_rope_layer_interval", (0,), "layers without RoPE"),
    ("attn_temperature_tuning", (False,), "position-dependent attention temperature"),
    ("use_parallel_residual", (False,), "attention and MLP in parallel on one residual"),
    ("num_local_experts", (0, 1), "a mixture-of-experts MLP"),
    ("num_experts", (0, 1), "a mixture-of-experts MLP"),
    ("num_experts_per_tok", (0, 1), "a mixture-of-experts MLP"),
)


def check_unsupported(c: dict, table: tuple[tuple[str, tuple, str], ...], prefix: str = "") -> None:
    """Refuse a field of `table` whose value is not one of its accepted ones (a SpecError naming the field;
    `prefix`: where `c` sits in config.json, "rope_parameters." for a nested dict)."""
    for key, accepted, what in table:
        v = c.get(key)
        # 0 and False are equal in Python; a bool is accepted only where a bool is (and a number where a number is)
        if v is None or any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in accepted):
            continue
        keep = f"set it to {accepted[0]!r} or remove it" if accepted else "remove it"
        raise SpecError(f"config.json: {prefix}{key}={v!r} is not supported: megatrain does not implement {what}; "
                        f"{keep}, or train this model with another tool")


def layer_types_of(c: dict) -> list | None:
    """The config's `layer_types` (a list of "full_attention" / "sliding_attention") or None; checked."""
    types = c.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise SpecError(f"config.json: layer_types={types!r} is not supported; megatrain knows only "
                        "'full_attention' and 'sliding_attention' layers")
    n = int(c["num_hidden_layers"])
    if len(types) != n:
        raise SpecError(f"config.json: layer_types names {len(types)} layers but num_hidden_layers={n}")
    return types


def window_value(c: dict, default: int | None) -> int | None:
    """The config's `sliding_window` (an absent key: `default`; null: None), checked."""
    w = c.get("sliding_window", default) if "sliding_window" in c else default
    if w is not None and (isinstance(w, bool) or not (isinstance(w, int) or isinstance(w, float) and w.is_integer())
                          or w <= 0):
        raise SpecError(f"config.json: sliding_window={w!r} must be a positive integer (the tokens a query sees, "
                        "itself included), or null for full causal attention")
    return None if w is None else int(w)


def uniform_window(types: list, window: int | None, where: str) -> int | None:
    """The one window of every layer, given each layer's type: refused when layers differ (a window in some layers
    only is not implemented: the layer math has one window per model) or when sliding layers have no window."""
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {True, False}:
        first = types.index("sliding_attention")
        raise SpecError(f"config.json: {where} gives a sliding window to some layers only (from layer {first}); "
                        "megatrain implements one attention kind for every layer: set it so that all layers or "
                        "none slide")
    if True in sliding and window is None:
        raise SpecError(f"config.json: {where} makes layers slide but sliding_window is null; set sliding_window")
    return window if True in sliding else None


_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
_POSITIVE_ROPE_KEYS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")
# What each RoPE type reads (transformers refuses a config without them; megatrain would otherwise fill defaults in).
_REQUIRED_ROPE_KEYS = {"linear": ("factor",),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


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
            if k in ("rope_type", "type"):
                continue
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise SpecError(f"config.json: {key}.{k}={x!r} must be a number")
            if k in _POSITIVE_ROPE_KEYS and x <= 0:
                raise SpecError(f"config.json: {key}.{k}={x!r} must be a positive number")
    for key in ("tie_word_embeddings", "mlp_bias", "attention_bias"):
        v = c.get(key)
        if v is not None and not isinstance(v, bool):
            raise SpecError(f"config.json: {key}={v!r} must be true or false")
    for key in ("hidden_act", "dtype", "torch_dtype"):
        v = c.get(key)
        if v is not None and not isinstance(v, str):
            raise SpecError(f"config.json: {key}={v!r} must be a string")
    check_unsupported(c, UNSUPPORTED_FIELDS)
    for key in ("rope_parameters", "rope_scaling"):  # partial RoPE may also sit in the RoPE dict (transformers 5)
        check_unsupported(c.get(key) or {}, tuple(f for f in UNSUPPORTED_FIELDS if f[0] == "partial_rotary_factor"),
                          prefix=f"{key}.")


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
    missing = [k for k in _REQUIRED_ROPE_KEYS.get(rope_type, ()) if k not in scaling]
    if missing:
        raise SpecError(f"config.json: rope_type {rope_type!r} needs {', '.join(missing)} in rope_scaling "
                        "(rope_parameters); transformers requires them too")
    return rope_theta, RopeScaling(rope_type=rope_type, **{k: v for k, v in scaling.items() if k in known})


def spec_fields(c: dict, model_type: str, qkv_bias: bool, sliding_window: int | None = None) -> dict[str, Any]:
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
        sliding_window=sliding_window,
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
