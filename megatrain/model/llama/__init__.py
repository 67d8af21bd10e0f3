"""The Llama family (HF model_type "llama"): `shape.py` (tensors, HF names, FLOPs, working set, init rule), `hf.py`
(config.json in and out), `layer.py` and `rope.py` (the layer math, torch). Mistral and Qwen2 reuse its shape."""
from megatrain.model.llama.shape import LlamaFamily
from megatrain.model.registry import register_family

LLAMA = register_family(LlamaFamily())
