"""Hugging Face model directories in and out of megatrain's per-unit tiles, one unit at a time.

Load: `load_hf_into(path, spec, dest)` fills the tile `dest(unit)` returns (the host store's own fp32 master)
unit by unit from `model.safetensors` or the shards `model.safetensors.index.json` maps. Each shard is opened
for one unit and closed again, and each tensor is read when its unit's turn comes: fp32 tensors straight into
the tile (no temporary), others (bf16, fp16) through one temporary tensor that is cast into it. So the peak
host memory is the store plus about one tensor, never a second copy of the model, and a memory-mapped shard
does not stay resident after its unit is done. Everything that can be checked without reading weights is
checked first (every shard present and complete, every tensor the model needs present with its shape and a
float dtype, no tensor the model does not know), so a bad checkpoint fails before the first byte is copied.

Export: `export_hf(path, spec, tiles)` writes `config.json` (`spec.to_hf_config()` over the source directory's
config.json when there is one, so bos/eos/pad token ids and other fields the spec does not model survive), bf16
(or fp32) safetensors shards of at most `max_shard_bytes` and `model.safetensors.index.json` (a single shard is
`model.safetensors`, as `save_pretrained` writes it), one tensor converted at a time, into a temporary directory
that is renamed into place when complete. `transformers` `from_pretrained` loads the result. Weights the export
dtype cannot hold (fp16 overflows above 65504) are refused before anything is written, naming the largest; no
export ever holds an inf its own loader would refuse.

Tied embeddings: with `tie_word_embeddings`, a checkpoint's lm_head (usually absent) is the embedding; export
writes no lm_head. A destination tile may leave out the head's lm_head part (the host store keeps the tied
matrix once, as the embedding): a tile shorter than the unit's layout holds the layout's tail.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from megatrain.io.errors import CheckpointError
from megatrain.io.export_target import PROVENANCE_FILE, check_export_target
from megatrain.model.layout import UnitLayout, unit_layout
from megatrain.model.spec import EMBED, HEAD, ModelSpec, load_hf_config
from megatrain.io import safetensors_io as stio
from megatrain.units import GiB
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tensors some checkpoints carry that are not parameters (old Llama exports saved RoPE's inverse frequencies).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# Files of a HF directory that describe the tokenizer, copied by export from the data's tokenizer directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
GENERATION_FILE = "generation_config.json"  # copied from the source model directory
# Source config.json fields that the spec re-derives, or that are wrong for another dtype / layer count.
_DERIVED = ("architectures", "torch_dtype", "dtype", "rope_parameters", "rope_scaling", "rope_theta",
            "transformers_version", "_name_or_path")
# Fields with one entry per layer: kept only when the layer count is unchanged.
_PER_LAYER = ("layer_types",)

Tiles = Mapping[int, torch.Tensor] | Callable[[int], torch.Tensor]

__all__ = ["CheckpointError", "weight_files", "check_hf_dir", "load_hf_into", "load_hf_tiles", "load_hf", "export_hf",
           "hf_config_for"]


# ---- reading -------------------------------------------------------------------------------------------------
def weight_files(path: str | Path) -> dict[str, tuple[Path, stio.TensorInfo]]:
    """{full tensor name: (shard file, header info)} of a HF directory, every shard checked to be complete."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (needs a 'weight_map'): {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            _check_inside(path, shard, index)
    elif (path / SINGLE_FILE).is_file():
        weight_map, shards = None, [SINGLE_FILE]
    else:
        found = [p.name for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".safetensors")]
        hint = ("it has only PyTorch pickle weights; convert them to safetensors (e.g. load with transformers and "
                "save_pretrained(safe_serialization=True))") if found else "it holds no weights"
        raise CheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}: {hint}")
    tensors: dict[str, tuple[Path, stio.TensorInfo]] = {}
    for shard in shards:
        file = path / shard
        if not file.is_file():
            raise CheckpointError(f"{index} names shard {shard}, which is missing from {path}")
        try:
            infos, _ = stio.read_header(file)
        except stio.SafetensorsFormatError as e:
            raise CheckpointError(str(e)) from None
        for name, info in infos.items():
            if weight_map is not None and weight_map.get(name) != shard:
                continue  # the index is authoritative; a shard may carry stray extras
            tensors[name] = (file, info)
    if weight_map is not None:
        lost = [n for n, s in weight_map.items() if n not in tensors]
        if lost:
            raise CheckpointError(f"{index} maps {lost[0]!r} to {weight_map[lost[0]]}, which has no such tensor"
                                  + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""))
    return tensors


