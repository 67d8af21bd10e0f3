"""Byte counts are written one way in every message (megatrain/units.py)."""
from megatrain.units import GiB, KiB, MiB, format_bytes


def test_units_are_powers_of_two():
    assert (KiB, MiB, GiB) == (1024, 1024**2, 1024**3)


def test_format_bytes_picks_the_largest_unit_reached():
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(GiB - 1) == "1024.00 MiB"  # not yet a GiB
    assert format_bytes(4096, "g") == "4 KiB"
    assert format_bytes(64 * MiB, ".0f") == "64 MiB"
    assert format_bytes(100) == "100 B"
