"""`megatrain train`: the training CLI (megatrain/train/command.py, megatrain/train/loop.py).

    megatrain train                                   # the embedded default: debug model, bundled corpus
    megatrain train --config examples/demo.toml --set optimizer.lr=3e-4 --resume
"""
from __future__ import annotations

import argparse

EPILOG = """examples (from the repository root; examples/ holds ready configs):
  megatrain train                                           the debug model on the bundled corpus
  megatrain train --config examples/demo.toml               the same from a config file
  megatrain train --config examples/demo.toml --set run.steps=240 --resume
  megatrain train --config examples/finetune-hf-jsonl.toml --set model.name=/path/to/hf-model
  megatrain export runs/demo runs/demo-hf                   any checkpoint as a Hugging Face directory

A run writes runs/<name>/: config.toml (every key), train.log, metrics.jsonl, checkpoints/, timelines."""


def register(sub) -> None:
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.train.command import add_train_arguments, run_from_args

    p = sub.add_parser("train", help="train a model streamed from host memory (config, data, checkpoints, resume)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p)
    p.add_argument("--auto-measure", dest="auto_measure", type=int, metavar="K",
                   help="--schedule auto: measure the K fastest predicted candidates on the run's first steps (1 "
                        "untimed + 2 timed steps each, training steps of the run) and train with the fastest "
                        "measured (default 3; 0: the best predicted, not measured)")
    p.add_argument("--auto-band", dest="auto_band", type=float, metavar="FRACTION",
                   help="--schedule auto: also measure every candidate predicted within FRACTION of the best, 6 at "
                        "most (default 0.1, a choice: docs/accuracy.md has the measured prediction errors; 0: "
                        "exactly K)")
    p.set_defaults(func=run_from_args)
