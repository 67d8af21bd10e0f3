"""`megatrain train`: the training CLI (megatrain/train_cli.py, megatrain/training.py), and synthetic token
batches for benchmarks and calibration runs that need no data files.

    megatrain train                                   # the embedded default: debug model, bundled corpus
    megatrain train --config run.toml --set optimizer.lr=3e-4 --resume
"""
from __future__ import annotations

from collections.abc import Iterator


from ..spec import ModelSpec


def synthetic_batches(spec: ModelSpec, batch: int, seq: int, seed: int = 0) -> Iterator[tuple]:
    """Endless learnable token batches: arithmetic progressions mod vocab_size with random start and stride 1..4.
    Yields (ids, targets), each a (batch, seq) int64 tensor, targets = ids shifted by one."""
    import torch  # here, not at module level: `megatrain --help` should not wait for torch

    g = torch.Generator().manual_seed(seed)
    steps = torch.arange(seq + 1)
    while True:
        start = torch.randint(0, spec.vocab_size, (batch, 1), generator=g)
        stride = torch.randint(1, 5, (batch, 1), generator=g)
        tokens = (start + stride * steps) % spec.vocab_size  # (B, T+1)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def register(sub) -> None:
    from ..train_cli import add_train_arguments, run_from_args

    p = sub.add_parser("train", help="train a model streamed from host memory (config, data, checkpoints, resume)")
    add_train_arguments(p)
    p.set_defaults(func=run_from_args)
