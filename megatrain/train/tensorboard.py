"""TensorBoard scalars without the `tensorboard` package: an event file TensorBoard reads, written here.

    with ScalarWriter("runs/ft-1/tensorboard") as tb:
        tb.add_scalar("train/loss", 2.5, step=1)

A training machine needs no TensorBoard (nor its protobuf and gRPC dependencies) to produce what TensorBoard
shows; point `tensorboard --logdir runs/` at the run directories wherever it is installed.

The format (tensorflow/core/util/event.proto, tensorflow/core/lib/io/record_writer.cc): a file
`events.out.tfevents.<seconds>.<host>` of TFRecords, each `uint64 length | uint32 masked_crc32c(length) | data |
uint32 masked_crc32c(data)`, little-endian, where data is a serialized `Event`:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The first record carries file_version "brain.Event:2". Only scalars are written (all a metrics record holds).
"""
from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


# ---- CRC-32C (Castagnoli), as TFRecord frames use it ---------------------------------------------------------------
def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # the reflected Castagnoli polynomial
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of `data` (crc32c(b"123456789") == 0xE3069283, the standard check value)."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits plus a constant (so a CRC of CRCs is not trivial)."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord frame around `data`."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


# ---- protobuf wire format, the few fields an Event needs ------------------------------------------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it (negative numbers take ten bytes)
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, *, file_version: str | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
    """A serialized Event: a file version, or a Summary of scalar values."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5)
                                       + struct.pack("<f", float(value))) for tag, value in scalars.items())
        out += _bytes_field(5, values)
    return out


class ScalarWriter:
    """Appends scalar events to a new event file in `directory` (flushed per call: a crash loses nothing)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.directory / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._f = open(self.path, "ab")
        self._write(event(now, file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        self._f.write(tfrecord(data))
        self._f.flush()

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        """Several scalars of one step in one event."""
        self._write(event(time.time(), step, scalars=values))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.add_scalars({tag: value}, step)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> ScalarWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
