"""ModelSpec from HF config.json (transformers 4.x and 5.x shapes), presets, parameter counts and FLOPs."""
import json

import pytest

from megatrain.model.presets import PRESETS, get_model
from megatrain.model.spec import EMBED, HEAD, SpecError, load_hf_config, spec_from_hf_config

LLAMA3_V4 = {  # transformers 4.x shape: rope_theta top level, rope_scaling, torch_dtype
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 344,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 512},
    "tie_word_embeddings": False,
}
# The same model as transformers 5.x writes it: rope_parameters holds theta and scaling, dtype replaces torch_dtype.
LLAMA3_V5 = {k: v for k, v in LLAMA3_V4.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
LLAMA3_V5["dtype"] = "bfloat16"
LLAMA3_V5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 512}


def write_config(directory, cfg):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_both_config_shapes_give_the_same_spec(tmp_path):
    a = load_hf_config(write_config(tmp_path / "a", LLAMA3_V4))
    b = load_hf_config(write_config(tmp_path / "b", LLAMA3_V5))
    assert a.to_dict() | {"name": ""} == b.to_dict() | {"name": ""}
    assert a.rope_theta == 500000.0 and a.rope_scaling.rope_type == "llama3" and a.rope_scaling.factor == 8.0
    assert a.rope_scaling.original_max_position_embeddings == 512
    assert a.dtype == "bfloat16" and a.num_kv_heads == 2 and a.head_dim == 16


def test_hf_defaults_fill_missing_fields():
    s = spec_from_hf_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                             "intermediate_size": 128, "num_hidden_layers": 2})
    assert s.vocab_size == 32000 and s.num_kv_heads == 4 and s.rms_norm_eps == 1e-6 and s.rope_theta == 10000.0
    assert s.head_dim == 16 and not s.tie_word_embeddings and s.rope_scaling.rope_type == "default"
    q = spec_from_hf_config({"model_type": "qwen2"})
    assert q.vocab_size == 151936 and q.qkv_bias
    assert ("self_attn.q_proj.bias", (q.q_dim,)) in q.unit_tensors(0)


def test_old_rope_scaling_type_key_and_linear():
    s = spec_from_hf_config({**LLAMA3_V4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert s.rope_scaling.rope_type == "linear" and s.rope_scaling.factor == 2.0


@pytest.mark.parametrize("cfg, words", [
    ({**LLAMA3_V4, "model_type": "gpt2"}, "model_type 'gpt2'"),
    ({**LLAMA3_V4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({**LLAMA3_V5, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope_type 'longrope'"),
    ({**LLAMA3_V4, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**LLAMA3_V4, "num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_configs_are_refused_clearly(cfg, words):
    with pytest.raises(SpecError, match=words):
        spec_from_hf_config(cfg)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(SpecError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_hf_config(tmp_path)
    with pytest.raises(SpecError, match="unknown model"):
        get_model("no-such-model")


def test_parameter_counts_match_hand_counts():
    s = PRESETS["bench-3b"]  # the peers' model of BENCHMARKS.md: 2.971e9 parameters
    assert round(s.num_params / 1e6) == 2971
    d, f, q, kv = 3072, 8192, 3072, 6 * 128
    assert s.layer_params == d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
    assert s.unit_params(EMBED) == 32000 * d and s.unit_params(HEAD) == 32000 * d + d
    assert round(PRESETS["llama3-8b"].num_params / 1e6) == 8030  # Meta-Llama-3-8B has 8.03e9
    assert 115e9 < PRESETS["dense-120b"].num_params < 125e9
    tied = spec_from_hf_config({**LLAMA3_V4, "tie_word_embeddings": True})
    untied = spec_from_hf_config(LLAMA3_V4)
    assert untied.num_params - tied.num_params == 1000 * 128


def test_flops_scale_with_tokens_and_attention():
    s = PRESETS["bench-3b"]
    f1 = s.unit_forward_flops(0, 1, 2048)
    assert s.unit_forward_flops(0, 8, 2048) == pytest.approx(8 * f1)
    matmul_only = 2 * 2048 * (s.layer_params - 2 * s.hidden_size)
    assert f1 > matmul_only and (f1 - matmul_only) == pytest.approx(2 * 2048**2 * s.q_dim)
    assert s.unit_backward_flops(0, 1, 2048) == 2 * f1
    assert s.unit_forward_flops(EMBED, 8, 2048) == 0


def test_hf_config_round_trip():
    for name in ("debug", "llama3-8b", "qwen2.5-7b"):
        s = PRESETS[name]
        back = spec_from_hf_config(s.to_hf_config(), name=s.name)
        assert back == s


def test_task_flops_follow_the_recompute_once_rule():
    s = PRESETS["bench-3b"]
    fwd = s.unit_forward_flops(3, 2, 512)
    assert s.task_flops("F", 3, 2, 512) == s.task_flops("R", 3, 2, 512) == fwd
    assert s.task_flops("B", 3, 2, 512) == 3 * fwd  # recompute once + backward (2x): 8N per token with F
    assert s.task_flops("F", HEAD, 2, 512) == 3 * s.unit_forward_flops(HEAD, 2, 512)  # loss fwd + bwd fused
