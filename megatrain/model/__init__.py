"""Model families: shapes, tensor layout, HF config mapping, FLOPs, working sets, layer math and initialisation (the
bottom layer: imports nothing else of megatrain but the settings grammar).

Each family is a folder (`llama/`, `mistral/`, `qwen2/`) whose `__init__` registers it (`registry.register_family`);
importing them here registers the built-in families before any `ModelSpec` is built. Their `__init__`s are torch-free:
the layer math (torch) is loaded on first use.
"""
from megatrain.model import llama, mistral, qwen2  # noqa: F401 (registers the built-in families)
