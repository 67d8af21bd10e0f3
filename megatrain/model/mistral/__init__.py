"""The Mistral family (HF model_type "mistral"): the Llama shape with Mistral's config defaults and sliding-window
attention.

Sliding window, as transformers' MistralForCausalLM: `sliding_window` W makes every layer's query t attend to keys
t-W+1..t (W tokens, itself included; `masking_utils.sliding_window_overlay`: kv > q - W); null is full causal
attention; a config.json WITHOUT the key gets transformers' default window, 4096. `layer_types` is ignored, as
transformers' Mistral ignores it (it warns and windows every layer). Export writes `sliding_window` back, null
included, so that transformers never falls back on its default. `attention_bias` is accepted and ignored, as
transformers' Mistral has no biases whatever it says. Refused fields: `hf.UNSUPPORTED_FIELDS` (docs/training.md).
"""
from megatrain.model.llama import hf
from megatrain.model.llama.shape import LlamaFamily
from megatrain.model.registry import register_family


class MistralFamily(LlamaFamily):
    name = "mistral"
    architecture = "MistralForCausalLM"
    hf_defaults = hf.MISTRAL_DEFAULTS
    unsupported_fields = ()  # attention_bias, layer_types: ignored by transformers' Mistral too
    has_sliding_window = True

    def check_hf_options(self, c: dict) -> None:
        """Nothing beyond the Llama checks (`hf.check_values`)."""

    def sliding_window_of(self, c: dict) -> int | None:
        return hf.window_value(c, hf.MISTRAL_DEFAULT_WINDOW)

    def to_hf_config(self, spec) -> dict:
        cfg = hf.common_config(spec, self.architecture)
        cfg["sliding_window"] = spec.sliding_window  # null written too: an absent key means 4096 to transformers
        return hf.with_rope_scaling(cfg, spec)


MISTRAL = register_family(MistralFamily())
