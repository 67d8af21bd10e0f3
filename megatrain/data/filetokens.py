"""A token file read window by window, checked at every read: a file that changes under a run is an error, never
a SIGBUS.

A memory map of a file that is truncated while it is mapped kills the process with SIGBUS on the next access to a
page past the new end: no message, and the steps since the last checkpoint are lost. `FileTokens` reads with
`os.pread` instead (a short read is an ordinary result, not a signal) and compares the file with what it was when
the run opened it (device, inode, size, modification time) before each read, so a truncated, appended, rewritten or
replaced file raises `DataChangedError` naming it; the training loop adds the newest complete checkpoint.

It stands in for the (n,) array of a TokenStream: len, integer index, contiguous slices (read from the file),
`part` (a lazy sub-range: the held-out split), `max` and `np.asarray`.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megatrain.data.errors import DataError

_READ_CHUNK = 1 << 24  # tokens per read of a whole-range pass (`max`, `np.asarray`)


class DataChangedError(DataError):
    """A data file changed (truncated, rewritten, replaced) while the run read it."""


def _stamp(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class FileTokens:
    """Token ids `[start, stop)` of a flat file of `dtype` ids, read on demand (see the module docstring)."""

    def __init__(self, path: str | Path, dtype: str, start: int = 0, stop: int | None = None,
                 stamp: tuple | None = None):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self.stamp = stamp if stamp is not None else _stamp(os.stat(self.path))
        total = self.stamp[2] // self.dtype.itemsize
        self.start, self.stop = start, total if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def part(self, start: int, stop: int | None = None) -> FileTokens:
        """The sub-range `[start, stop)` (positions in this range) without reading it."""
        start, stop, _ = slice(start, stop).indices(len(self))
        return FileTokens(self.path, self.dtype.name, self.start + start, self.start + max(start, stop), self.stamp)

    def _changed(self, now: tuple | None) -> DataChangedError:
        was = f"{self.stamp[2]} bytes"
        if now is None:
            what = "it is gone"
        elif now[:2] != self.stamp[:2]:
            what = "it was replaced by another file"
        elif now[2] != self.stamp[2]:
            what = f"it had {was} when the run opened it and has {now[2]} now"
        else:
            what = "it was rewritten (its modification time changed)"
        return DataChangedError(f"data file {self.path} changed while the run read it: {what}; a run's data must "
                                "stay as it was when the run started (restore it, or start a new run on the new data)")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `[start, stop)` of this range, (stop - start,) of `dtype`, read from the file after checking it."""
        start, stop, _ = slice(start, stop).indices(len(self))
        count = max(0, stop - start)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._changed(None) from None
        try:
            now = _stamp(os.fstat(fd))
            if now != self.stamp:
                raise self._changed(now)
            size = count * self.dtype.itemsize
            raw = os.pread(fd, size, (self.start + start) * self.dtype.itemsize) if size else b""
        finally:
            os.close(fd)
        if len(raw) != size:  # truncated between the check and the read
            raise self._changed(_stamp(os.stat(self.path)) if self.path.exists() else None)
        return np.frombuffer(raw, dtype=self.dtype)

    def __getitem__(self, key):
        if isinstance(key, slice):
            if key.step not in (None, 1):
                raise ValueError("FileTokens reads contiguous slices only")
            return self.read(*key.indices(len(self))[:2])
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"token {key} of {len(self)}")
        return self.read(i, i + 1)[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.read(0, len(self))
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list[int]:
        return self.read(0, len(self)).tolist()

    def max(self):
        return max(self.read(a, a + _READ_CHUNK).max() for a in range(0, len(self), _READ_CHUNK))
