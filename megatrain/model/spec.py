"""Model shape: what a decoder-only model is made of, independent of torch.

A `ModelSpec` is built from a Hugging Face `config.json` (the model types of the registered families: llama,
mistral, qwen2; both the transformers 4.x and 5.x shapes of the file) or from a named preset. It answers the
questions every other part of megatrain asks: which tensors a streamed unit holds (HF names, shapes), how many
parameters and bytes, and how many FLOPs a forward / backward / recompute of a unit costs for a number of tokens.
The facts that differ between families come from the spec's family (`spec.family`, `model/registry.py`); the
spec's fields, its JSON and its public methods are the same for every family.

Units: the model is streamed as `num_layers` decoder layers plus two non-layer units, the embedding (`EMBED`)
and the head (`HEAD`: final norm, lm_head, loss). Unit ids are ints: 0..L-1 for layers, `EMBED`, `HEAD`. Each unit
has a kind ("embed", "head", or the family's kind of that layer); layers may differ in size, and the GPU ring's
slots hold the largest unit of the layer kinds (`kind_params`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from megatrain.model.fields import (  # noqa: F401 (re-exported: the spec's vocabulary, defined in fields.py)
    DTYPE_BYTES,
    EMBED,
    EMBED_KIND,
    HEAD,
    HEAD_KIND,
    SUPPORTED_ROPE_TYPES,
    RopeScaling,
    SpecError,
)
from megatrain.model.registry import Family, family_of


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only model of a registered family (Llama / Mistral / Qwen2)."""

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
    # Each query attends to the `sliding_window` latest tokens (itself included) in every layer; None: the whole
    # causal context. Only families with `has_sliding_window` (Mistral, Qwen2) read and write it.
    sliding_window: int | None = None

    def __post_init__(self):
        family = family_of(self.model_type)  # a SpecError naming the registered families
        check_spec_values(self)
        if self.sliding_window is not None and not getattr(family, "has_sliding_window", False):
            raise SpecError(f"sliding_window={self.sliding_window}: the {self.model_type} family has no sliding-window "
                            "attention (transformers' model ignores it too); use model_type mistral or drop it")

    @property
    def family(self) -> Family:
        """The model family this spec belongs to (its `model_type`'s registry entry)."""
        return family_of(self.model_type)

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
        if unit not in (EMBED, HEAD):
            self._check_layer(unit)
        return self.family.unit_tensors(self, unit)

    def hf_name(self, unit: int, local_name: str) -> str:
        """Full HF checkpoint name of a unit's tensor (`model.layers.3.mlp.up_proj.weight`)."""
        return self.family.hf_name(self, unit, local_name)

    def units(self) -> list[int]:
        """All units in forward order: embedding, layers, head."""
        return [EMBED, *range(self.num_layers), HEAD]

    def unit_kind(self, unit: int) -> str:
        """"embed", "head", or the family's kind of that decoder layer ("layer" for every layer of a Llama)."""
        if unit == EMBED:
            return EMBED_KIND
        if unit == HEAD:
            return HEAD_KIND
        self._check_layer(unit)
        return self.family.layer_kind(self, unit)

    def unit_params(self, unit: int) -> int:
        return _unit_params(self, unit)

    def kind_params(self) -> dict[str, int]:
        """{kind: parameters of its largest unit} for the kinds of the decoder layers, in layer order: what one
        slot of the GPU weight ring must hold for each kind that streams through it."""
        return dict(_kind_params(self))

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (every layer, when they are all the same size)."""
        return max(self.kind_params().values(), default=0)

    @property
    def num_params(self) -> int:
        """Trainable parameters; a tied lm_head is the embedding and is counted once."""
        total = sum(self.unit_params(u) for u in self.units())
        if self.tie_word_embeddings:
            total -= self.vocab_size * self.hidden_size
        return total

    # ---- FLOPs -------------------------------------------------------------------------------------------------
    def unit_forward_flops(self, unit: int, batch: int, seq: int) -> float:
        """Forward FLOPs of one unit on `batch` sequences of `seq` tokens (matmuls + causal attention)."""
        return self.family.unit_forward_flops(self, unit, batch, seq)

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

    def tiled_mlp_flops(self, unit: int, batch: int, seq: int) -> float:
        """FLOPs a layer's backward adds when its norm + MLP half runs in tiles (`mlp_tile_tokens`: it recomputes
        that half's forward)."""
        return self.family.tiled_mlp_flops(self, unit, batch, seq)

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
        """JSON-able fields; `sliding_window` only when set, so that the JSON of a spec without one (every preset,
        every checkpoint written before windows existed) is what it always was."""
        d = asdict(self)
        if d["sliding_window"] is None:
            del d["sliding_window"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        return cls(**d)

    def to_hf_config(self) -> dict:
        """A transformers 4.x-shaped config.json that `from_pretrained` reads."""
        return self.family.to_hf_config(self)


# The spec fields' names in config.json, for messages (the rest are spelled the same).
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}


