"""`megatrain train`: the training CLI (megatrain/training/command.py, megatrain/training/loop.py).

    megatrain train                                   # the embedded default: debug model, bundled corpus
    megatrain train --config run.toml --set optimizer.lr=3e-4 --resume
"""
from __future__ import annotations


def register(sub) -> None:
    from ..training.command import add_train_arguments, run_from_args

    p = sub.add_parser("train", help="train a model streamed from host memory (config, data, checkpoints, resume)")
    add_train_arguments(p)
    p.set_defaults(func=run_from_args)
