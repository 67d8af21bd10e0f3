"""Sharded checkpoints: each rank writes its slices, rank 0 a manifest; any number of ranks reads them back.

A checkpoint directory holds

    rank<r>.safetensors   rank r's slices: "master/<unit>", "adam_m/<unit>", "adam_v/<unit>" (fp32, s elements each,
                          the last rank's padded with zeros)
    manifest.json         world, each unit's elements and slice length, AdamW step counts, the trainer's step, the
                          SHA-256 of every rank file, and a checksum of its own content

A one-process store (world 1) writes the same format with one file of whole tiles, so a checkpoint of N ranks resumes
on M ranks for any N, M: each rank reads, per unit and kind, only the bytes of its own element range, from the
files whose slices overlap it. Written into a temporary directory that rank 0 renames once every rank's file (read
back and checked against its SHA-256 by its rank) and the manifest are complete; a failure on any rank is known to
every rank (no rank waits for one that gave up) and leaves the earlier checkpoints as they were. Given the run's
trainer state, rank 0 also writes `trainer_state.json` (the ordinary checkpoint's state file, listing the rank files
and the manifest with their SHA-256), so `megatrain train`'s checkpoint listing, verification and `--resume` treat
both formats alike.

Nothing of a checkpoint is used before it is verified (`verify_sharded`: every checksum, the manifest's step against
the state file's, each slice length against its rank file): an edited manifest or slice is a CheckpointError naming
the file and the newest complete checkpoint, never weights read at the wrong offsets or a resume at the wrong step.

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
from megatrain.io.checkpoint_format import FORMAT as STATE_FORMAT
from megatrain.io.checkpoint import explain_os_error, fsync_dir, load_checkpoint, write_durable
from megatrain.io.checkpoint_format import MANIFEST, STATE_FILE, VERSION, remember_verified, check_files, check_own_checksum, checksummed_text, key_unit, read_state, resume_hint, unit_key, verify_checkpoint, was_verified
from megatrain.io.errors import CheckpointError
from megatrain.parallel.world import World

FORMAT = "megatrain-sharded-checkpoint"
MANIFEST_VERSION = 2  # 2: a checksum of its own content (1, without, is read when a state file vouches for it)
KINDS = {"master": HostStore.master, "adam_m": HostStore.exp_avg, "adam_v": HostStore.exp_avg_sq}


def _span(store: HostStore, world: World, unit: int) -> tuple[int, int]:
    """(first element, elements of real parameters) of this rank's tile of `unit` (a whole tile at world 1)."""
    if hasattr(store, "shard"):
        return store.shard(unit)
    return 0, store.master(unit).numel()


def _agree(world: World, value, path: Path) -> list:
    """Every rank's `value` ((name, sha256) or an error line), on every rank; if any rank reported an error, every
    rank raises the same CheckpointError (and rank 0 removes the temporary directory `path`)."""
    values = [value]
    if world.distributed:
        values = [None] * world.size
        dist.all_gather_object(values, value, group=world.host_group)
    errors = [(r, v) for r, v in enumerate(values) if isinstance(v, str)]
    if errors:
        if world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        r, error = errors[0]
        raise CheckpointError(f"rank {r}: {error}" if world.distributed else error)
    return values


def save_sharded(path: str | Path, store: HostStore, world: World, trainer_step: int,
                 state: dict | None = None) -> Path:
    """Write this rank's slices (every rank calls it, after `flush()`); returns the checkpoint directory.
    `state`: the run's trainer state (rank 0's is written, as `trainer_state.json`); None writes no state file.
    A failure on any rank (a full or read-only disk, a file that does not read back as written) is a
    CheckpointError on every rank; nothing is published then, and an earlier checkpoint of the same step stays."""
    path = Path(path)
    try:
        check_model_shards(store.spec)  # the resolver decides which models the ranks can slice
    except ScheduleError as e:
        raise CheckpointError(f"sharded checkpoints do not hold tied embeddings (data parallel refuses them): {e}") \
            from None
    tmp = path.with_name(f".tmp-{path.name}")
    ready = None
    if world.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            ready = explain_os_error(e, tmp, "creating")
    _agree(world, ready, tmp)
    entries = [stio.Entry(f"{kind}/{unit_key(u)}", (get(store, u).numel(),), torch.float32,
                          lambda get=get, u=u: get(store, u))
               for kind, get in KINDS.items() for u in store.units]
    name = f"rank{world.rank}.safetensors"
    try:
        digest = hashlib.sha256()
        stio.write_safetensors(tmp / name, entries, {"rank": str(world.rank), "world": str(world.size)},
                               digest=digest)
        check_files(tmp, {name: digest.hexdigest()}, "what was written")  # read back before it counts
        mine = (name, digest.hexdigest())
    except OSError as e:
        mine = explain_os_error(e, tmp / name, "writing")
    except CheckpointError as e:
        mine = f"it did not read back as written ({e})"
    files = _agree(world, mine, tmp)
    published = None
    if world.rank == 0:
        try:
            published = _publish(path, tmp, store, world, trainer_step, state, dict(files))
        except OSError as e:
            published = explain_os_error(e, tmp, "writing")
        except CheckpointError as e:
            published = f"it did not read back as written ({e})"
    _agree(world, published, tmp)
    return path


