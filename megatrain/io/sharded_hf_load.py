"""A data-parallel rank's share of a Hugging Face directory: only the bytes of its slices are read.

A unit's flat tile is the concatenation of its tensors (`exec/layout.unit_layout`, each tensor flattened in HF's
row-major order), and rank r owns elements `[lo, lo + valid)` of it (`ShardedHostStore.shard`). For every tensor
that intersects that range, the intersecting elements are one contiguous byte range of the safetensors file: that
range is read (fp32 straight into the master slice; bf16 / fp16 through one temporary of the range's size, cast
into it). The checks of a one-process load run first (`hf_checkpoint._check`: every shard complete, every tensor
present with its shape and a float dtype), so a bad directory fails before the first byte, on every rank alike.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatrain.io.errors import CheckpointError
from megatrain.model.layout import unit_layout
from megatrain.io import safetensors_io as stio
from megatrain.io.hf_checkpoint import _check, _source_name, weight_files


@torch.no_grad()
def load_hf_slices(path: str | Path, store, strict: bool = True) -> int:
    """Fill this rank's master slices of `store` (a dist.shard.ShardedHostStore) from HF directory `path` and
    refresh the streaming copies; returns the bytes read (about 1/N of the directory's weights)."""
    path, spec = Path(path), store.spec
    tensors = weight_files(path)
    _check(spec, path, tensors, spec.units(), strict)
    read = 0
    for unit in store.units:
        lo, valid = store.shard(unit)  # this rank's elements of the unit's tile
        master = store.master(unit)  # (s,) fp32; elements past `valid` are padding
        master.zero_()
        for s in unit_layout(spec, unit).slices:
            a, b = max(lo, s.offset), min(lo + valid, s.offset + s.numel)
            if a >= b:
                continue  # the tensor lies outside this rank's range: not read
            name = _source_name(spec, unit, s.name, tensors)
            file, info = tensors[name]
            size = info.dtype.itemsize
            begin = info.begin + (a - s.offset) * size  # row-major: elements [a, b) of the tensor are contiguous
            part = stio.TensorInfo(name, info.dtype, (b - a,), begin, begin + (b - a) * size)
            dest = master[a - lo:b - lo]
            tmp = dest if info.dtype == torch.float32 else torch.empty(b - a, dtype=info.dtype)
            try:
                stio.read_into(file, part, tmp)
            except stio.SafetensorsFormatError as e:
                raise CheckpointError(str(e)) from None
            if tmp is not dest:
                dest.copy_(tmp)
            if not stio.all_finite(dest):
                raise CheckpointError(f"tensor {name!r} in {file} holds non-finite values (NaN or inf); the "
                                      "checkpoint is damaged or came from a diverged run")
            read += (b - a) * size
        store.refresh_stream(unit)
    return read