def _check_inside(root: Path, name: str, index: Path) -> None:
    """A shard named by an index must be a file of the model directory: no absolute path, no `..` out of it."""
    target = (root / name).resolve()
    if Path(name).is_absolute() or not target.is_relative_to(root.resolve()):
        raise CheckpointError(f"{index} names shard {name!r}, which is outside {root}; an index may only name files "
                              "of its own directory")


def check_hf_dir(path: str | Path, spec: ModelSpec, strict: bool = True) -> None:
    """Everything about a HF directory that needs no allocation: every shard present and complete, every tensor
    the model needs present with its shape and a float dtype (headers only; run before the host store exists)."""
    path = Path(path)
    _check(spec, path, weight_files(path), spec.units(), strict)


def _tile_offset(spec: ModelSpec, unit: int, layout: UnitLayout, tile: torch.Tensor) -> int:
    """Where `tile` starts in the unit's layout: 0 for a full tile, the lm_head size for a tied head's tail."""
    if tile.dim() != 1 or tile.dtype != torch.float32 or not tile.is_contiguous():
        raise ValueError(f"the tile of unit {unit} must be a contiguous 1-D fp32 tensor, got "
                         f"{tuple(tile.shape)} {tile.dtype}")
    offset = layout.numel - tile.numel()
    if offset == 0:
        return 0
    if unit == HEAD and spec.tie_word_embeddings and offset == layout.slice_of("lm_head.weight").numel:
        return offset
    raise ValueError(f"the tile of unit {unit} has {tile.numel()} elements; the layout has {layout.numel}")


def _source_name(spec: ModelSpec, unit: int, local: str, tensors: Mapping) -> str:
    name = spec.hf_name(unit, local)
    if name not in tensors and unit == HEAD and local == "lm_head.weight" and spec.tie_word_embeddings:
        return spec.hf_name(EMBED, "embed_tokens.weight")  # tied: HF saves only the embedding
    return name


def _check(spec: ModelSpec, path: Path, tensors: Mapping[str, tuple[Path, stio.TensorInfo]], units,
           strict: bool = True) -> None:
    """Every needed tensor present with its shape and a float dtype; no unknown tensors (when `strict`)."""
    needed = set()
    for unit in units:
        for local, shape in spec.unit_tensors(unit):
            name = _source_name(spec, unit, local, tensors)
            needed.add(name)
            if name not in tensors:
                raise CheckpointError(f"{path} has no tensor {name!r}, which {spec.name} ({spec.model_type}, "
                                      f"{spec.num_layers} layers) needs; does config.json belong to these weights?")
            file, info = tensors[name]
            if info.shape != tuple(shape):
                raise CheckpointError(f"tensor {name!r} in {file.name} has shape {info.shape}, but config.json "
                                      f"implies {tuple(shape)}; does config.json belong to these weights?")
            if info.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"tensor {name!r} in {file.name} is {info.dtype}; megatrain trains from "
                                      "float32/bfloat16/float16 weights (quantized checkpoints are not supported)")
    if strict and set(units) == set(spec.units()):
        allowed = needed | ({"lm_head.weight"} if spec.tie_word_embeddings else set())
        unknown = sorted(n for n in tensors if n not in allowed and not _IGNORED.search(n))
        if unknown:
            raise CheckpointError(
                f"{path} has tensor(s) {spec.name} does not have: {unknown[:4]}"
                + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
                + f"; config.json says {spec.model_type} with {spec.num_layers} layers, "
                  f"tie_word_embeddings={spec.tie_word_embeddings}")


@torch.no_grad()
def load_hf_into(path: str | Path, spec: ModelSpec, dest: Callable[[int], torch.Tensor],
                 units: list[int] | None = None, strict: bool = True) -> None:
    """Fill `dest(unit)` (a flat fp32 tile in `unit_layout` order) with the weights of a HF directory.

    Units are loaded in `units` order (default: all, forward order), each tensor read when its unit's turn
    comes. A tied head's tile may omit its lm_head part (see the module docstring). A caller that streams a bf16
    copy of the master must refresh it afterwards. `strict=False` ignores tensors the model does not have (the
    later layers, when `spec` keeps only the first layers of the checkpoint's model).
    """
    path = Path(path)
    units = spec.units() if units is None else list(units)
    tensors = weight_files(path)
    _check(spec, path, tensors, units, strict)
    for unit in units:
        layout = unit_layout(spec, unit)
        tile = dest(unit)
        offset = _tile_offset(spec, unit, layout, tile)
        by_file: dict[Path, list] = {}
        for s in layout.slices:
            if s.offset < offset:
                continue  # a tied head's lm_head, kept once as the embedding
            name = _source_name(spec, unit, s.name, tensors)
            file, info = tensors[name]
            by_file.setdefault(file, []).append((s, name, info))
        for file, items in by_file.items():
            _read_unit_tensors(file, items, tile, offset)
            _check_finite(file, items, tile, offset)


