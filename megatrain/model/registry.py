"""The model-family registry: one entry per HF `model_type` megatrain trains.

A family is one folder, `megatrain/model/<family>/`, whose `__init__` registers an object with the `Family` methods
below; `megatrain/model/__init__` imports the built-in folders so that they are registered before any spec exists.
Everything else asks the family of a spec (`spec.family`, `family_of(model_type)`) instead of knowing the shape:

    shape         unit_tensors, layer_kind, hf_name           (torch-free)
    HF config     from_hf_config, to_hf_config                 (torch-free)
    cost models   unit_forward_flops, tiled_mlp_flops, layer_working_set, signature   (torch-free)
    init          init_rule                                    (torch-free)
    optional      has_sliding_window (whether a spec may carry `sliding_window`; False when absent)
    layer math    layer() -> a module with `decoder_layer` and `rope_cos_sin` (imports torch; loaded on first use)

Units may differ in size within a model: `layer_kind` names the kind of each decoder layer, and the GPU ring sizes
its slots for the largest unit of the kinds streamed through it (`ModelSpec.kind_params`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from megatrain.model.fields import SpecError

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec

__all__ = ["Family", "register_family", "family_of", "registered_families"]


class Family(Protocol):
    """What megatrain needs to know about a model family. `spec` is always a `ModelSpec` of this family."""

    name: str  # the HF `model_type` the family reads and writes ("llama")

    def unit_tensors(self, spec: ModelSpec, unit: int) -> list[tuple[str, tuple[int, ...]]]:
        """HF names (relative to the unit) and shapes of the tensors of one unit, matrices first (weight decay
        covers a prefix of the flat tile), then 1-D tensors."""

    def layer_kind(self, spec: ModelSpec, layer: int) -> str:
        """The kind of a decoder layer ("layer"; a family with several layer shapes names one kind per shape)."""

    def hf_name(self, spec: ModelSpec, unit: int, local_name: str) -> str:
        """Full HF checkpoint name of a unit's tensor."""

    def unit_forward_flops(self, spec: ModelSpec, unit: int, batch: int, seq: int) -> float:
        """Forward FLOPs of one unit on `batch` sequences of `seq` tokens."""

    def tiled_mlp_flops(self, spec: ModelSpec, unit: int, batch: int, seq: int) -> float:
        """FLOPs a backward adds when the layer's norm + MLP half runs in tiles (it recomputes that half)."""

    def layer_working_set(self, spec: ModelSpec, unit: int, act_bytes: int, tokens: int, cast_weights: bool,
                          mlp_tile_tokens: int, seq: int = 0) -> dict[str, int]:
        """GPU bytes of one layer's backward task at each moment that can be the peak (the planner's model);
        `tokens` per micro-batch, `seq` per sequence (what a (T, T) attention mask is sized by)."""

    def layer_graph_bytes(self, spec: ModelSpec, unit: int, act_bytes: int, tokens: int, cast_weights: bool,
                          compiled: bool) -> int:
        """GPU bytes one layer's forward graph holds from its forward to its backward when it keeps it (knob
        keep_activations), for `tokens` tokens of a micro-batch; `compiled`: the layer runs through torch.compile,
        whose partitioner saves other tensors than eager autograd does (`Placement.layer_kernel`)."""

    def signature(self, spec: ModelSpec) -> str:
        """The shape of the model's units, independent of name and depth (profile compute tables are keyed by it)."""

    def init_rule(self, name: str, shape: tuple[int, ...]) -> str:
        """How a tensor is initialized: "normal" (N(0, std)), "ones" or "zeros"."""

    def from_hf_config(self, cfg: dict) -> dict[str, Any]:
        """`ModelSpec` fields (all but `name`) of a HF config.json dict of this family; SpecError when unsupported."""

    def to_hf_config(self, spec: ModelSpec) -> dict:
        """A config.json dict that transformers' `from_pretrained` reads."""

    def layer(self) -> Any:
        """The layer math: a module with `decoder_layer(w, x, cos, sin, spec, mlp_tile_tokens=0)` and
        `rope_cos_sin(spec, seq_len, device, dtype)` (imports torch)."""


# Every member of the protocol, read off `Family` itself (checked at registration: a family missing one fails
# there, not mid-run; a member added to the protocol is checked without another list to keep in step).
_MEMBERS = tuple(Family.__annotations__) + tuple(n for n, v in vars(Family).items()
                                                 if callable(v) and not n.startswith("_"))

_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Register `family` under its `name` (the HF model_type); registering another family under a taken name is a
    mistake and raises."""
    missing = [m for m in _MEMBERS if not hasattr(family, m)]
    if missing:
        raise TypeError(f"{family!r} is not a model family: it lacks {', '.join(missing)} (see registry.Family)")
    old = _FAMILIES.get(family.name)
    if old is not None and old is not family:
        raise ValueError(f"model family {family.name!r} is already registered ({type(old).__name__})")
    _FAMILIES[family.name] = family
    return family


def registered_families() -> tuple[str, ...]:
    """Names (HF model_types) of the registered families, sorted."""
    return tuple(sorted(_FAMILIES))


def family_of(model_type: object) -> Family:
    """The family registered for `model_type`; a SpecError naming the registered families when there is none."""
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise SpecError(f"model_type {model_type!r} is not supported; megatrain trains "
                        f"{', '.join(registered_families())} (a new family is a folder under megatrain/model/ plus "
                        "a register_family call: docs/design.md, 'Adding a model family')")
    return family
