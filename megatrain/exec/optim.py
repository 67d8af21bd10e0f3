"""AdamW on flat fp32 master tiles, exact global-norm clipping, and skipping of non-finite steps.

The update is torch's fused AdamW kernel (`torch._fused_adamw_`, the kernel behind `torch.optim.AdamW(fused=True)`,
on CPU tensors since torch 2.4 and on CUDA), called on views of one unit's tile: weight decay on the matrix prefix
(`UnitLayout.decay_numel`), none on norms and biases. The same function runs on a host tile (CPU placement) and on
a GPU state slot (GPU placement), so every placement gives the same numbers.

Clipping follows `torch.nn.utils.clip_grad_norm_`: total = ||(||g_u||)_u||_2, coef = min(1, max_norm / (total +
1e-6)), every gradient multiplied by coef. A step whose total norm is not finite is skipped: no unit is updated and
no step count advances (as a plain loop that does not call `optimizer.step()`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AdamWConfig:
    """Hyper-parameters of the update; `lr` is a float or a function of the step index (0-based). Clipping is the
    schedule's (`clip`, the max global norm): it decides whether the step computes a global norm at all."""

    lr: float | Callable[[int], float] = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self):
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"AdamW betas must be in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"AdamW needs eps > 0 and weight_decay >= 0, got eps={self.eps}, "
                             f"weight_decay={self.weight_decay}")

    def lr_at(self, step: int) -> float:
        return float(self.lr(step) if callable(self.lr) else self.lr)


@dataclass
class UpdatePlan:
    """How the updates with one step's gradients run: learning rate, clip coefficient, or skip."""

    step: int  # index of the training step whose gradients are applied
    lr: float
    grad_norm: float | None = None  # None until known (clip=0: never for the whole model)
    clip_coef: float = 1.0
    skip: bool = False  # non-finite global norm: nothing is applied
    skipped_units: list[int] = field(default_factory=list)  # clip=0: units whose own gradients were not finite
    applied_units: list[int] = field(default_factory=list)
    # clip=0, GPU updates at arrival: units whose skip the device decided; the host settles the bookkeeping
    # (skipped_units, step counts) once the step's norms have landed
    device_checked: list[int] = field(default_factory=list)
    # speculative clipping: host units not updated as their gradients landed because the norms landed before them
    # already exceeded the max; their CLIP_REDO applies them, clipped
    deferred_units: list[int] = field(default_factory=list)
    redone_units: list[int] = field(default_factory=list)  # speculative clipping: updated, undone, updated again


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (total_norm + 1e-6)); 1 without clipping."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def global_norm(unit_norms: list[float]) -> float:
    """The 2-norm of the per-unit gradient norms (== the norm of all gradients), in float64."""
    return math.sqrt(math.fsum(n * n for n in unit_norms))