def _check_finite(file: Path, items, tile: torch.Tensor, offset: int) -> None:
    """Refuse NaN / inf weights, naming the tensor: training from them would only spread them."""
    for s, name, _ in items:
        if not stio.all_finite(tile[s.offset - offset:s.offset - offset + s.numel]):
            raise CheckpointError(f"tensor {name!r} in {file} holds non-finite values (NaN or inf); the checkpoint "
                                  "is damaged or came from a diverged run")


def _read_unit_tensors(file: Path, items, tile: torch.Tensor, offset: int) -> None:
    converted = [(s, name, info) for s, name, info in items if info.dtype != torch.float32]
    for s, name, info in items:
        if info.dtype == torch.float32:  # same dtype: read the bytes straight into the tile
            try:
                stio.read_into(file, info, tile[s.offset - offset:s.offset - offset + s.numel])
            except stio.SafetensorsFormatError as e:
                raise CheckpointError(str(e)) from None
    if not converted:
        return
    try:
        # Opened for this unit only: the shard's pages do not stay mapped (and resident) once the unit is done.
        with safe_open(str(file), framework="pt") as f:
            for s, name, info in converted:
                t = f.get_tensor(name)  # one temporary tensor in the checkpoint's dtype
                tile[s.offset - offset:s.offset - offset + s.numel].copy_(t.reshape(-1))
                del t
    except Exception as e:  # safetensors raises its own SafetensorError for damaged files
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"could not read {file} ({e}); the file is damaged or incomplete") from None


def load_hf_tiles(path: str | Path, spec: ModelSpec | None = None) -> dict[int, torch.Tensor]:
    """New full fp32 tiles {unit: tensor} of a HF directory (spec from its config.json by default)."""
    spec = spec or load_hf_config(path)
    tiles: dict[int, torch.Tensor] = {}

    def dest(unit: int) -> torch.Tensor:
        tiles[unit] = torch.empty(unit_layout(spec, unit).numel, dtype=torch.float32)
        return tiles[unit]

    load_hf_into(path, spec, dest)
    return tiles


def load_hf(path: str | Path) -> tuple[ModelSpec, dict[int, torch.Tensor]]:
    """(spec, tiles) of a HF directory."""
    spec = load_hf_config(path)
    return spec, load_hf_tiles(path, spec)


# ---- export --------------------------------------------------------------------------------------------------
class _UnitCache:
    """The tile of the unit being exported (a store may build a tile on request: fetch each unit once)."""

    def __init__(self, spec: ModelSpec, tiles: Tiles):
        self.spec = spec
        self.get = tiles.__getitem__ if isinstance(tiles, Mapping) else tiles
        self.unit, self.views = None, None

    def tensor(self, unit: int, local: str) -> torch.Tensor:
        if unit != self.unit:
            layout = unit_layout(self.spec, unit)
            tile = self.get(unit)
            offset = _tile_offset(self.spec, unit, layout, tile)
            self.unit = unit
            self.views = {s.name: tile[s.offset - offset:s.offset - offset + s.numel].view(s.shape)
                          for s in layout.slices if s.offset >= offset}
        return self.views[local]


def hf_config_for(spec: ModelSpec, dtype: torch.dtype, source: str | Path | None = None,
                  defaults: Mapping | None = None) -> dict:
    """The config.json of an export: the source directory's config.json (when given) with every field the spec
    defines re-derived from the spec, the export dtype, and `defaults` (e.g. token ids) for fields still absent."""
    cfg: dict = {}
    if source is not None:
        src = Path(source)
        src = src / "config.json" if src.is_dir() else src
        if src.is_file():
            try:
                cfg = json.loads(src.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{src} is not valid JSON ({e}); cannot derive the export's config.json"
                                      ) from None
    for key in _DERIVED:
        cfg.pop(key, None)
    if cfg.get("num_hidden_layers") != spec.num_layers:
        for key in _PER_LAYER:
            cfg.pop(key, None)
    cfg.update(spec.to_hf_config())
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    for key, value in (defaults or {}).items():
        if cfg.get(key) is None and value is not None:
            cfg[key] = value
    return cfg


