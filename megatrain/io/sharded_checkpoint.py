"""Sharded checkpoints: each rank writes its slices, rank 0 a manifest; any number of ranks reads them back.

A checkpoint directory holds

    rank<r>.safetensors   rank r's slices: "master/<unit>", "adam_m/<unit>", "adam_v/<unit>" (fp32, s elements each,
                          the last rank's padded with zeros)
    manifest.json         world, each unit's elements and slice length, AdamW step counts, the trainer's step, the
                          SHA-256 of every rank file

A one-process store (world 1) writes the same format with one file of whole tiles, so a checkpoint of N ranks resumes
on M ranks for any N, M: each rank reads, per unit and kind, only the bytes of its own element range, from the
files whose slices overlap it. Written into a temporary directory that rank 0 renames once every rank's file and
the manifest are complete. Given the run's trainer state, rank 0 also writes `trainer_state.json` (the ordinary
checkpoint's state file, listing the rank files with their SHA-256), so `megatrain train`'s checkpoint listing,
verification and `--resume` treat both formats alike.

`load_store` is the one place that decides how a checkpoint fills a store: an ordinary one-process checkpoint
(`training/checkpoint.py`, whole tiles per kind) or a sharded one, into a one-process store or a rank's slices.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatrain.compile.resolve import check_model_shards
from megatrain.exec.store import HostStore
from megatrain.ir.dag import ScheduleError
from megatrain.io import safetensors_io as stio
from megatrain.io.checkpoint import (
    FORMAT as STATE_FORMAT,
)
from megatrain.io.checkpoint import STATE_FILE, VERSION, _state_text, key_unit, load_checkpoint, read_state, unit_key
from megatrain.io.errors import CheckpointError
from megatrain.parallel.world import World

MANIFEST = "manifest.json"
FORMAT = "megatrain-sharded-checkpoint"
KINDS = {"master": HostStore.master, "adam_m": HostStore.exp_avg, "adam_v": HostStore.exp_avg_sq}


def _span(store: HostStore, world: World, unit: int) -> tuple[int, int]:
    """(first element, elements of real parameters) of this rank's tile of `unit` (a whole tile at world 1)."""
    if hasattr(store, "shard"):
        return store.shard(unit)
    return 0, store.master(unit).numel()


def _barrier(world: World) -> None:
    if world.distributed:
        dist.barrier(group=world.host_group)


