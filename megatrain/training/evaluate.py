"""Held-out loss of a run: a plain fp32 forward over the host store's master weights."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from .data import Data


class _StoreTiles(Mapping):
    """The host store's fp32 master as {unit: full tile}, without copying: a tied head's tile (whose lm_head
    is the embedding) is the only one assembled, when it is asked for."""

    def __init__(self, store):
        self.store = store

    def __getitem__(self, unit: int) -> torch.Tensor:
        return self.store.full_tile(unit) if self.store.opt_lo[unit] else self.store.master(unit)

    def __iter__(self) -> Iterator[int]:
        return iter(self.store.units)

    def __len__(self) -> int:
        return len(self.store.units)


@torch.no_grad()
def evaluate(trainer, data: Data, num_batches: int, batch_size: int) -> float | None:
    """Mean loss on the first `num_batches` held-out batches (None without a held-out split): a plain fp32
    forward over the store's master weights (`hf_io.forward_logits`), after any pending update is applied."""
    import torch.nn.functional as F

    from ..exec.hf_io import forward_logits

    if data.eval is None:
        return None
    trainer.flush()
    spec, dev = trainer.spec, trainer.backend.device
    tiles = _StoreTiles(trainer.store)
    total, count = 0.0, 0
    for batch in data.eval_batches(num_batches, batch_size):
        B, T = batch.inputs.shape
        rows = max(1, min(B, 2**28 // (T * spec.vocab_size * 4)))  # keep the fp32 logits near 256 MiB
        for lo in range(0, B, rows):
            ids, targets = batch.inputs[lo:lo + rows].to(dev), batch.targets[lo:lo + rows].to(dev)
            logits = forward_logits(spec, tiles, ids)  # (b, T, V) fp32
            total += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            count += int((targets != -100).sum())
            del logits
    if dev.type == "cuda":  # give the eval's activations back, so the training step finds the memory it planned
        torch.cuda.empty_cache()
    return total / count if count else None