def _copy_tokenizer(tokenizer: str | Path, dest: Path) -> None:
    """A tokenizer directory's files (TOKENIZER_FILES), or one tokenizer.json file, into `dest`."""
    tokenizer = Path(tokenizer)
    if tokenizer.is_file():
        shutil.copy2(tokenizer, dest / "tokenizer.json")
        return
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, dest / name)


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _check_range(spec: ModelSpec, names, cache: _UnitCache, dtype: torch.dtype) -> None:
    """Refuse (before anything is written) weights that `dtype` turns into inf, naming the largest one."""
    worst, worst_name, over = 0.0, "", 0
    for unit, local, _ in names:
        flat = cache.tensor(unit, local).reshape(-1)
        if not flat.numel():
            continue
        i = int(flat.abs().argmax())
        value = float(flat[i])
        if torch.isinf(flat[i].to(dtype)):
            over += 1
        if abs(value) > abs(worst):
            worst, worst_name = value, spec.hf_name(unit, local)
    if over:
        name = _DTYPE_NAMES.get(dtype, str(dtype))
        raise CheckpointError(
            f"the weights do not fit {name}: tensor {worst_name!r} holds {worst:.4g}, beyond {name}'s largest finite "
            f"value {torch.finfo(dtype).max:.0f} ({over} tensor(s) do); nothing was written. Export with --dtype bf16 "
            "(fp32's range) or fp32")


def _converted(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in the export dtype; a value that overflows it (bf16 near fp32's largest) is refused, never written as
    inf (the export would not load)."""
    out = t.to(dtype)
    if not stio.all_finite(out):
        raise CheckpointError(f"tensor {name!r} holds values {dtype} cannot hold (they would be written as inf); "
                              "export with --dtype fp32")
    return out


def export_hf(path: str | Path, spec: ModelSpec, tiles: Tiles, dtype: torch.dtype = torch.bfloat16,
              max_shard_bytes: int = 5 * GiB, overwrite: bool = False,
              copy_tokenizer_from: str | Path | None = None, *, source: str | Path | None = None,
              tokenizer: str | Path | None = None, config_defaults: Mapping | None = None,
              provenance: Mapping | None = None) -> Path:
    """Write a HF model directory (config.json + safetensors shards + index) from per-unit fp32 tiles.

    tiles: {unit: flat fp32 tile} or fn(unit) -> tile (called once per unit, in forward order).
    source: the HF directory the weights came from: config.json is derived from its config.json (`hf_config_for`)
    and its generation_config.json is copied. tokenizer: the tokenizer the data was tokenized with (a directory,
    whose tokenizer files are copied, or a tokenizer.json); None ships no tokenizer. copy_tokenizer_from: a HF
    directory that is both (the shorthand of earlier versions). config_defaults: config.json fields set when
    neither the source nor the spec has them (bos/eos token ids). provenance: written as megatrain_export.json.
    """
    if copy_tokenizer_from is not None:
        source = source if source is not None else copy_tokenizer_from
        tokenizer = tokenizer if tokenizer is not None else copy_tokenizer_from
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"export dtype {dtype} is not one of {FLOAT_DTYPES}")
    path = Path(path)
    check_export_target(path, overwrite)  # only an earlier export is ever replaced (io/export_target.py)
    # Tensor order: forward order of units; a tied head writes no lm_head.
    names: list[tuple[int, str, tuple[int, ...]]] = []
    for unit in spec.units():
        for local, shape in spec.unit_tensors(unit):
            if unit == HEAD and local == "lm_head.weight" and spec.tie_word_embeddings:
                continue
            names.append((unit, local, tuple(shape)))
    cache = _UnitCache(spec, tiles)
    if torch.finfo(dtype).max < torch.finfo(torch.float32).max:  # fp16: check every value before writing
        _check_range(spec, names, cache, dtype)
    entries = [stio.Entry(spec.hf_name(u, local), shape, dtype,
                          (lambda u=u, local=local: _converted(spec.hf_name(u, local), cache.tensor(u, local), dtype)))
               for u, local, shape in names]
    shards: list[list[stio.Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for file, shard in zip(files, shards):
            stio.write_safetensors(tmp / file, shard)
        if n > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                     "weight_map": {e.name: file for file, shard in zip(files, shards) for e in shard}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        cfg = hf_config_for(spec, dtype, source, config_defaults)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if source is not None and Path(source).is_dir() and (Path(source) / GENERATION_FILE).is_file():
            shutil.copy2(Path(source) / GENERATION_FILE, tmp / GENERATION_FILE)
        if tokenizer is not None:
            _copy_tokenizer(tokenizer, tmp)
        # every export says it is one (what it was made from, when known): `overwrite=True` replaces only such a
        # directory, never one a user made (io/export_target.py)
        made_from = dict(provenance) if provenance is not None else {"written_by": "megatrain export_hf"}
        (tmp / PROVENANCE_FILE).write_text(json.dumps(made_from, indent=1) + "\n")
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"export to {path} failed: {e}; nothing was written there") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