def save_sharded(path: str | Path, store: HostStore, world: World, trainer_step: int,
                 state: dict | None = None) -> Path:
    """Write this rank's slices (every rank calls it, after `flush()`); returns the checkpoint directory.
    `state`: the run's trainer state (rank 0's is written, as `trainer_state.json`); None writes no state file."""
    path = Path(path)
    try:
        check_model_shards(store.spec)  # the resolver decides which models the ranks can slice
    except ScheduleError as e:
        raise CheckpointError(f"sharded checkpoints do not hold tied embeddings (data parallel refuses them): {e}") \
            from None
    tmp = path.with_name(f".tmp-{path.name}")
    if world.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world)
    entries = [stio.Entry(f"{kind}/{unit_key(u)}", (get(store, u).numel(),), torch.float32,
                          lambda get=get, u=u: get(store, u))
               for kind, get in KINDS.items() for u in store.units]
    digest = hashlib.sha256()
    name = f"rank{world.rank}.safetensors"
    stio.write_safetensors(tmp / name, entries, {"rank": str(world.rank), "world": str(world.size)}, digest=digest)
    files = [None] * world.size
    if world.distributed:
        dist.all_gather_object(files, (name, digest.hexdigest()), group=world.host_group)
    else:
        files = [(name, digest.hexdigest())]
    if world.rank == 0:
        manifest = {"format": FORMAT, "version": 1, "world": world.size, "trainer_step": trainer_step,
                    "units": [unit_key(u) for u in store.units],
                    "numel": {unit_key(u): store.layouts[u].numel for u in store.units},
                    "slice": {unit_key(u): store.master(u).numel() for u in store.units},
                    "steps": {unit_key(u): n for u, n in store.steps.items()}, "files": dict(files)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if state is not None:  # last: a directory with a state file is a complete checkpoint
            (tmp / STATE_FILE).write_text(_state_text({
                "format": STATE_FORMAT, "version": VERSION, "step": trainer_step, "units": list(store.units),
                "files": dict(files), "layout": "sharded", "state": state}))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    _barrier(world)
    return path


def is_sharded(path: str | Path) -> bool:
    """Whether checkpoint `path` is in the sharded format (else the one-process format)."""
    return (Path(path) / MANIFEST).is_file()


def load_store(path: str | Path, store: HostStore, world: World) -> int:
    """Fill `store` (a one-process store or this rank's slices) from checkpoint `path` of either format; returns
    the trainer step it was saved at. Every rank reads only the bytes of its own slices."""
    if not is_sharded(path) and not hasattr(store, "shard"):  # one process, one-process format: unchanged
        kinds = {"master": store.master, "adam_m": store.exp_avg, "adam_v": store.exp_avg_sq}
        loaded = load_checkpoint(path, dest=lambda kind, u: kinds[kind](u), verify=False)
        for u in store.units:
            store.refresh_stream(u)
        store.steps = {key_unit(k): int(n) for k, n in loaded.state["optimizer_steps"].items()}
        return loaded.step
    return load_sharded(path, store, world)


def _sources(path: Path) -> dict:
    """Where the slices of checkpoint `path` are: {world, numel, slice (per unit key), steps, step, file(kind, key,
    r) -> (file, tensor name)}. A one-process checkpoint is a sharded one of world 1 with other file names."""
    if is_sharded(path):
        try:
            m = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not a sharded megatrain checkpoint ({e})") from None
        if m.get("format") != FORMAT:
            raise CheckpointError(f"{path / MANIFEST}: format {m.get('format')!r}, expected {FORMAT!r}")
        return {**m, "step": m["trainer_step"],
                "file": lambda kind, key, r: (path / f"rank{r}.safetensors", f"{kind}/{key}")}
    meta = read_state(path)
    infos = stio.read_header(path / "master.safetensors")[0]
    numel = {key: int(info.shape[0]) for key, info in infos.items()}
    return {"world": 1, "numel": numel, "slice": numel, "steps": meta["state"]["optimizer_steps"],
            "step": meta["step"], "file": lambda kind, key, r: (path / f"{kind}.safetensors", key)}


class _Reader:
    """Reads element ranges of a unit's flat tile from the files of a checkpoint (`_sources`), each file's header
    read once."""

    def __init__(self, path: Path, sources: dict):
        self.path, self.src, self.headers = path, sources, {}

    def __call__(self, kind: str, key: str, lo: int, dest: torch.Tensor) -> None:
        """Fill `dest` (1-D fp32) with elements [lo, lo + len(dest)) of `kind`'s tile of unit `key`."""
        hi, s_old = lo + dest.numel(), self.src["slice"][key]
        for r in range(self.src["world"]):  # the saved slices that overlap [lo, hi)
            a, b = max(lo, r * s_old), min(hi, (r + 1) * s_old)
            if a >= b:
                continue
            file, name = self.src["file"](kind, key, r)
            if file not in self.headers:
                self.headers[file] = stio.read_header(file)[0]
            info = self.headers[file][name]
            if info.dtype != torch.float32:
                raise CheckpointError(f"{file}: {name!r} is {info.dtype}; only fp32 tiles are read by slice")
            begin = info.begin + (a - r * s_old) * 4
            part = stio.TensorInfo(info.name, torch.float32, (b - a,), begin, begin + (b - a) * 4)
            stio.read_into(file, part, dest[a - lo:b - lo])
        if not stio.all_finite(dest):
            raise CheckpointError(f"{self.path}: {kind} {key!r} holds non-finite values (NaN or inf); the run had "
                                  "diverged when it was saved, or a file is damaged. Resume from an earlier one")


def tile_reader(path: str | Path, kind: str = "master"):
    """fn(unit) -> the unit's whole flat fp32 tile of `kind`, read from a checkpoint of either format (the
    slices of every rank put together; one unit in memory at a time): what an HF export of a checkpoint reads."""
    path = Path(path)
    src = _sources(path)
    read = _Reader(path, src)

    def tile(unit: int) -> torch.Tensor:
        key = unit_key(unit)
        if key not in src["numel"]:
            raise CheckpointError(f"checkpoint {path} has no tile {key!r}")
        out = torch.empty(src["numel"][key])
        read(kind, key, 0, out)
        return out

    return tile


def load_sharded(path: str | Path, store: HostStore, world: World) -> int:
    """Fill this rank's tiles (master, moments, step counts) from a checkpoint written by any number of ranks;
    returns the trainer step it was saved at. Reads only the bytes of this rank's slices."""
    path = Path(path)
    manifest = _sources(path)
    want = {unit_key(u): store.layouts[u].numel for u in store.units}
    if manifest["numel"] != want:
        raise CheckpointError(f"{path}: the checkpoint's units ({manifest['numel']}) are not this model's ({want}); "
                              "resume with the same model config")
    read = _Reader(path, manifest)
    for u in store.units:
        key = unit_key(u)
        lo, valid = _span(store, world, u)
        for kind, get in KINDS.items():
            dest = get(store, u)
            dest.zero_()  # padding stays zero
            read(kind, key, lo, dest[:valid])
        store.refresh_stream(u)
    store.steps = {key_unit(k): int(n) for k, n in manifest["steps"].items()}
    return int(manifest["step"])
