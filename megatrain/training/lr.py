"""The learning-rate schedule of a run: linear warmup, then cosine, linear or constant decay to min_lr."""
from __future__ import annotations

import math
from collections.abc import Callable

from .config import OptimizerConfig


def lr_schedule(opt: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """lr(i) of optimizer step i (0-based): linear warmup over `warmup_steps` (step i uses (i+1)/warmup of the
    peak), then `decay` from `lr` to `min_lr` over the remaining steps (the last step reaches min_lr)."""
    peak, low, warm = opt.lr, opt.min_lr, opt.warmup_steps
    span = max(1, total_steps - warm - 1)

    def lr(i: int) -> float:
        if i < warm:
            return peak * (i + 1) / warm
        if opt.decay == "constant":
            return peak
        progress = min(1.0, (i - warm) / span)
        if opt.decay == "linear":
            return peak + (low - peak) * progress
        return low + 0.5 * (peak - low) * (1.0 + math.cos(math.pi * progress))

    return lr
