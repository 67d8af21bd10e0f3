"""Byte units, defined once: KiB, MiB and GiB are powers of two (as the CUDA driver and the kernel report memory),
and every message writes a byte count the same way.

    format_bytes(3 * 2**29)        -> "1.50 GiB"
    format_bytes(4096, "g")        -> "4 KiB"
    format_bytes(100)              -> "100 B"
"""
from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30


def format_bytes(nbytes: float, spec: str = ".2f") -> str:
    """`nbytes` in the largest of GiB, MiB, KiB it reaches, the number written with format `spec`; below 1 KiB, in
    bytes."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:{spec}} {unit}"
    return f"{nbytes:g} B"
