"""Held-out loss of a run: a plain fp32 forward over the host store's master weights, layer-major.

Layer-major means: the embedding for all of this process's eval rows, then each decoder layer over all of them,
then the head and the loss. Each unit's full fp32 tile is therefore fetched once per evaluation, and only one at a
time. That matters for data-parallel runs, whose sharded stores hold 1/N of every tile: a full tile is a host
all-gather (`ShardedHostStore.full_tile`), so it is done once per unit, never for the whole model at once. The
price is holding the rank's eval activations on the device: rows x T x hidden fp32, rows <= ceil(eval_batches x
batch_size / world) (e.g. 4 x 8 rows x 2048 x 4096 x 4 B = 1 GiB over two GPUs, half on each). One process has
nothing to gather and runs the same forward batch by batch, holding one batch's activations, as before.

With N ranks, the eval rows are split into N contiguous shares (some may be empty); every rank gathers every
unit in the same order and then sums (loss, tokens) over the ranks, so all ranks issue the same host collectives
and get the token-weighted mean a one-process evaluation of the same batches gives.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from megatrain.exec.head import IGNORE_INDEX, head_logits
from megatrain.io.hf_io import forward_hidden
from megatrain.model.layout import unit_layout
from megatrain.model.spec import HEAD, ModelSpec
from megatrain.data.batches import Data

LOGIT_BYTES = 2**28  # rows per chunk keep one chunk's fp32 logits near 256 MiB


class _StoreTiles(Mapping):
    """The host store's fp32 master as {unit: full tile}: the master itself when it is the whole tile (one
    process, no copy); otherwise `store.full_tile` assembles it (a tied head, whose lm_head is the embedding; a
    rank's slice of a sharded store, gathered from every rank: call it on every rank, in the same order)."""

    def __init__(self, store):
        self.store = store

    def __getitem__(self, unit: int) -> Tensor:
        master = self.store.master(unit)
        whole = master.numel() == self.store.layouts[unit].numel
        return master if whole else self.store.full_tile(unit)

    def __iter__(self) -> Iterator[int]:
        return iter(self.store.units)

    def __len__(self) -> int:
        return len(self.store.units)


def rank_share(rows: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of rank `rank`'s contiguous share of `rows` rows over `size` ranks (the first ranks get one more
    when it is uneven; a share is empty when there are fewer rows than ranks)."""
    per, extra = divmod(rows, size)
    lo = rank * per + min(rank, extra)
    return lo, lo + per + (1 if rank < extra else 0)


@torch.no_grad()
def loss_sums(spec: ModelSpec, tiles: Mapping[int, Tensor], ids: Tensor, targets: Tensor, chunk_rows: int,
              device) -> tuple[float, int]:
    """(sum of token cross-entropies, number of non-ignored targets) of ids / targets (R, T) under `tiles`,
    layer-major (`hf_io.forward_hidden`, then the head): `tiles[unit]` is read once per unit, in unit order, also
    when R = 0, so ranks with no rows take part in the same gathers. The activations of all R rows stay on
    `device`, fp32; each unit runs over them in chunks of `chunk_rows` rows, which bounds its temporaries and the
    logits."""
    xs = forward_hidden(spec, tiles, ids.to(device), chunk_rows)  # [(rows, T, d)]
    head = unit_layout(spec, HEAD).views(tiles[HEAD].to(device))
    total, count, lo = 0.0, 0, 0
    for x in xs:
        t = targets[lo:lo + x.shape[0]].to(device)  # (rows, T)
        lo += x.shape[0]
        logits = head_logits(head, x, spec)  # (rows, T, V) fp32
        total += float(F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum",
                                       ignore_index=IGNORE_INDEX))
        count += int((t != IGNORE_INDEX).sum())
    return total, count


@torch.no_grad()
def evaluate(trainer, data: Data, num_batches: int, batch_size: int) -> float | None:
    """Mean loss (token-weighted, targets -100 ignored) on the first `num_batches` held-out batches of
    `batch_size` rows (None without a held-out split or without a target token): a plain fp32 forward over the
    store's master weights, after any pending update is applied. In a data-parallel run every rank must call it
    (it gathers tiles and sums over the ranks) and every rank gets the same result."""
    if data.eval is None:
        return None
    trainer.flush()
    spec, world = trainer.spec, trainer.world
    batches = list(data.eval_batches(num_batches, batch_size))
    ids = torch.cat([b.inputs for b in batches])  # (R, T), R <= num_batches x batch_size
    targets = torch.cat([b.targets for b in batches])
    T = ids.shape[1]
    chunk = max(1, min(batch_size, LOGIT_BYTES // (T * spec.vocab_size * 4)))
    dev, tiles = trainer.backend.device, _StoreTiles(trainer.store)
    if not world.distributed:  # nothing to gather: batch by batch, so only one batch's activations are held
        sums = [loss_sums(spec, tiles, b.inputs, b.targets, chunk, dev) for b in batches]
        total, count = sum(s for s, _ in sums), sum(n for _, n in sums)
    else:
        lo, hi = rank_share(ids.shape[0], world.rank, world.size)
        total, count = loss_sums(spec, tiles, ids[lo:hi], targets[lo:hi], chunk, dev)
        total, count = world.sum(total), world.sum(float(count))
    if dev.type == "cuda":  # give the eval's activations back, so the training step finds the memory it planned
        torch.cuda.empty_cache()
    return total / count if count else None
