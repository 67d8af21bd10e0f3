"""The learning-rate schedule of a run: linear warmup, then cosine, linear or constant decay to min_lr."""
from __future__ import annotations

import math
from collections.abc import Callable

from megatrain.train.config import OptimizerConfig


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


def lr_change_note(saved_config: dict | None, cfg, step: int) -> str | None:
    """The line a resume logs when its learning rate differs from the one the checkpoint's run would have used
    for the next step (a changed optimizer.lr / min_lr / warmup / decay, or run.steps, which moves the decay);
    None when it is the same. `saved_config`: the RunConfig.to_dict() stored in the checkpoint."""
    if not saved_config or "optimizer" not in saved_config:
        return None
    try:
        old_opt = OptimizerConfig(**saved_config["optimizer"])
        old_steps = int(saved_config["run"]["steps"])
    except (TypeError, KeyError, ValueError):
        return None
    old = lr_schedule(old_opt, old_steps)(step)
    new = lr_schedule(cfg.optimizer, cfg.run.steps)(step)
    if math.isclose(old, new, rel_tol=1e-9, abs_tol=0.0):
        return None
    keys = [f"optimizer.{k}" for k in ("lr", "min_lr", "warmup_steps", "decay")
            if getattr(old_opt, k) != getattr(cfg.optimizer, k)]
    if old_steps != cfg.run.steps:
        keys.append(f"run.steps ({old_steps} -> {cfg.run.steps}, which moves the decay)")
    return (f"note: the learning rate of step {step + 1} changes from {old:.3g} (the checkpoint's config) to "
            f"{new:.3g} on resume: " + (", ".join(keys) or "the schedule") + " changed; the curve continues from "
            "this config")
