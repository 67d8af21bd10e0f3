"""The Qwen2 family (HF model_type "qwen2"): the Llama shape with biases on the q, k and v projections (o_proj has
none), Qwen2's config defaults, and `attention_bias` not refused (Qwen2 configs do not carry it; the biases are
part of the architecture)."""
from megatrain.model.llama import hf
from megatrain.model.llama.shape import LlamaFamily
from megatrain.model.registry import register_family


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    hf_defaults = hf.QWEN2_DEFAULTS

    def check_hf_options(self, c: dict) -> None:
        """Nothing beyond the Llama checks (`hf.check_values`)."""

    def qkv_bias_of(self, c: dict) -> bool:
        return True

    def to_hf_config(self, spec) -> dict:
        return hf.with_rope_scaling(hf.common_config(spec, self.architecture), spec)


QWEN2 = register_family(Qwen2Family())