def _publish(path: Path, tmp: Path, store: HostStore, world: World, trainer_step: int, state: dict | None,
             files: dict[str, str]) -> None:
    """Rank 0, once every rank file is written and checked: the manifest, the state file, then the rename."""
    manifest = {"format": FORMAT, "version": MANIFEST_VERSION, "world": world.size, "trainer_step": trainer_step,
                "units": [unit_key(u) for u in store.units],
                "numel": {unit_key(u): store.layouts[u].numel for u in store.units},
                "slice": {unit_key(u): store.master(u).numel() for u in store.units},
                "steps": {unit_key(u): n for u, n in store.steps.items()}, "files": files}
    text = checksummed_text(manifest)
    write_durable(tmp / MANIFEST, text)
    listed = {**files, MANIFEST: hashlib.sha256(text.encode()).hexdigest()}
    check_files(tmp, {MANIFEST: listed[MANIFEST]}, "what was written")
    if state is not None:  # last: a directory with a state file is a complete checkpoint
        write_durable(tmp / STATE_FILE, checksummed_text({
            "format": STATE_FORMAT, "version": VERSION, "step": trainer_step, "units": list(store.units),
            "files": listed, "layout": "sharded", "state": state}))
        read_state(tmp)  # the state file read back (the rank files and the manifest were checked already)
    fsync_dir(tmp)
    old = None
    if path.exists():  # re-saving a step: move the old one aside, then swap (it stays if the swap fails)
        old = path.with_name(f".tmp-old-{path.name}-{os.getpid()}")
        path.rename(old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    remember_verified(path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_sharded(path: str | Path) -> bool:
    """Whether checkpoint `path` is in the sharded format (else the one-process format)."""
    return (Path(path) / MANIFEST).is_file()


def load_store(path: str | Path, store: HostStore, world: World) -> int:
    """Fill `store` (a one-process store or this rank's slices) from checkpoint `path` of either format, verified
    first (free when this process verified it already); returns the trainer step it was saved at. Every rank reads
    only the bytes of its own slices."""
    if not is_sharded(path) and not hasattr(store, "shard"):  # one process, one-process format: unchanged
        kinds = {"master": store.master, "adam_m": store.exp_avg, "adam_v": store.exp_avg_sq}
        loaded = load_checkpoint(path, dest=lambda kind, u: kinds[kind](u), verify=True)
        for u in store.units:
            store.refresh_stream(u)
        store.steps = {key_unit(k): int(n) for k, n in loaded.state["optimizer_steps"].items()}
        return loaded.step
    return load_sharded(path, store, world)


def verify_sharded(path: str | Path) -> dict:
    """The manifest of sharded checkpoint `path`, after verifying everything: the state file and every file it
    lists (when there is a state file), the manifest's own checksum, its step against the state's, the rank files
    against the manifest's checksums, and each slice length against its rank file. CheckpointError naming the file
    and the newest complete checkpoint."""
    path = Path(path)
    try:
        return _verify_sharded(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {resume_hint(path)}") from None


def _verify_sharded(path: Path) -> dict:
    meta = verify_checkpoint(path) if (path / STATE_FILE).is_file() else None
    file = path / MANIFEST
    try:
        m = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a sharded megatrain checkpoint ({file.name}: {e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") not in (1, MANIFEST_VERSION):
        got = (m.get("format"), m.get("version")) if isinstance(m, dict) else (type(m).__name__, None)
        raise CheckpointError(f"{file}: format {got[0]!r} version {got[1]!r}, expected {FORMAT!r}")
    if m["version"] >= 2:
        m = check_own_checksum(m, file)
    elif meta is None:  # version 1 alone: nothing vouches for it
        raise CheckpointError(f"{file} carries no checksum and there is no {STATE_FILE}: it cannot be verified")
    try:
        world, step, files = int(m["world"]), int(m["trainer_step"]), m["files"]
        slices, numel, units = m["slice"], m["numel"], m["units"]
        if not isinstance(files, dict) or not isinstance(slices, dict) or not isinstance(numel, dict):
            raise TypeError("'files', 'slice' and 'numel' must be objects")
        if sorted(files) != sorted(f"rank{r}.safetensors" for r in range(world)):
            raise ValueError(f"'files' {sorted(files)} are not the files of {world} rank(s)")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file} is damaged ({type(e).__name__}: {e})") from None
    if meta is not None and step != meta["step"]:
        raise CheckpointError(f"{file} says step {step}, {STATE_FILE} says {meta['step']}: one was edited")
    if not was_verified(path):
        check_files(path, files, MANIFEST)
        remember_verified(path)
    for r in range(world):  # each slice as long as the manifest says: else reads would land at wrong offsets
        rank_file = path / f"rank{r}.safetensors"
        try:  # headers only: cheap, and a version-1 manifest has no checksum
            infos = stio.read_header(rank_file)[0]
        except (OSError, stio.SafetensorsFormatError) as e:
            raise CheckpointError(f"checkpoint {path} is damaged: {e}") from None
        for key in units:
            for kind in KINDS:
                info = infos.get(f"{kind}/{key}")
                if info is None or info.shape != (int(slices.get(key, -1)),):
                    raise CheckpointError(f"{rank_file}: {kind}/{key} is {info.shape if info else 'missing'}, "
                                          f"{file.name} says slices of {slices.get(key)}; one was edited")
    return m


def _sources(path: Path) -> dict:
    """Where the slices of checkpoint `path` are, verified first: {world, numel, slice (per unit key), steps, step,
    file(kind, key, r) -> (file, tensor name)}. A one-process checkpoint is a sharded one of world 1 with other
    file names."""
    if is_sharded(path):
        m = verify_sharded(path)
        return {**m, "step": m["trainer_step"],
                "file": lambda kind, key, r: (path / f"rank{r}.safetensors", f"{kind}/{key}")}
    meta = verify_checkpoint(path)
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
