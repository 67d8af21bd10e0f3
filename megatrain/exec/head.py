"""The non-layer units: token embedding, and the head (final RMSNorm, lm_head, cross-entropy) with its backward.

The head is the one place where a (tokens, vocab) tensor appears. `head_loss_backward` walks the tokens in chunks
and, for each chunk, computes logits, loss and the logits' gradient and immediately pushes that gradient through
lm_head and the final norm, so only one chunk's (chunk_tokens, V) fp32 logits exist at a time. The gradient of
cross-entropy with respect to the logits is written in closed form, softmax - onehot, in the logits' own buffer:
no autograd graph over the vocabulary dimension, no second (n, V) tensor.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from megatrain.model.spec import ModelSpec
# The head (final RMSNorm, lm_head, cross-entropy) is shared by every registered family (all Llama-shaped); a family
# with another final norm would give its layer module a `final_norm` and this module would ask for it.
from megatrain.model.llama.layer import rms_norm

IGNORE_INDEX = -100  # HF / torch convention for target positions that carry no loss


def embed_forward(weight: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Look up token ids (B, T) in the embedding (V, d); returns (B, T, d) in `dtype` (only the rows are cast)."""
    return F.embedding(ids, weight).to(dtype)  # (B, T, d)


def embed_backward(grad_out: Tensor, ids: Tensor, grad_weight: Tensor) -> None:
    """Add the embedding gradient of grad_out (B, T, d) into grad_weight (V, d, fp32): row ids[b, t] += grad[b, t]."""
    d = grad_weight.shape[1]
    grad_weight.index_add_(0, ids.reshape(-1), grad_out.reshape(-1, d).to(grad_weight.dtype))


def head_logits(w: Mapping[str, Tensor], x: Tensor, spec: ModelSpec) -> Tensor:
    """Final norm + lm_head on x (B, T, d): logits (B, T, V) in fp32 (matmul in x.dtype, as HF, then upcast)."""
    h = rms_norm(x, w["norm.weight"], spec.rms_norm_eps)
    return F.linear(h, w["lm_head.weight"].to(x.dtype)).float()


def _count_and_check(targets: Tensor, vocab_size: int) -> int:
    """Number of non-ignored targets; one host sync that also catches out-of-range ids (a clear error, not NaN)."""
    valid = targets != IGNORE_INDEX
    bad = valid & ((targets < 0) | (targets >= vocab_size))
    n_valid, n_bad = torch.stack([valid.sum(), bad.sum()]).tolist()
    if n_bad:
        first = targets[bad][0].item()
        raise ValueError(f"{n_bad} target ids are outside the vocabulary [0, {vocab_size}) (e.g. {first}); "
                         f"use {IGNORE_INDEX} for positions without a loss")
    return int(n_valid)


def head_loss_backward(w: Mapping[str, Tensor], x: Tensor, targets: Tensor, spec: ModelSpec, chunk_tokens: int,
                       loss_scale: float, grad_acc: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, int]:
    """Fused, chunked head forward + cross-entropy + backward.

    w: {"lm_head.weight": (V, d), "norm.weight": (d,)} (views, any float dtype). x: (B, T, d) final hidden states.
    targets: (B, T) int64, already shifted (targets[b, t] is the token after position t), -100 = no loss.
    The gradient is that of `loss_scale * sum of token losses`; it is ADDED into grad_acc["lm_head.weight"] and
    grad_acc["norm.weight"] (fp32). Returns (loss_sum: fp32 scalar, the unscaled sum of token losses;
    grad_x: (B, T, d) in x.dtype; the number of non-ignored targets).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if targets.shape != x.shape[:2]:
        raise ValueError(f"targets have shape {tuple(targets.shape)}, hidden states {tuple(x.shape)}: "
                         "expected targets of shape (B, T)")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("head_loss_backward cannot run under torch.inference_mode(); use torch.no_grad()")
    B, T, d = x.shape
    V = spec.vocab_size
    n_valid = _count_and_check(targets, V)
    lm_w = w["lm_head.weight"]
    lm_c = lm_w.to(x.dtype)  # (V, d) compute copy only if the dtypes differ
    acc_lm, acc_norm = grad_acc["lm_head.weight"], grad_acc["norm.weight"]
    xf, tf = x.reshape(B * T, d), targets.reshape(B * T)
    grad_x = torch.empty_like(xf)  # (B*T, d)
    loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)

    for s in range(0, B * T, chunk_tokens):
        xc, tc = xf[s:s + chunk_tokens], tf[s:s + chunk_tokens]  # (n, d), (n,)
        with torch.enable_grad():
            # Autograd only over the (n, d) final norm; the (n, V) part is differentiated by hand below.
            x_leaf = xc.detach().requires_grad_()
            nw_leaf = w["norm.weight"].detach().requires_grad_()  # a view of the slot, no copy
            h = rms_norm(x_leaf, nw_leaf, spec.rms_norm_eps)  # (n, d) in x.dtype
        hd = h.detach()
        logits = F.linear(hd, lm_c).float()  # (n, V) fp32; HF also does the matmul in the compute dtype
        lse = torch.logsumexp(logits, dim=-1)  # (n,)
        valid = tc != IGNORE_INDEX
        safe_t = torch.where(valid, tc, 0)  # (n,) ignored rows gather column 0 and are masked out
        target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)  # (n,)
        loss_sum += torch.where(valid, lse - target_logit, 0.0).sum()
        # d(scale * CE)/d logits = scale * (softmax - onehot), 0 on ignored rows; built in the logits buffer.
        g = logits.sub_(lse[:, None]).exp_()  # (n, V) softmax
        g[torch.arange(g.shape[0], device=g.device), safe_t] -= 1.0
        g.mul_((valid.to(g.dtype) * loss_scale)[:, None])
        g_c = g.to(x.dtype)  # (n, V) in the compute dtype for the two matmuls, as autograd would do
        grad_h = g_c @ lm_c  # (n, d)
        if acc_lm.dtype == g_c.dtype:
            acc_lm.addmm_(g_c.t(), hd)  # (V, d) += (V, n) @ (n, d), no temporary
        else:
            acc_lm.add_(g_c.t() @ hd)
        del logits, g, g_c
        gx, gnw = torch.autograd.grad(h, [x_leaf, nw_leaf], grad_h)
        grad_x[s:s + chunk_tokens] = gx
        acc_norm.add_(gnw)
    return loss_sum, grad_x.view(B, T, d), n_valid
