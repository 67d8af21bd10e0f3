"""The streams of a Program, defined once: every other list of stream names derives from `STREAM_DEFS`.

A stream is an in-order queue of tasks. Its `role` says what the interpreters do with it:

    copy      a DMA direction between host and GPU (h2d, d2h): exec gives it a device stream, sim prices its tasks
              as flows of host-memory bytes
    compute   GPU kernels (the stream whose idle time analysis explains)
    host      host threads (cpu): exec runs its tasks on a host thread, never on a device stream
    comm      collectives between data-parallel ranks: exec gives it a device stream

An `optional` stream is left out of a Program (its queues, listing and JSON) when it is empty: `comm` exists only
with world > 1, so a one-GPU Program, and a profile measured on one GPU, has only the others.
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("copy", "compute", "host", "comm")


@dataclass(frozen=True)
class Stream:
    """One stream: its name (as Programs, Timelines and profiles spell it), role and whether it may be absent."""

    name: str
    role: str
    optional: bool = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"stream {self.name!r}: role {self.role!r} is not one of {ROLES}")

    @property
    def on_device(self) -> bool:
        """exec gives the stream a device stream of its own (a host stream runs on a host thread)."""
        return self.role != "host"


STREAM_DEFS = (
    Stream("h2d", "copy"),
    Stream("compute", "compute"),
    Stream("d2h", "copy"),
    Stream("cpu", "host"),
    Stream("comm", "comm", optional=True),
)

# Derived tables (names, in STREAM_DEFS order).
STREAMS = tuple(s.name for s in STREAM_DEFS)
OPTIONAL_STREAMS = tuple(s.name for s in STREAM_DEFS if s.optional)
ONE_GPU_STREAMS = tuple(s.name for s in STREAM_DEFS if not s.optional)  # what a one-GPU profile measures
COPY_STREAMS = tuple(s.name for s in STREAM_DEFS if s.role == "copy")
HOST_STREAMS = tuple(s.name for s in STREAM_DEFS if s.role == "host")
DEVICE_STREAMS = tuple(s.name for s in STREAM_DEFS if s.on_device)
_BY_NAME = {s.name: s for s in STREAM_DEFS}


def stream_def(name: str) -> Stream:
    """The definition of a stream by name; a clear error for a name that is not one."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a stream; streams are {STREAMS}") from None
