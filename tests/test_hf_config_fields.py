"""Hugging Face config fields that change a model's math: implemented, or refused by name when config.json loads.

Every field of the written-down list (`hf.UNSUPPORTED_FIELDS` and each family's `unsupported_fields`; the same list
is in docs/training.md) is refused with a non-default value, naming the field, and accepted at its default (and
when absent or null). Impossible values (rope_theta <= 0 in either shape of the file, non-positive sizes and eps,
head counts that do not divide, an odd head_dim, RoPE scaling that divides by zero) are refused naming the field,
before any tensor exists, however the spec is built: config.json, a ModelSpec, a checkpoint's spec JSON. Before
this, `rope_parameters.rope_theta: 0` (transformers 5's shape) trained into NaN with a message blaming the
learning rate.
"""
from __future__ import annotations

import dataclasses

import pytest

from megatrain.model.llama.hf import UNSUPPORTED_FIELDS
from megatrain.model.presets import PRESETS
from megatrain.model.registry import family_of
from megatrain.model.spec import ModelSpec, RopeScaling, SpecError, spec_from_hf_config

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
FAMILIES = ("llama", "mistral", "qwen2")

# A value each field's model would have (the first non-default value a real config of that architecture carries).
NON_DEFAULT = {
    "hidden_act": "gelu", "mlp_bias": True, "attention_dropout": 0.1, "partial_rotary_factor": 0.5,
    "rotary_pct": 0.25, "use_qk_norm": True, "qk_norm": True, "qk_layernorm": True, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "logit_scale": 0.0625, "logits_scaling": 8.0, "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "query_pre_attn_scalar": 256, "clip_qkv": 8.0,
    "no_rope_layers": [1, 0], "no_rope_layer_interval": 4, "attn_temperature_tuning": True,
    "use_parallel_residual": True, "num_local_experts": 8, "num_experts": 64, "num_experts_per_tok": 2,
    "attention_bias": True, "sliding_window": 4096, "use_sliding_window": True,
}


def _cfg(model_type: str, **extra) -> dict:
    return {"model_type": model_type, **BASE, **extra}


def _refused_fields(model_type: str):
    return [*UNSUPPORTED_FIELDS, *family_of(model_type).unsupported_fields]


def test_every_listed_field_has_a_test_value_and_is_in_the_docs():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    for name in FAMILIES:
        for key, _, _ in _refused_fields(name):
            assert key in NON_DEFAULT, key
            assert f"`{key}`" in docs, f"docs/training.md does not list {key}"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_listed_field_with_another_value_is_refused_by_name(model_type):
    for key, _, _ in _refused_fields(model_type):
        with pytest.raises(SpecError) as e:
            spec_from_hf_config(_cfg(model_type, **{key: NON_DEFAULT[key]}))
        msg = str(e.value)
        assert f"{key}=" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_listed_field_at_its_default_or_null_is_accepted(model_type):
    plain = spec_from_hf_config(_cfg(model_type, sliding_window=None))
    for key, accepted, _ in _refused_fields(model_type):
        for value in (*accepted, None):
            spec = spec_from_hf_config(_cfg(model_type, **{"sliding_window": None, key: value}))
            assert spec == plain, (key, value)


def test_partial_rotary_in_the_rope_dict_is_refused_too():
    for key in ("rope_parameters", "rope_scaling"):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        with pytest.raises(SpecError, match=f"{key}.partial_rotary_factor=0.5"):
            spec_from_hf_config(_cfg("llama", **{key: rope}))
        rope["partial_rotary_factor"] = 1.0
        assert spec_from_hf_config(_cfg("llama", **{key: rope})).rope_theta == 10000.0


@pytest.mark.parametrize("extra, words", [
    ({"rope_theta": 0}, "rope_theta=0"),
    ({"rope_theta": -10000.0}, "rope_theta=-10000.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta=0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_parameters.rope_theta=-1.0"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06"),
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"num_hidden_layers": -1}, "num_hidden_layers=-1"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"head_dim": 7}, "head_dim=7"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor=0"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "high_freq_factor=4.0 must exceed"),
])
def test_impossible_values_are_refused_when_the_config_loads_naming_the_field(extra, words):
    with pytest.raises(SpecError, match=words) as e:
        spec_from_hf_config(_cfg("llama", **extra))
    assert str(e.value).startswith("config.json:") and "\n" not in str(e.value)


@pytest.mark.parametrize("change, words", [
    (dict(rope_theta=0.0), "rope_theta=0.0"),
    (dict(rope_theta=float("nan")), "rope_theta=nan"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(head_dim=15), "head_dim=15"),
    (dict(rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=1.0)),
     "high_freq_factor"),
    (dict(sliding_window=4), "has no sliding-window attention"),  # a llama spec
])
def test_a_spec_built_in_code_or_from_json_is_checked_the_same(change, words):
    with pytest.raises(SpecError, match=words):
        dataclasses.replace(PRESETS["debug"], **change)
    d = {**PRESETS["debug"].to_dict(), **{k: dataclasses.asdict(v) if k == "rope_scaling" else v
                                          for k, v in change.items()}}
    with pytest.raises(SpecError, match=words):  # a checkpoint's or a Program's spec JSON
        ModelSpec.from_dict(d)


def test_the_shipped_presets_pass():
    for spec in PRESETS.values():
        assert ModelSpec.from_dict(spec.to_dict()) == spec
