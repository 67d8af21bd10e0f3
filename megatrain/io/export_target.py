"""Where a Hugging Face export may be written: never over, around or inside what a user owns.

An export replaces its target directory as a whole (written beside it, then renamed into place), so the target is
checked first, by `check_export_target`, the one gate of every export (`export_hf`, hence `megatrain export` and a
run's `run.export_hf`):

- an existing target is replaced only with `overwrite`, and only when it is an earlier megatrain export: a
  directory holding a readable megatrain_export.json (PROVENANCE_FILE) and nothing that marks a run or a checkpoint
  anywhere below it. Anything else (a run, a user's directory, a file) is refused, whatever `overwrite` says;
- a target inside a checkpoint directory (or a run's checkpoints/) is refused: pruning would delete it.

A run or checkpoint directory is recognised by its files (RUN_MARKERS): a checkpoint's state file or sharded
manifest, a run's lock file or metrics. A target that contains one of them equals, contains or sits above a run.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatrain.io.checkpoint_format import STATE_FILE
from megatrain.io.errors import CheckpointError

PROVENANCE_FILE = "megatrain_export.json"  # what an export was made from (the run, the checkpoint step)
RUN_LOCK_FILE = ".lock"  # every run directory holds it (train/rundir.py), from before its first check
SHARDED_MANIFEST = "manifest.json"  # a sharded checkpoint's (io/sharded_checkpoint.py MANIFEST)
CHECKPOINTS_DIR = "checkpoints"  # a run's checkpoint directories live in run_dir/checkpoints
# Files whose presence marks a directory as a run's or a checkpoint's.
RUN_MARKERS = (STATE_FILE, SHARDED_MANIFEST, RUN_LOCK_FILE, "metrics.jsonl")

__all__ = ["PROVENANCE_FILE", "RUN_MARKERS", "RUN_LOCK_FILE", "check_export_target", "find_run_marker",
           "is_export"]


def find_run_marker(root: Path) -> Path | None:
    """The first run or checkpoint marker at or below directory `root` (symlinks not followed), or None."""
    for here, dirs, files in os.walk(root):
        for name in RUN_MARKERS:
            if name in files:
                return Path(here) / name
        dirs.sort()
    return None


def is_export(path: Path) -> bool:
    """Whether `path` is a directory written by a megatrain export (its provenance file is a JSON object)."""
    try:
        return path.is_dir() and isinstance(json.loads((path / PROVENANCE_FILE).read_text()), dict)
    except (OSError, ValueError):
        return False


def _inside_checkpoint(path: Path) -> Path | None:
    """The checkpoint directory (or a run's checkpoints/) that `path` would sit inside, or None."""
    for parent in path.resolve().parents:
        if (parent / STATE_FILE).is_file() or (parent / SHARDED_MANIFEST).is_file():
            return parent
        if parent.name == CHECKPOINTS_DIR and (parent.parent / RUN_LOCK_FILE).is_file():
            return parent
    return None


def check_export_target(path: str | Path, overwrite: bool = False) -> bool:
    """Refuse (CheckpointError, one line) an export target that would replace or endanger anything but an earlier
    export (module docstring); returns whether `path` exists and will be replaced."""
    path = Path(path)
    top = _top_marker(path)
    if top is not None:
        raise CheckpointError(f"export directory {path} holds a megatrain run or checkpoint ({top}); an export never "
                              "replaces one: choose a new directory outside every run")
    holder = _inside_checkpoint(path)
    if holder is not None:
        raise CheckpointError(f"export directory {path} is inside checkpoint directory {holder}, which pruning or a resume may "
                              "delete; choose a directory outside the run's checkpoints")
    if not path.exists() and not path.is_symlink():
        return False
    if not overwrite:
        raise CheckpointError(f"export directory {path} already exists; choose a new directory, or pass --overwrite "
                              "(overwrite=True) to replace an earlier export")
    if path.is_symlink() or not is_export(path):
        raise CheckpointError(f"{path} is not a megatrain export (no {PROVENANCE_FILE}); --overwrite only replaces an "
                              "earlier export: choose a new directory")
    marker = find_run_marker(path)  # an export is small: walked whole only now
    if marker is not None:
        raise CheckpointError(f"export directory {path} holds a megatrain run or checkpoint ({marker}); an export "
                              "never replaces one: choose a new directory outside every run")
    return True


def _top_marker(path: Path) -> Path | None:
    """A run or checkpoint marker in `path` itself or one level down (a run's checkpoints/, a directory of runs):
    the cheap check that names what an existing target is, without walking a large tree."""
    if not path.is_dir() or path.is_symlink():
        return None
    candidates = [path]
    try:
        candidates += sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return None
    for directory in candidates:
        for name in RUN_MARKERS:
            if (directory / name).is_file():
                return directory / name
    return None