def _named(field_name: str) -> str:
    hf_name = _HF_NAMES.get(field_name)
    return f"{field_name} (config.json: {hf_name})" if hf_name else field_name


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_spec_values(spec: ModelSpec) -> None:
    """Refuse a spec whose numbers no model can have, naming the field (a SpecError): non-positive sizes, head
    counts that do not divide, an odd head_dim (rotate-half RoPE pairs dimension i with i + head_dim/2), a
    non-positive rms_norm_eps or rope_theta (NaN in the first step, blamed on nothing), RoPE scaling that divides
    by zero or is not implemented, a sliding window of no token. Every spec passes here, however it was built
    (config.json, a preset, a checkpoint's or a Program's JSON)."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings"):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SpecError(f"{_named(name)}={v!r} must be a positive integer")
    if spec.num_heads % spec.num_kv_heads:
        raise SpecError(f"num_attention_heads={spec.num_heads} is not a multiple of num_key_value_heads="
                        f"{spec.num_kv_heads}: every key/value head must serve the same number of query heads")
    if spec.head_dim % 2:
        raise SpecError(f"head_dim={spec.head_dim} must be even (rotary embeddings rotate dimension pairs)")
    for name in ("rms_norm_eps", "rope_theta"):
        v = getattr(spec, name)
        if not _is_number(v) or v <= 0:
            raise SpecError(f"{name}={v!r} must be a positive number (config.json: {name}"
                            f"{' or rope_parameters.rope_theta' if name == 'rope_theta' else ''})")
    rs = spec.rope_scaling
    if rs.rope_type not in SUPPORTED_ROPE_TYPES:
        raise SpecError(f"rope_type {rs.rope_type!r} is not supported; use one of {', '.join(SUPPORTED_ROPE_TYPES)} "
                        "(or remove rope_scaling from config.json)")
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        v = getattr(rs, name)
        if not _is_number(v) or v <= 0:
            raise SpecError(f"rope_scaling.{name}={v!r} must be a positive number")
    if rs.rope_type == "llama3" and rs.high_freq_factor <= rs.low_freq_factor:
        raise SpecError(f"rope_scaling: high_freq_factor={rs.high_freq_factor} must exceed low_freq_factor="
                        f"{rs.low_freq_factor} (llama3 RoPE blends between them)")
    if spec.dtype not in DTYPE_BYTES:
        raise SpecError(f"dtype {spec.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    w = spec.sliding_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
        raise SpecError(f"sliding_window={w!r} must be a positive integer (the tokens a query sees, itself "
                        "included), or null for full causal attention")


# Sizes are asked for per task and per copy by the builders; a spec is frozen, so they are computed once.
@lru_cache(maxsize=4096)
def _unit_params(spec: ModelSpec, unit: int) -> int:
    return sum(math.prod(shape) for _, shape in spec.unit_tensors(unit))


@lru_cache(maxsize=256)
def _kind_params(spec: ModelSpec) -> dict[str, int]:
    out: dict[str, int] = {}
    for layer in range(spec.num_layers):
        kind = spec.unit_kind(layer)
        out[kind] = max(out.get(kind, 0), spec.unit_params(layer))
    return out


# ---- Hugging Face config.json --------------------------------------------------------------------------------
def spec_from_hf_config(cfg: dict, name: str = "hf") -> ModelSpec:
    """Build a ModelSpec from the dict of a HF `config.json` (transformers 4.x or 5.x shape), through the family its
    `model_type` names."""
    if not isinstance(cfg, dict):
        raise SpecError(f"config.json must hold a JSON object, got a JSON {type(cfg).__name__}")
    try:
        family = family_of(cfg.get("model_type"))
    except SpecError as e:
        raise SpecError(f"config.json: {e}") from None
    fields = family.from_hf_config(cfg)
    try:
        return ModelSpec(name=name, **fields)
    except SpecError as e:
        raise SpecError(f"config.json: {e}") from None


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
