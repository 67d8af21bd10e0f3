"""The small run config the training tests share: the debug model on the bundled corpus, batch 2 x 32, fp32 compute
(the CPU has no fast bf16), 6 steps with a 2-step warmup, no progress bar, no simulation, no evaluation unless a
test asks. Each test file adds what it is about (checkpoints, learning rate, other step counts) before the test's
own overrides; a later key wins.

Importable as `from runconfigs import small_run` (pytest puts tests/ on sys.path: the folder has no __init__.py)."""
from __future__ import annotations

from pathlib import Path

from megatrain.train.config import load_config


def small_run(tmp_path: Path, *overrides: str, name: str = "t"):
    """A RunConfig writing under tmp_path/runs/<name>, with `overrides` (`key=value`, as `--set` takes) on top."""
    return load_config(None, [
        f"run.out_dir={tmp_path / 'runs'}", f"run.name={name}", "run.eval_every=0", "run.progress=false",
        "run.simulate=false", "data.batch_size=2", "data.seq_len=32", "schedule.compute_dtype=fp32", "run.steps=6",
        "optimizer.warmup_steps=2", *overrides])
