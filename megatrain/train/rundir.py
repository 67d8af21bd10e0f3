"""The run directory: choosing it, locking it, and keeping one history in it.

- A run claims its directory first, before any check or write (`claim_run_dir`): it takes an exclusive lock
  (`flock` on `<run_dir>/.lock`, the directory created if needed) and holds it while it uses the directory. A fresh
  run never writes into an earlier run's directory, nor into one another process holds: it takes the next free
  `name-1`, `name-2`... (two runs started together with one name get two directories). A second process on a
  resumed run's directory is refused at start. The kernel drops the lock when the process dies, so a killed run
  never leaves a stale lock.
- A run whose checks fail before it writes anything gives its claim back (`RunLock.forget`): the lock file and
  the directory it created are removed, so a failed pre-run check leaves nothing behind.
- A resume from an older checkpoint starts a new branch: the checkpoints newer than it belong to the abandoned
  history, so they are moved into `checkpoints/abandoned/<time>-after-step_N/` (with the abandoned metrics
  records), where neither `latest` nor pruning sees them. metrics.jsonl keeps one consistent history.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megatrain.io.errors import CheckpointError
from megatrain.io.export_target import RUN_LOCK_FILE
from megatrain.train.config import ConfigError
import fcntl

LOCK_FILE = RUN_LOCK_FILE  # ".lock", a run directory's marker too (io/export_target.py)
ABANDONED = "abandoned"


def _used(p: Path) -> bool:
    """Whether directory `p` holds a run's results (metrics or checkpoints): a fresh run never writes into it."""
    metrics = p / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or any((p / "checkpoints").glob("step_*"))


class RunLock:
    """An exclusive, non-blocking lock on a run directory, held until `release()` (or the process ends).

    Taking it creates the directory when needed (`created` says so). `forget()` undoes a claim that wrote
    nothing: the lock file and the directories this claim created, if empty, are removed."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.created = False
        self._made: list[Path] = []  # the missing parents (run.out_dir) this claim created, deepest first
        self._new_lock = not self.path.exists()
        self._new_checkpoints = not (self.run_dir / "checkpoints").exists()  # check_writable creates it
        try:
            self._lock()
        except OSError as e:
            raise CheckpointError(f"run directory {self.run_dir} is not writable ({e.strerror or e}); choose another "
                                  "run.out_dir / run.name, or fix its permissions") from None

    def _lock(self) -> None:
        while True:  # retried when another process removed the directory or the lock file meanwhile (forget())
            try:
                os.mkdir(self.run_dir)
                self.created = True
            except FileExistsError:
                pass
            except FileNotFoundError:
                missing = [p for p in self.run_dir.parents if not p.exists()]
                os.makedirs(self.run_dir.parent, exist_ok=True)
                self._made += missing
                continue
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise LockedError(f"run directory {self.run_dir} is in use by another megatrain process (pid "
                                  f"{holder}); wait for it to finish, or choose another run.name / run.out_dir") \
                    from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # locked a lock file another process had just removed: take the one there now
                os.close(fd)
                continue
            self._fd = fd
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def forget(self) -> list[Path]:
        """Give back a claim after which nothing was written: remove what the claim and the checks made (the lock
        file, still locked so no other process takes the removed one; an empty checkpoints/; the directory and
        run.out_dir when this claim created them and they are empty). Returns what is left (not empty)."""
        if self._fd is None:
            return []
        if self._new_lock:
            try:
                self.path.unlink()
            except OSError:
                pass
        self.release()
        left: list[Path] = []
        made = ([self.run_dir / "checkpoints"] if self._new_checkpoints else []) + \
            ([self.run_dir, *self._made] if self.created else [])
        for d in made:  # deepest first; a directory that is not empty stays, and so do those above it
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(d)
                break
        return left


class LockedError(ConfigError):
    """The run directory is locked by another process (a fresh run then tries the next name)."""


def claim_run_dir(path: Path, fresh: bool) -> RunLock:
    """Lock the run directory before any check or write, so two runs never share one. A resumed run locks `path`
    (ConfigError when another process holds it). A fresh run takes `path`, or `path-1`, `path-2`... when it holds
    an earlier run's results or another process holds its lock: the lock is taken first and the contents checked
    after, so two runs started together with the same name get two directories."""
    if not fresh:
        return RunLock(path)
    n = 0
    while True:
        candidate = path if n == 0 else path.with_name(f"{path.name}-{n}")
        n += 1
        if candidate.exists() and not candidate.is_dir():
            continue
        try:
            lock = RunLock(candidate)
        except LockedError:
            continue
        if not _used(candidate):
            return lock
        lock.release()


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
