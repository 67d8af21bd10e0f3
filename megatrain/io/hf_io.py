"""Hugging Face state dicts <-> megatrain's flat per-unit tiles, and a plain reference forward over tiles.

The names are HF's own (`spec.hf_name`), so the map is the identity; what this module adds is packing tensors
into each unit's flat fp32 tile in `unit_layout` order, the tied-embedding rule, and errors that name the tensor
that is missing or has the wrong shape.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.exec.head import embed_forward, head_logits
from megatrain.exec.layers import decoder_layer
from megatrain.model.layout import unit_layout
from megatrain.exec.rope import rope_cos_sin
from megatrain.io.errors import CheckpointError


def _getter(get: Callable[[str], Tensor] | Mapping[str, Tensor]) -> Callable[[str], Tensor]:
    return get.__getitem__ if isinstance(get, Mapping) else get


def tiles_from_state_dict(spec: ModelSpec, get: Callable[[str], Tensor] | Mapping[str, Tensor]) -> dict[int, Tensor]:
    """Pack a checkpoint into one flat fp32 tile per unit: {unit: (unit numel,) fp32 on the CPU}.

    `get(name)` returns the tensor of a full HF name (a state dict's `__getitem__`, a safetensors `get_tensor`;
    a Mapping is accepted too). With tied embeddings the head's lm_head part is the embedding matrix when the
    checkpoint has no `lm_head.weight` (HF does not save the tied copy).
    """
    get = _getter(get)
    tiles: dict[int, Tensor] = {}
    for unit in spec.units():
        layout = unit_layout(spec, unit)
        tile = torch.empty(layout.numel, dtype=torch.float32)
        views = layout.views(tile)
        for s in layout.slices:
            name = spec.hf_name(unit, s.name)
            t, err = _fetch(get, name)
            if t is None and unit == HEAD and s.name == "lm_head.weight" and spec.tie_word_embeddings:
                name = spec.hf_name(EMBED, "embed_tokens.weight")  # tied: HF saves only the embedding
                t, err = _fetch(get, name)
            if t is None:
                raise CheckpointError(f"could not read tensor {name!r}, which {spec.name} ({spec.model_type}, "
                                      f"{spec.num_layers} layers) needs, from the checkpoint ({err}); "
                                      "is it the right model?") from err
            if tuple(t.shape) != s.shape:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)} in the checkpoint, the model "
                                      f"spec expects {s.shape}; does config.json belong to these weights?")
            with torch.no_grad():
                views[s.name].copy_(t.detach())  # any dtype/device -> fp32 CPU
        tiles[unit] = tile
    return tiles


def _fetch(get: Callable[[str], Tensor], name: str) -> tuple[Tensor | None, Exception | None]:
    """(tensor, None), or (None, the exception) when `get` fails: a dict raises KeyError for a missing name,
    safetensors its own SafetensorError, so any failure counts as "not there" and is reported with the name."""
    try:
        t = get(name)
    except Exception as e:  # noqa: BLE001 - re-raised by the caller as a CheckpointError naming the tensor
        return None, e
    return (t, None) if t is not None else (None, KeyError(name))


def state_dict_from_tiles(spec: ModelSpec, tiles: Mapping[int, Tensor], dtype: torch.dtype | None = None
                          ) -> dict[str, Tensor]:
    """The inverse of `tiles_from_state_dict`: {HF name: tensor}, each an independent contiguous copy (safetensors
    refuses tensors that share storage), in `dtype` (default: the tiles' dtype). Tied: no `lm_head.weight` entry."""
    missing = [u for u in spec.units() if u not in tiles]
    if missing:
        raise KeyError(f"tiles has no tile for units {missing}; expected {spec.units()} (EMBED={EMBED}, HEAD={HEAD})")
    out: dict[str, Tensor] = {}
    for unit in spec.units():
        for local, view in unit_layout(spec, unit).views(tiles[unit]).items():
            if unit == HEAD and local == "lm_head.weight" and spec.tie_word_embeddings:
                continue
            out[spec.hf_name(unit, local)] = view.detach().to(dtype or view.dtype, copy=True)
    return out


@torch.no_grad()
def forward_logits(spec: ModelSpec, tiles: Mapping[int, Tensor], ids: Tensor) -> Tensor:
    """Plain (non-streamed) forward over tiles: ids (B, T) -> logits (B, T, V) fp32, computed on ids.device in the
    tiles' dtype. A reference for tests and small-model inference, not a training path."""
    (x,) = forward_hidden(spec, tiles, ids)  # (B, T, d)
    head = unit_layout(spec, HEAD).views(tiles[HEAD].to(ids.device))
    return head_logits(head, x, spec)  # (B, T, V)


@torch.no_grad()
def forward_hidden(spec: ModelSpec, tiles: Mapping[int, Tensor], ids: Tensor, chunk_rows: int = 0) -> list[Tensor]:
    """Layer-major plain forward of the embedding and the decoder layers: ids (R, T) -> the final hidden states
    of its chunks of `chunk_rows` rows (0: one chunk; R = 0: one empty chunk), [(rows, T, d)], on ids.device in
    the tiles' dtype.

    Each of `tiles[EMBED]`, `tiles[0]`, ... is read once, in that order, the previous one dropped first, so a
    mapping that assembles tiles on demand (a sharded store's gather) holds one at a time; it is read even when
    R = 0. Each layer runs over the chunks in turn: its temporaries are one chunk's."""
    dev, (R, T) = ids.device, ids.shape
    step = chunk_rows or max(R, 1)
    w = tiles[EMBED].to(dev)
    dtype = w.dtype
    cos, sin = rope_cos_sin(spec, T, dev, dtype)  # (T, head_dim) each
    emb = unit_layout(spec, EMBED).views(w)["embed_tokens.weight"]
    xs = [embed_forward(emb, ids[lo:lo + step], dtype) for lo in range(0, max(R, 1), step)]  # [(rows, T, d)]
    del w, emb
    for layer in range(spec.num_layers):
        w = unit_layout(spec, layer).views(tiles[layer].to(dev))
        for i in range(len(xs)):  # in place in the list: one chunk's output beside the others
            xs[i] = decoder_layer(w, xs[i], cos, sin, spec)
        del w
    return xs