def decayed_in(decay_numel: int, lo: int, n: int) -> int:
    """How many of the `n` elements of a piece starting at element `lo` of a tile are weight-decayed, when the
    tile's first `decay_numel` elements are (matrices first, norms and biases after: `UnitLayout.decay_numel`)."""
    return min(max(decay_numel - lo, 0), n)


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: int, decay_numel: int, lr: float, cfg: AdamWConfig, clip_coef: float = 1.0,
                 found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step on a flat fp32 tile, in place. `step` is the step count including this one (1-based).

    param, grad, exp_avg, exp_avg_sq: (n,) fp32 on one device; weight decay applies to param[:decay_numel].
    Clipping is folded into the kernel (it divides the gradient by `grad_scale` and writes the scaled gradient
    back, as an in-place clip would), which saves a full read-write pass: the update is memory-bound on the host.
    found_inf: a () fp32 tensor on the tile's device; where it is nonzero the kernel leaves the tile unchanged
    (a skip decided on the device, without the host waiting for the gradients' norm).
    """
    if grad.dtype != torch.float32 or param.dtype != torch.float32:
        raise TypeError(f"AdamW runs on fp32 tiles; got param {param.dtype}, grad {grad.dtype}")
    grad_scale = None
    if clip_coef < 1.0:
        grad_scale = torch.full((), 1.0 / clip_coef, dtype=torch.float32, device=param.device)
    n = param.numel()
    b1, b2 = cfg.betas
    for lo, hi, wd in ((0, decay_numel, cfg.weight_decay), (decay_numel, n, 0.0)):
        if hi <= lo:
            continue
        # The fused kernel reads the step count from a tensor on the params' device and does not increment it.
        steps = [torch.full((), float(step), dtype=torch.float32, device=param.device)]
        torch._fused_adamw_([param[lo:hi]], [grad[lo:hi]], [exp_avg[lo:hi]], [exp_avg_sq[lo:hi]], [], steps,
                            lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=cfg.eps, amsgrad=False,
                            maximize=False, grad_scale=grad_scale, found_inf=found_inf)


def adamw_update_bf16_state(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                            exp_avg_sq: torch.Tensor, step: int, decay_numel: int, lr: float, cfg: AdamWConfig,
                            scratch: tuple[torch.Tensor, torch.Tensor], clip_coef: float = 1.0) -> None:
    """`adamw_update` with the moments stored in bf16: the math is fp32, chunk by chunk.

    param, grad: (n,) fp32; exp_avg, exp_avg_sq: (n,) bf16; scratch: two (c,) fp32 buffers. Each chunk's moments are
    widened into the scratch, updated by the fused fp32 kernel with the fp32 master and gradient, and rounded back
    to bf16 (round to nearest even, as `Tensor.copy_` rounds). Only the stored moments lose precision: a bf16
    moment keeps 8 significant bits, so m and v carry ~0.4% relative rounding per step (docs/precision.md has
    the measured effect on training).
    """
    if exp_avg.dtype != torch.bfloat16 or exp_avg_sq.dtype != torch.bfloat16:
        raise TypeError(f"bf16 moments expected, got {exp_avg.dtype} / {exp_avg_sq.dtype}")
    m32, v32 = scratch
    n, c = param.numel(), m32.numel()
    for lo in range(0, n, c):
        hi = min(lo + c, n)
        m, v = m32[:hi - lo], v32[:hi - lo]  # (hi - lo,) fp32
        m.copy_(exp_avg[lo:hi])
        v.copy_(exp_avg_sq[lo:hi])
        adamw_update(param[lo:hi], grad[lo:hi], m, v, step, decayed_in(decay_numel, lo, hi - lo), lr, cfg,
                     clip_coef)
        exp_avg[lo:hi].copy_(m)
        exp_avg_sq[lo:hi].copy_(v)


# Elements per pass of `adamw_undo`. On the host, 1 Mi: its temporaries stay in cache instead of page-faulting a
# tile-sized buffer. On a GPU, 16 Mi (a 64 MiB temporary): the redo of a 177 M-parameter unit on an H200
# (scripts/bench_undo.py, docs/runs/24-auto/h200-run2/bench_undo.txt, medians of 5) took 17.4 ms at 1 Mi (8.9 fused
# updates of 1.96 ms: 170 chunks of about ten element-wise kernels each), 6.1 ms at 4 Mi, 6.2 ms at 16 Mi and
# 6.0 ms at 64 Mi (3.1-3.2 updates): past 4 Mi the redo is bound by memory traffic, not launches.
UNDO_CHUNK = 1 << 20
UNDO_CHUNK_DEVICE = 1 << 24


@torch.no_grad()
def adamw_undo(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: int, decay_numel: int, lr: float, cfg: AdamWConfig, chunk: int | None = None) -> None:
    """Invert one unclipped `adamw_update` (the one that made step count `step`) in place, given its gradient.

    The update was  p' = p (1 - lr wd) - (lr / bc1) m' / (sqrt(v') / sqrt(bc2) + eps),
                    m' = b1 m + (1 - b1) g,   v' = b2 v + (1 - b2) g^2,
    so  p = (p' + (lr / bc1) m' / (...)) / (1 - lr wd),  m = (m' - (1 - b1) g) / b1,  v = (v' - (1 - b2) g^2) / b2.
    The denominator is recomputed from v' with the kernel's own operations, so p is recovered to fp32 rounding. m
    and v lose what rounding m' and v' dropped: a relative error of about 2^-24 |v'| / |v| that a redo with clip
    coefficient c turns into about 2^-24 / c^2 of the new v (speculative clipping; docs/executor.md).
    param, grad, exp_avg, exp_avg_sq: (n,) fp32 on one device; weight decay was applied to param[:decay_numel].
    chunk: elements per pass (default by device: UNDO_CHUNK on the host, UNDO_CHUNK_DEVICE on a GPU); every element
    is computed alone, so the result does not depend on it.
    """
    if chunk is None:
        chunk = UNDO_CHUNK if param.device.type == "cpu" else UNDO_CHUNK_DEVICE
    b1, b2 = cfg.betas
    step_size = lr / (1 - b1 ** step)
    bc2_sqrt = math.sqrt(1 - b2 ** step)
    shrink = 1 - lr * cfg.weight_decay
    n = param.numel()
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        p, g, m, v = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]  # (k,) each
        denom = v.sqrt().div_(bc2_sqrt).add_(cfg.eps)
        p.addcdiv_(m, denom, value=step_size)
        decayed = decayed_in(decay_numel, lo, hi - lo)
        if decayed and cfg.weight_decay:
            p[:decayed].div_(shrink)
        m.sub_(g, alpha=1 - b1).div_(b1)
        v.addcmul_(g, g, value=-(1 - b2)).div_(b2).clamp_(min=0.0)
