"""Errors that end a training run (not user mistakes in the config): printed by `megatrain` as one line, with
what happened, what was kept and how to continue; exit status 1."""
from __future__ import annotations


class TrainingError(RuntimeError):
    """The run stopped: divergence, a write that failed (disk full), a hung step. The message says which
    checkpoint is the newest complete one and how to resume."""


class DivergedError(TrainingError):
    """Too many consecutive steps skipped their updates (non-finite gradients): the run diverged."""
