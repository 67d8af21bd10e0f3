"""Seeded random initialization of a model, written in place into the tiles that will hold it.

    init_into(spec, dest=store.master, seed=0, std=0.02)

Each tensor is initialized as its family's `init_rule` says ("normal": N(0, std), "ones", "zeros"); for the Llama
shapes that is what Hugging Face does (`_init_weights` with `initializer_range`): every matrix (embedding,
projections, lm_head) ~ N(0, std), RMSNorm weights 1, biases 0.

Each unit draws from its own generator, seeded by (seed, unit), so a unit's weights do not depend on which units
are initialized before it, in what order, or whether the model is cut to fewer layers: the same seed gives the same
layer 3 whatever the schedule, the store layout or `model.num_layers`. Writing into `dest(unit)` (the host store's
own fp32 master tile) means no second copy of the model exists at any time; the peak is the store itself.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from megatrain.model.layout import unit_layout
from megatrain.model.spec import EMBED, HEAD, ModelSpec

__all__ = ["unit_seed", "init_tensor", "init_unit", "init_into", "init_tiles"]


def unit_seed(seed: int, unit: int) -> int:
    """The generator seed of one unit: a well-mixed 63-bit hash of (seed, unit) (NumPy's SeedSequence)."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    # unit + 2 keeps the entropy words non-negative (EMBED = -1, HEAD = -2).
    return int(np.random.SeedSequence([seed, unit + 2]).generate_state(1, np.uint64)[0] >> 1)


@torch.no_grad()
def init_tensor(spec: ModelSpec, name: str, view: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """Initialize one tensor of a unit in place as the spec's family says (a draw from `gen` for "normal")."""
    rule = spec.family.init_rule(name, tuple(view.shape))
    if rule == "normal":
        view.normal_(0.0, std, generator=gen)
    elif rule in ("ones", "zeros"):
        view.fill_(1.0 if rule == "ones" else 0.0)
    else:
        raise ValueError(f"family {spec.model_type!r} gives tensor {name!r} the init rule {rule!r}; "
                         "use normal, ones or zeros")


@torch.no_grad()
def init_unit(spec: ModelSpec, unit: int, tile: torch.Tensor, seed: int = 0, std: float = 0.02) -> None:
    """Initialize one unit's flat fp32 tile in place.

    `tile` is the unit's full tile in `unit_layout` order, or, for a tied head, its tail without the lm_head
    (the host store keeps the shared matrix once, as the embedding). Matrices are drawn in layout order from
    the unit's own generator, so a full tile and a tail agree on the tensors they share.
    """
    if std <= 0:
        raise ValueError(f"init std must be positive, got {std}")
    layout = unit_layout(spec, unit)
    if tile.dim() != 1 or tile.dtype != torch.float32:
        raise ValueError(f"the tile of unit {unit} must be a 1-D fp32 tensor, got {tuple(tile.shape)} {tile.dtype}")
    offset = layout.numel - tile.numel()
    lm_head = layout.slice_of("lm_head.weight").numel if unit == HEAD else 0
    if offset not in (0, lm_head) or (offset and not spec.tie_word_embeddings):
        raise ValueError(f"the tile of unit {unit} has {tile.numel()} elements; the layout has {layout.numel}")
    gen = torch.Generator().manual_seed(unit_seed(seed, unit))
    for s in layout.slices:
        if unit == HEAD and s.name == "lm_head.weight" and spec.tie_word_embeddings:
            # Tied: the lm_head IS the embedding; a full tile gets a copy of it only when the caller has one.
            # Drawing nothing here keeps the norm's values independent of whether the tile is full or a tail.
            continue
        init_tensor(spec, s.name, tile[s.offset - offset:s.offset - offset + s.numel].view(s.shape), gen, std)


def init_into(spec: ModelSpec, dest: Callable[[int], torch.Tensor], seed: int = 0, std: float = 0.02,
              units: Iterable[int] | None = None) -> None:
    """Initialize every unit (or `units`) in place in the tile `dest(unit)` returns (see `init_unit`).

    With tied embeddings and a FULL head tile, its lm_head part is set to the embedding's matrix once every unit is
    drawn (so `units` must include EMBED). Units are drawn in parallel threads: each has its own generator, so the
    values do not depend on the order.
    """
    units = spec.units() if units is None else list(units)
    tiles = {unit: dest(unit) for unit in units}
    head = tiles.get(HEAD)
    tied_full = head is not None and spec.tie_word_embeddings and head.numel() == unit_layout(spec, HEAD).numel
    if tied_full and EMBED not in tiles:
        raise ValueError("a full tied head tile needs the embedding initialized with it (units has no EMBED)")
    # Each unit draws from its own generator, so units can be drawn at once: torch's normal_ runs on one core
    # (0.4 G values/s on the 2-core CPU machine, where 4 units of llama3-8b took 2.5 s in 2 threads, 3.8 s in 1).
    workers = max(1, min(len(units), torch.get_num_threads()))
    with ThreadPoolExecutor(workers, thread_name_prefix="megatrain-init") as pool:
        for done in [pool.submit(init_unit, spec, unit, tile, seed, std) for unit, tile in tiles.items()]:
            done.result()  # re-raises a unit's error here
    if tied_full:
        n = spec.vocab_size * spec.hidden_size
        head[:n].copy_(tiles[EMBED][:n])


def init_tiles(spec: ModelSpec, seed: int = 0, std: float = 0.02) -> dict[int, torch.Tensor]:
    """New full fp32 tiles {unit: (numel,)} with the initialization above (tests and small models)."""
    tiles = {u: torch.empty(unit_layout(spec, u).numel, dtype=torch.float32) for u in spec.units()}
    init_into(spec, tiles.__getitem__, seed, std)
    return tiles
