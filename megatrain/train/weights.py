"""A fresh run's first weights, written unit by unit into the host store's own master tiles (or a rank's slices).

Seeded init (`init.py`; a data-parallel rank draws each unit whole and keeps its slice, so the weights equal a
one-GPU run's of the same seed) or a Hugging Face directory (`hf_checkpoint.load_hf_into`; a rank reads only the
bytes of its slices, `dist/hf_load.py`). The streaming copies are refreshed afterwards.
"""
from __future__ import annotations

import time
from megatrain.io.hf_checkpoint import load_hf_into
from megatrain.io.sharded_hf_load import load_hf_slices
from megatrain.model.init import init_into


def fill_weights(model, spec, store, world) -> str:
    """Fill `store` as `model` (a ModelConfig) says; returns the log line that says what was loaded, how fast."""
    t0 = time.perf_counter()
    if model.pretrained and world.distributed:

        load_hf_slices(model.name, store, strict=not model.num_layers)
        what = f"loaded from {model.name} (this rank's slices)"
    elif model.pretrained:

        load_hf_into(model.name, spec, store.master, strict=not model.num_layers)
        what = f"loaded from {model.name}"
    else:

        if world.distributed:  # this rank's slices (megatrain/parallel/shard.py)
            store.init_slices(model.seed, model.init_std)
        else:
            init_into(spec, store.master, seed=model.seed, std=model.init_std)
        what = f"random init (seed {model.seed}, std {model.init_std})"
    for u in store.units:
        store.refresh_stream(u)
    return f"weights: {what} in {time.perf_counter() - t0:.2f} s"
