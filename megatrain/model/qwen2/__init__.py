"""The Qwen2 family (HF model_type "qwen2"): the Llama shape with biases on the q, k and v projections (o_proj has
none), Qwen2's config defaults, and sliding-window attention as transformers 5 reads it.

`attention_bias` is not refused (Qwen2 configs do not carry it; the biases are part of the architecture, and
transformers' Qwen2 ignores the field).

Sliding window (transformers' `Qwen2Config`): no window unless `use_sliding_window` is true; then layer i slides
(window `sliding_window`, W tokens itself included, as Mistral's) when i >= `max_window_layers` (default 28), or as an
explicit `layer_types` list says. megatrain has one attention kind per model: all layers sliding or none are
trained; a window in some layers only is refused by name. Export writes use_sliding_window, sliding_window and
max_window_layers=0 (every layer slides) or use_sliding_window=false.
"""
from megatrain.model.fields import SpecError
from megatrain.model.llama import hf
from megatrain.model.llama.shape import LlamaFamily
from megatrain.model.registry import register_family

_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    hf_defaults = hf.QWEN2_DEFAULTS
    unsupported_fields = ()  # attention_bias: ignored by transformers' Qwen2
    has_sliding_window = True

    def check_hf_options(self, c: dict) -> None:
        """Nothing beyond the Llama checks (`hf.check_values`); the window's fields are read by
        `sliding_window_of`."""

    def qkv_bias_of(self, c: dict) -> bool:
        return True

    def sliding_window_of(self, c: dict) -> int | None:
        use = c.get("use_sliding_window", False)
        if use is None:
            use = False
        if not isinstance(use, bool):
            raise SpecError(f"config.json: use_sliding_window={use!r} must be true or false")
        window = hf.window_value(c, 4096) if use else None  # transformers: sliding_window only if use_sliding_window
        types = hf.layer_types_of(c)
        if types is not None:
            return hf.uniform_window(types, window, "layer_types")
        if window is None:
            return None
        first = c.get("max_window_layers", _MAX_WINDOW_LAYERS)
        if first is None:
            first = _MAX_WINDOW_LAYERS
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise SpecError(f"config.json: max_window_layers={first!r} must be a non-negative integer")
        n = int(c["num_hidden_layers"])
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        return hf.uniform_window(types, window, f"max_window_layers={first} (of {n} layers)")

    def to_hf_config(self, spec) -> dict:
        cfg = hf.common_config(spec, self.architecture)
        cfg["use_sliding_window"] = spec.sliding_window is not None
        if spec.sliding_window is not None:
            cfg["sliding_window"] = spec.sliding_window
            cfg["max_window_layers"] = 0  # every layer slides
        return hf.with_rope_scaling(cfg, spec)


QWEN2 = register_family(Qwen2Family())
