"""The error of data that cannot be trained on (one class for every module of megatrain/data)."""
from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file (and position) and says what to do."""
