"""The run directory: choosing it, locking it, and keeping one history in it.

- A fresh run never writes into an earlier run's directory: it takes the next free `name-1`, `name-2`...
- A run holds an exclusive lock (`flock` on `<run_dir>/.lock`) while it uses the directory: a second process
  (two `--resume`s of the same run) is refused at start instead of deleting the first one's temporary checkpoint
  directories. The kernel drops the lock when the process dies, so a killed run never leaves a stale lock.
- A resume from an older checkpoint starts a new branch: the checkpoints newer than it belong to the abandoned
  history, so they are moved into `checkpoints/abandoned/<time>-after-step_N/` (with the abandoned metrics
  records), where neither `latest` nor pruning sees them. metrics.jsonl keeps one consistent history.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megatrain.train.config import ConfigError
import fcntl

LOCK_FILE = ".lock"
ABANDONED = "abandoned"


def fresh_run_dir(path: Path) -> Path:
    """`path`, or `path-1`, `path-2`... when it already holds a run (metrics or checkpoints)."""
    def used(p: Path) -> bool:
        return (p / "metrics.jsonl").is_file() and (p / "metrics.jsonl").stat().st_size > 0 or \
            any((p / "checkpoints").glob("step_*"))

    candidate, n = path, 0
    while used(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


class RunLock:
    """An exclusive, non-blocking lock on a run directory, held until `release()` (or the process ends)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise ConfigError(f"run directory {run_dir} is in use by another megatrain process (pid {holder}); wait "
                              "for it to finish, or choose another run.name / run.out_dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def set_aside_newer(checkpoints: list[tuple[int, Path]], step: int, metrics: Path) -> Path | None:
    """Move the checkpoints after `step` (an abandoned branch) and their metrics records aside; returns where."""
    newer = [(s, p) for s, p in checkpoints if s > step]
    if not newer:
        return None
    aside = newer[0][1].parent / ABANDONED / f"{time.strftime('%Y%m%d-%H%M%S')}-after-step_{step:08d}"
    aside.mkdir(parents=True, exist_ok=True)
    for _, p in newer:
        p.rename(aside / p.name)
    if metrics.is_file():  # the abandoned branch's records, kept beside its checkpoints for the record
        lines = [line for line in metrics.read_text(encoding="utf-8").splitlines() if _step_of(line) > step]
        (aside / "metrics.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return aside


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1
