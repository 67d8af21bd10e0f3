"""Streaming safetensors: write tensors one at a time, read one tensor straight into a given buffer.

`safetensors.torch.save_file` first turns every tensor into a bytes object, a second full copy of what it
saves; for a store of hundreds of GB that copy is the difference between a checkpoint and an OOM kill. The
format is simple enough to write as a stream instead (https://github.com/huggingface/safetensors#format):

    8 bytes     N, little-endian u64
    N bytes     JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
                padded with spaces to a multiple of 8
    data        the tensors' bytes, back to back, offsets relative to the start of the data

so `write_safetensors` writes the header from the entries' shapes and dtypes, then asks each entry for its
tensor only when its turn comes (an export converts one tensor to bf16 at a time). Files it writes are read by
`safetensors.safe_open` and by transformers. `read_header` checks a file's header against its size, so a
truncated file is an error naming the file and the first tensor whose bytes are missing.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import hashlib
from megatrain.units import MiB

DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the header size


class SafetensorsFormatError(ValueError):
    """A file that is not a complete safetensors file; the message names the file (and tensor)."""


@dataclass(frozen=True)
class Entry:
    """A tensor to write: its name, shape and dtype up front, its data from `get()` when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    get: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _write(f, data) -> None:
    """All writes of this module go through here (tests replace it to simulate a full disk)."""
    f.write(data)


def write_safetensors(path: str | Path, entries: Iterable[Entry], metadata: dict[str, str] | None = None,
                      fsync: bool = True, digest=None) -> int:
    """Write `entries` to `path` as safetensors, one tensor in memory at a time; returns the bytes written.
    `digest` (a hashlib object) is fed every byte written, so a checksum costs no second read of the file."""
    entries = list(entries)
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for e in entries:
        if e.dtype not in DTYPE_CODES:
            raise TypeError(f"tensor {e.name!r}: dtype {e.dtype} cannot be stored in safetensors")
        header[e.name] = {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    def put(data) -> None:
        _write(f, data)
        if digest is not None:
            digest.update(data)

    with open(path, "wb") as f:
        put(struct.pack("<Q", len(blob)))
        put(blob)
        for e in entries:
            t = e.get()
            if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                raise ValueError(f"tensor {e.name!r}: announced {e.shape} {e.dtype}, got {tuple(t.shape)} {t.dtype}")
            t = t.detach().to("cpu").contiguous()
            if t.numel():
                # A byte view of the tensor's own memory: no copy (x86 and ARM are little-endian, as the format).
                put(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return 8 + len(blob) + offset


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """({name: TensorInfo}, metadata) of a safetensors file, checked against the file's size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsFormatError(f"{path} is {size} bytes, too short to be a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsFormatError(f"{path}: header of {n} bytes does not fit the {size}-byte file "
                                         "(truncated or not a safetensors file)")
        try:
            raw = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsFormatError(f"{path}: header is not valid JSON ({e}); not a safetensors file?") from None
    meta = raw.pop("__metadata__", None) or {}
    infos = {}
    for name, d in raw.items():
        try:
            dtype = CODE_DTYPES[d["dtype"]]
            begin, end = (8 + n + int(x) for x in d["data_offsets"])
            shape = tuple(int(s) for s in d["shape"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError(f"{path}: tensor {name!r} has an unreadable header entry {d}") from None
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize:
            raise SafetensorsFormatError(f"{path}: tensor {name!r} is {end - begin} bytes, shape {shape} of {dtype} "
                                         f"needs {numel * dtype.itemsize}")
        infos[name] = TensorInfo(name, dtype, shape, begin, end)
    for info in sorted(infos.values(), key=lambda i: i.end):
        if info.end > size:
            raise SafetensorsFormatError(
                f"{path} is truncated: it is {size} bytes, but tensor {info.name!r} needs bytes up to {info.end}; "
                "the file was not written completely (copy or download it again)"
            )
    return infos, meta


def read_into(path: str | Path, info: TensorInfo, out: torch.Tensor) -> torch.Tensor:
    """Read one tensor's bytes straight into `out` (contiguous CPU, same dtype and numel): no temporary."""
    numel = info.end - info.begin
    if not out.is_contiguous() or out.dtype != info.dtype or out.numel() * out.dtype.itemsize != numel:
        raise ValueError(f"{path}: tensor {info.name!r} ({info.shape}, {info.dtype}) does not fit the destination "
                         f"({tuple(out.shape)}, {out.dtype})")
    buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    with open(path, "rb") as f:
        f.seek(info.begin)
        got = f.readinto(buf)
    if got != numel:
        raise SafetensorsFormatError(f"{path}: tensor {info.name!r} ended after {got} of {numel} bytes (truncated?)")
    return out


def file_sha256(path: str | Path, chunk_bytes: int = 16 * MiB) -> str:
    """SHA-256 of a file, read in chunks (constant memory)."""

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def all_finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether every value of `t` is finite, without a temporary the size of `t`: a sum is not finite when any
    value is NaN/inf (or, for absurd magnitudes, overflows), and only then are chunks checked one by one."""
    flat = t.reshape(-1)
    if torch.isfinite(flat.sum()):
        return True
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))
