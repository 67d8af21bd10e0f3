"""The one error of persistence: a checkpoint, HF directory or safetensors file that cannot be read as the model
needs it. `megatrain` prints it as one line (cli/__init__.py)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model spec or cannot be read (missing tensor, wrong shape, a broken or
    foreign file); the message names the file or tensor and what to do."""
