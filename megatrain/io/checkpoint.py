"""Training checkpoints: fp32 master weights, AdamW moments and trainer state, written atomically.

A checkpoint is a directory `step_00000100/` under the run's `checkpoints/`:

    master.safetensors     {unit key: flat fp32 tile}   unit keys: "embed", "layers.0", ..., "head"
    adam_m.safetensors     the same units, AdamW first moments
    adam_v.safetensors     second moments
    trainer_state.json     step, unit list, SHA-256 of every tensor file, RNG states, data cursor, config, whatever
                           else the trainer passes; its own "checksum" is the SHA-256 of the rest of it

Atomic: everything is written into a hidden `.tmp-step_...` directory, each file fsynced, then the directory is
renamed to its final name (one atomic rename on POSIX file systems) and the parent fsynced. A kill or a full disk
at any moment before the rename leaves the previous checkpoints exactly as they were; a leftover temporary
directory is ignored by `latest()` and removed by the next save. After a successful save only the newest
`keep_last` checkpoints are kept.

Checksums: each file's SHA-256 is computed as it is written and stored in the state file (a sharded checkpoint's
manifest.json among them), which carries a checksum of its own content (the unit list included). Before a new
checkpoint is published it is read back and checked against them; `verify_checkpoint` checks them before anything
of a checkpoint is used, and `load` refuses non-finite values, naming the tensor: flipped bytes, a truncated or
edited file, a shortened unit list are a CheckpointError naming the file and the newest complete checkpoint to
resume from, never a silent start from damaged weights. A checkpoint verified once by this process is not read
again while its files are unchanged (size, mtime, inode). (Version-1 checkpoints, written before checksums, load
without them; version 2 did not yet list a sharded checkpoint's manifest.)

Nothing the user owns is deleted because it failed verification: `resolve("latest")` skips a damaged newer
checkpoint (saying so) and leaves it in place; a `step_*` directory without a state file is left alone.

Retention: only after the new checkpoint is published and verified are the checkpoints beyond `keep_last` deleted;
a save that failed (read-only or full file system) deletes nothing. Pruning renames a doomed checkpoint to a hidden
temporary name before deleting it, so a kill mid-delete leaves nothing `latest()` could take for a checkpoint;
such hidden leftovers are removed by the next save. A checkpoint that cannot be deleted is kept, with a warning.

Tiles are written straight from the buffers they live in (no second copy of the store in memory) and read back
straight into the destination buffers (`load(..., dest=store_tile)`), so saving and resuming a model that
fills host memory needs no extra host memory.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.io.checkpoint_format import (  # the on-disk format and its checks
    check_complete,
    check_files,
    checksummed_text,
    FORMAT,
    key_unit,
    KINDS,
    listed_checkpoints,
    newest_complete,
    read_state,
    remember_verified,
    STATE_FILE,
    step_dir_name,
    unit_key,
    verify_checkpoint,
    VERSION,
)
from megatrain.io.errors import CheckpointError
from megatrain.io import safetensors_io as stio
from megatrain.io.rng import (  # re-exported: a checkpoint's trainer state holds them
    rng_state,
    set_rng_state,
)
from megatrain.units import GiB

_TMP_PREFIX = ".tmp-"

__all__ = ["CheckpointManager", "LoadedCheckpoint", "load_checkpoint", "rng_state", "set_rng_state", "check_writable",
           "explain_os_error"]


# ---- writability -----------------------------------------------------------------------------------------------
def explain_os_error(e: OSError, path: Path, what: str) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full while {what} {path}"
    if e.errno == errno.EROFS:
        return f"the file system is read-only while {what} {path}"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write {path} while {what} it ({e.strerror})"
    return f"could not write {path} while {what} it ({e})"


def check_writable(directory: str | Path) -> Path:
    """Create `directory` if needed and prove a file can be written, fsynced and removed in it.

    Call it before training starts, so that a run does not find out at its first checkpoint, hours in.
    """
    directory = Path(directory)
    probe = directory / f"{_TMP_PREFIX}probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"megatrain")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        why = explain_os_error(e, directory, "probing")
        raise CheckpointError(f"checkpoint directory {directory} is not writable: {why}; choose another run.out_dir "
                              "or fix its permissions") from None
    return directory


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, text: str) -> None:
    """Write a small text file of a checkpoint (state, manifest) and fsync it."""
    with open(path, "w") as f:
        stio._write(f, text)
        f.flush()
        os.fsync(f.fileno())


# ---- save / load -----------------------------------------------------------------------------------------------
@dataclass
class LoadedCheckpoint:
    """What `load` returns: the step, the trainer state, and the tensors (None when loaded into `dest`)."""

    path: Path
    step: int
    state: dict
    tensors: dict[str, dict[int, torch.Tensor]] | None


TileSource = Mapping[int, torch.Tensor] | Callable[[int], torch.Tensor]


class CheckpointManager:
    """Saves, lists, loads and prunes the checkpoints in one directory."""

    def __init__(self, directory: str | Path, keep_last: int = 3, log: Callable[[str], None] | None = None):
        if keep_last < 0:
            raise ValueError(f"keep_last={keep_last} must be >= 0 (0 keeps all)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.log = log  # notes and warnings (a damaged checkpoint skipped, one that could not be pruned); else stderr

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(line)
        else:
            print(line, file=sys.stderr)

    # -- listing --
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first: [(step, path)]."""
        return listed_checkpoints(self.directory)

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1][1] if ckpts else None

    def resolve(self, resume: str) -> Path:
        """The verified checkpoint a `run.resume` value names: "latest" (the newest of this directory that passes
        verification; a damaged newer one is skipped with a note and left in place) or a checkpoint path (refused
        when damaged, naming the newest complete one)."""
        if resume == "latest":
            ckpts = self.checkpoints()
            if not ckpts:
                raise CheckpointError(f"run.resume='latest' but {self.directory} holds no complete checkpoint; "
                                      "start without resume, or give a checkpoint directory")
            failures = []
            for _, path in reversed(ckpts):
                try:
                    check_complete(path)
                except CheckpointError as e:
                    failures.append(str(e))
                    continue
                if failures:
                    self._say(f"note: run.resume='latest': {len(failures)} newer checkpoint(s) fail verification and "
                              f"are left as they are (newest: {failures[0]}); resuming from the newest verified "
                              f"one, {path}")
                return path
            raise CheckpointError(f"run.resume='latest' but no checkpoint in {self.directory} passes verification "
                                  f"(the newest: {failures[0]}); they are left as they are: restore a good copy, or "
                                  "start without resume")
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(f"run.resume={resume!r} is not a checkpoint directory (no {STATE_FILE} in it)")
        verify_checkpoint(path)
        return path

    # -- save --
    def save(self, step: int, tiles: Mapping[str, TileSource], state: dict, units: list[int] | None = None) -> Path:
        """Write checkpoint `step` atomically and prune old ones; returns its directory.

        tiles: {kind: {unit: flat tile}} (or {kind: fn(unit) -> flat tile}) for each of KINDS. Tiles are written
        from their own memory. state: JSON-serializable trainer state (step, RNG states, data cursor, config...).
        On any failure the partial checkpoint is removed, every earlier checkpoint is left intact, and a
        CheckpointError says what happened.
        """
        missing = [k for k in KINDS if k not in tiles]
        if missing:
            raise ValueError(f"save() needs tiles for {list(KINDS)}; missing {missing}")
        getters = {k: (src.__getitem__ if isinstance(src, Mapping) else src) for k, src in tiles.items()}
        if units is None:
            src = tiles["master"]
            if not isinstance(src, Mapping):
                raise ValueError("pass units= when tiles are given as functions")
            units = list(src)
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise ValueError(f"trainer state is not JSON-serializable: {e}") from None

        final = self.directory / step_dir_name(step)
        tmp = self.directory / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
        try:
            check_writable(self.directory)
        except CheckpointError as e:
            raise self._not_saved(step, str(e)) from None
        self._remove_stale_tmp()
        needed = sum(getters[k](u).numel() * getters[k](u).element_size() for k in KINDS for u in units)
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            raise CheckpointError(
                f"checkpoint step {step} needs {needed / GiB:.2f} GiB but {self.directory} has only "
                f"{free / GiB:.2f} GiB free; nothing was written and the earlier checkpoints are intact. Free "
                "space, lower run.keep_last, or point run.out_dir at a larger disk"
            )
        what = "writing"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            files = {}
            for kind in KINDS:
                get = getters[kind]
                entries = [stio.Entry(unit_key(u), (get(u).numel(),), get(u).dtype,
                                      (lambda g=get, u=u: g(u).reshape(-1))) for u in units]
                digest = hashlib.sha256()
                stio.write_safetensors(tmp / f"{kind}.safetensors", entries, {"kind": kind, "step": str(step)},
                                       digest=digest)
                files[f"{kind}.safetensors"] = digest.hexdigest()
            state_text = checksummed_text({"format": FORMAT, "version": VERSION, "step": step, "units": units,
                                           "files": files, "state": state})
            # The state file is written last: a directory with it is complete.
            write_durable(tmp / STATE_FILE, state_text)
            fsync_dir(tmp)
            what = "verifying"
            # Read back before it may count as a checkpoint (and before retention may delete an older one).
            read_state(tmp)
            check_files(tmp, files, STATE_FILE)
            what = "publishing"
            old = None
            if final.exists():  # re-saving a step: move the old one aside, then swap
                old = self.directory / f"{_TMP_PREFIX}old-{final.name}-{os.getpid()}"
                final.rename(old)
            tmp.rename(final)
            fsync_dir(self.directory)
            remember_verified(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except (OSError, CheckpointError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._not_saved(step, explain_os_error(e, tmp, what) if isinstance(e, OSError)
                                  else f"it did not read back as written ({e})") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:  # retention: only now that the new checkpoint is published and verified
            self.prune()
        except CheckpointError as e:
            self._say(f"warning: {e}")
        return final

    def _not_saved(self, step: int, why: str) -> CheckpointError:
        prev = newest_complete(self.directory)
        kept = f"The newest complete checkpoint {prev} is intact" if prev else "No earlier checkpoint exists"
        return CheckpointError(f"checkpoint step {step} was not saved: {why}. Nothing was deleted. {kept}")

    def step_path(self, step: int) -> Path:
        """The directory checkpoint `step` is published as."""
        return self.directory / step_dir_name(step)

    def prune(self, keep_last: int | None = None) -> list[Path]:
        """Delete all but the newest `keep_last` (default: the manager's; 0 keeps all) checkpoints; returns what
        was deleted. Each is first renamed to a hidden name, so a kill mid-delete leaves no half checkpoint. Call
        it only after a new checkpoint was saved and verified (`save` does). One that cannot be deleted is kept:
        CheckpointError naming it, after the others were dealt with."""
        keep = self.keep_last if keep_last is None else keep_last
        if keep == 0:
            return []
        deleted, failed = [], []
        for _, p in self.checkpoints()[:-keep]:
            gone = self.directory / f"{_TMP_PREFIX}deleting-{p.name}"
            try:
                p.rename(gone)
            except OSError as e:
                failed.append(f"{p} ({e.strerror or e})")
                continue
            shutil.rmtree(gone, ignore_errors=True)
            deleted.append(p)
        if failed:
            raise CheckpointError(f"could not delete old checkpoint(s) {', '.join(failed)}: kept (more than "
                                  f"run.keep_last={keep} until they can be deleted)")
        return deleted

    def _remove_stale_tmp(self) -> None:
        """Leftovers of killed saves and prunes: hidden temporaries only. A `step_*` directory without a state
        file is not one (a save publishes complete directories only): it is the user's and stays."""
        for p in self.directory.glob(f"{_TMP_PREFIX}*"):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    # -- load --
    def load(self, path: str | Path | None = None, dest: Callable[[str, int], torch.Tensor] | None = None,
             verify: bool = True) -> LoadedCheckpoint:
        """Read a checkpoint (default: the latest).

        With `dest(kind, unit) -> tensor`, each tile is read straight into the tensor dest returns (e.g. the
        host store's own tiles; sizes must match) and `tensors` is None; otherwise new tensors are returned.
        """
        path = Path(path) if path is not None else self.latest()
        if path is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        return load_checkpoint(path, dest, verify)


def load_checkpoint(path: str | Path, dest: Callable[[str, int], torch.Tensor] | None = None,
                    verify: bool = True) -> LoadedCheckpoint:
    """Read one checkpoint directory (see `CheckpointManager.load`); `verify=False` skips the checksums (a
    caller that ran `verify_checkpoint` already; verifying again costs nothing while the files are unchanged).
    Non-finite values are refused, naming the tensor."""
    path = Path(path)
    meta = verify_checkpoint(path) if verify else read_state(path)
    units = meta["units"]
    out: dict[str, dict[int, torch.Tensor]] = {}
    for kind in KINDS:
        file = path / f"{kind}.safetensors"
        try:
            infos, _ = stio.read_header(file)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} has no {file.name}") from None
        except stio.SafetensorsFormatError as e:
            raise CheckpointError(str(e)) from None
        out[kind] = {}
        for u in units:
            info = infos.get(unit_key(u))
            if info is None:
                raise CheckpointError(f"{file} has no tensor {unit_key(u)!r}")
            target = dest(kind, u) if dest is not None else torch.empty(info.shape, dtype=info.dtype)
            if not target.is_contiguous() or target.device.type != "cpu":
                raise CheckpointError(f"the destination of {kind} {unit_key(u)!r} must be a contiguous CPU tensor")
            if target.numel() * target.element_size() != info.end - info.begin or target.dtype != info.dtype:
                raise CheckpointError(
                    f"{file}: tile {unit_key(u)!r} is {info.shape} {info.dtype}, the destination is "
                    f"{tuple(target.shape)} {target.dtype}; was the checkpoint written for another model or "
                    "schedule? Resume with the same model config")
            try:
                stio.read_into(file, info, target)
            except stio.SafetensorsFormatError as e:
                raise CheckpointError(str(e)) from None
            if not stio.all_finite(target):
                raise CheckpointError(f"{file}: tensor {unit_key(u)!r} holds non-finite values (NaN or inf); the "
                                      "run had diverged when it was saved, or the file is damaged. Resume from an "
                                      "earlier checkpoint")
            if dest is None:
                out[kind][u] = target
    return LoadedCheckpoint(path, int(meta["step"]), meta["state"], None if dest is not None else out)
