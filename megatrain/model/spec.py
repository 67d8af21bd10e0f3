"""Model shape: what a decoder-only Llama-family model is made of, independent of torch.

A `ModelSpec` is built from a Hugging Face `config.json` (model types llama, mistral, qwen2; both the
transformers 4.x and 5.x shapes of the file) or from a named preset. It answers the questions every other
part of megatrain asks: which tensors a streamed unit holds (HF names, shapes), how many parameters and bytes,
and how many FLOPs a forward / backward / recompute of a unit costs for a number of tokens.

Units: the model is streamed as `num_layers` decoder layers plus two non-layer units, the embedding (`EMBED`)
and the head (`HEAD`: final norm, lm_head, loss). Unit ids are ints: 0..L-1 for layers, `EMBED`, `HEAD`.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

EMBED = -1
HEAD = -2

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
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


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama / Mistral / Qwen2 decoder-only model."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise SpecError(
                f"model_type {self.model_type!r} is not supported; megatrain trains {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise SpecError(
                f"rope_type {self.rope_scaling.rope_type!r} is not supported; use one of "
                f"{', '.join(SUPPORTED_ROPE_TYPES)} (or remove rope_scaling from config.json)"
            )
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise SpecError(f"{name} must be positive, got {getattr(self, name)}")

    # ---- tensors -----------------------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def unit_tensors(self, unit: int) -> list[tuple[str, tuple[int, ...]]]:
        """HF names (relative to the unit) and shapes of the tensors one unit streams, in tile order.

        Matrices come first and 1-D tensors (norms, biases) last, so that weight decay, which applies to
        matrices only, covers one contiguous prefix of the unit's flat tile.
        """
        d, f = self.hidden_size, self.intermediate_size
        if unit == EMBED:
            return [("embed_tokens.weight", (self.vocab_size, d))]
        if unit == HEAD:
            # With tied embeddings the head reads the embedding matrix; it is streamed as its own copy and
            # its gradient is added to the embedding's on the host.
            return [("lm_head.weight", (self.vocab_size, d)), ("norm.weight", (d,))]
        self._check_layer(unit)
        mats = [
            ("self_attn.q_proj.weight", (self.q_dim, d)),
            ("self_attn.k_proj.weight", (self.kv_dim, d)),
            ("self_attn.v_proj.weight", (self.kv_dim, d)),
            ("self_attn.o_proj.weight", (d, self.q_dim)),
            ("mlp.gate_proj.weight", (f, d)),
            ("mlp.up_proj.weight", (f, d)),
            ("mlp.down_proj.weight", (d, f)),
        ]
        vecs = [("input_layernorm.weight", (d,)), ("post_attention_layernorm.weight", (d,))]
        if self.qkv_bias:
            vecs += [
                ("self_attn.q_proj.bias", (self.q_dim,)),
                ("self_attn.k_proj.bias", (self.kv_dim,)),
                ("self_attn.v_proj.bias", (self.kv_dim,)),
            ]
        return mats + vecs

    def hf_name(self, unit: int, local_name: str) -> str:
        """Full HF checkpoint name of a unit's tensor (`model.layers.3.mlp.up_proj.weight`)."""
        if unit == EMBED:
            return f"model.{local_name}"
        if unit == HEAD:
            return local_name if local_name.startswith("lm_head") else f"model.{local_name}"
        return f"model.layers.{unit}.{local_name}"

    def units(self) -> list[int]:
        """All units in forward order: embedding, layers, head."""
        return [EMBED, *range(self.num_layers), HEAD]

    def unit_params(self, unit: int) -> int:
        return sum(math.prod(shape) for _, shape in self.unit_tensors(unit))

    @property
    def layer_params(self) -> int:
        return self.unit_params(0)

    @property
    def num_params(self) -> int:
        """Trainable parameters; a tied lm_head is the embedding and is counted once."""
        total = self.unit_params(EMBED) + self.num_layers * self.layer_params + self.unit_params(HEAD)
        if self.tie_word_embeddings:
            total -= self.vocab_size * self.hidden_size
        return total

    # ---- FLOPs -------------------------------------------------------------------------------------------------
    def unit_forward_flops(self, unit: int, batch: int, seq: int) -> float:
        """Forward FLOPs of one unit on `batch` sequences of `seq` tokens (matmuls + causal attention)."""
        tokens = batch * seq
        d = self.hidden_size
        if unit == EMBED:
            return 0.0  # a gather
        if unit == HEAD:
            return 2.0 * tokens * d * self.vocab_size
        matmul = 2.0 * tokens * (d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d + 3 * d * self.intermediate_size)
        # QK^T and PV, each 2*S*S*q_dim per sequence, halved by the causal mask.
        attention = 2.0 * batch * seq * seq * self.q_dim
        return matmul + attention

    def unit_backward_flops(self, unit: int, batch: int, seq: int) -> float:
        """Local backward FLOPs (gradients of inputs and weights), twice the forward."""
        return 2.0 * self.unit_forward_flops(unit, batch, seq)

    def task_flops(self, kind: str, unit: int, batch: int, seq: int) -> float:
        """FLOPs of one compute task of a schedule (kind "F", "R" or "B" on `batch` sequences of `seq`): a forward
        or recompute costs the forward; a backward recomputes once and differentiates (forward + backward); the
        head's forward task is its forward and backward fused."""
        fwd = self.unit_forward_flops(unit, batch, seq)
        if kind == "B" or unit == HEAD:
            return fwd + self.unit_backward_flops(unit, batch, seq)
        return fwd

    def model_flops_per_token(self) -> float:
        """6·N, the convention of BENCHMARKS.md (recompute and attention not counted)."""
        return 6.0 * self.num_params

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _check_layer(self, unit: int) -> None:
        if not 0 <= unit < self.num_layers:
            raise SpecError(f"unit {unit} is not a layer of {self.name} ({self.num_layers} layers)")

    def with_layers(self, num_layers: int) -> ModelSpec:
        return replace(self, num_layers=num_layers, name=f"{self.name}-L{num_layers}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        return cls(**d)

    def to_hf_config(self) -> dict:
        """A transformers 4.x-shaped config.json that `from_pretrained` reads."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        cfg = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
        }
        if self.model_type == "llama":
            cfg["attention_bias"] = False
            cfg["mlp_bias"] = False
        if self.rope_scaling.rope_type != "default":
            rs = asdict(self.rope_scaling)
            if self.rope_scaling.rope_type == "linear":
                rs = {"rope_type": "linear", "factor": self.rope_scaling.factor}
            cfg["rope_scaling"] = rs
        return cfg


# ---- Hugging Face config.json --------------------------------------------------------------------------------
# HF's defaults for fields a config.json may omit (transformers LlamaConfig / MistralConfig / Qwen2Config).
_HF_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                    max_position_embeddings=4096 * 32),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=32768),
}


_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def _check_hf_values(c: dict) -> None:
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


def spec_from_hf_config(cfg: dict, name: str = "hf") -> ModelSpec:
    """Build a ModelSpec from the dict of a HF `config.json` (transformers 4.x or 5.x shape)."""
    if not isinstance(cfg, dict):
        raise SpecError(f"config.json must hold a JSON object, got a JSON {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in _HF_DEFAULTS:
        raise SpecError(
            f"config.json has model_type {model_type!r}; megatrain supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    c = {**_HF_DEFAULTS[model_type], **{k: v for k, v in cfg.items() if v is not None}}
    _check_hf_values(c)
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise SpecError(f"hidden_act {act!r} is not supported; the SwiGLU MLP of megatrain uses silu")
    if c.get("mlp_bias"):
        raise SpecError("mlp_bias=true is not supported (no Llama/Qwen2 checkpoint uses it)")
    if model_type == "llama" and c.get("attention_bias"):
        raise SpecError("attention_bias=true on a llama config is not supported; Qwen2 configs get q/k/v biases")
    heads = int(c["num_attention_heads"])
    # transformers 5.x nests rope_theta and the scaling in rope_parameters; 4.x has rope_theta top-level and
    # rope_scaling (with "type" in old files, "rope_type" in newer ones).
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
    rope = RopeScaling(rope_type=rope_type, **{k: v for k, v in scaling.items() if k in known})
    dtype = c.get("dtype") or c.get("torch_dtype") or "float32"
    if dtype not in DTYPE_BYTES:
        raise SpecError(f"dtype {dtype!r} in config.json is not one of {', '.join(DTYPE_BYTES)}")
    return ModelSpec(
        name=name,
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
        qkv_bias=model_type == "qwen2",
        dtype=dtype,
    )


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read `config.json` (or a directory holding it) into a ModelSpec."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise SpecError(f"no config.json at {p}; pass a Hugging Face model directory or its config.json")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"{p} must hold a JSON object (a Hugging Face config), got a JSON {type(cfg).__name__}")
    return spec_from_hf_config(cfg, name=p.parent.name or "hf")
