"""The Mistral family (HF model_type "mistral"): the Llama shape with Mistral's config defaults.

Sliding-window attention is NOT implemented: a config's `sliding_window` is not read, and every layer attends to the
whole causal context, as before the families had folders (issue 22 owns implementing it; until then a config that
sets a window shorter than the training sequence trains with full attention). `attention_bias` is not refused for
Mistral (it never was); the projections have no biases either way.
"""
from megatrain.model.llama import hf
from megatrain.model.llama.shape import LlamaFamily
from megatrain.model.registry import register_family


class MistralFamily(LlamaFamily):
    name = "mistral"
    architecture = "MistralForCausalLM"
    hf_defaults = hf.MISTRAL_DEFAULTS

    def check_hf_options(self, c: dict) -> None:
        """Nothing beyond the Llama checks (`hf.check_values`)."""

    def to_hf_config(self, spec) -> dict:
        return hf.with_rope_scaling(hf.common_config(spec, self.architecture), spec)


MISTRAL = register_family(MistralFamily())
