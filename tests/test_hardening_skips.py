"""Issue 12, items 2-3: every skipped update is counted in metrics, logged and in the run summary; a diverged run
stops with a clear error and a non-zero exit, keeping the last good checkpoint; non-finite weights are refused on
load, naming the tensor."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import safetensors.torch
import torch

from megatrain.cli import main
from megatrain.model.init import init_tiles
from megatrain.model.presets import PRESETS
from megatrain.io.checkpoint import CheckpointManager
from megatrain.io.errors import CheckpointError
from megatrain.train.config import load_config
from megatrain.train.errors import DivergedError
from megatrain.io.hf_checkpoint import export_hf, load_hf_tiles
from megatrain.train.loop import run_training
from megatrain.train.metrics import read_metrics

DEBUG = PRESETS["debug"]


def diverging(tmp_path: Path, *extra: str):
    """The issue's reproduction: arrival updates, no clipping, lr 1e6, no warmup."""
    return load_config(None, [
        f"run.out_dir={tmp_path / 'runs'}", "run.name=d", "run.steps=8", "run.eval_every=0", "run.progress=false",
        "run.simulate=false", "run.checkpoint_every=0", "data.batch_size=2", "data.seq_len=32",
        "schedule.name=arrival", "schedule.compute_dtype=fp32", "optimizer.lr=1e6",
        "optimizer.warmup_steps=0", *extra])


def test_partly_skipped_updates_are_counted_logged_and_summarized(tmp_path):
    lines: list[str] = []
    s = run_training(diverging(tmp_path, "run.max_skipped_steps=0"), log=lines.append)
    m = read_metrics(s.run_dir / "metrics.jsonl")
    skipped = m[m.skipped_units > 0]
    assert len(skipped) >= 5, m[["step", "skipped", "skipped_units"]]
    assert skipped.skipped.all() and (m.skipped == (m.skipped_units > 0)).all()
    assert s.skipped_steps == list(skipped.step)
    warnings = [line for line in lines if line.startswith("WARNING: the update of step")]
    assert len(warnings) == len(skipped) and "units (non-finite gradients in" in warnings[0]
    assert any(f"{len(skipped)} of 8 steps skipped their update" in line for line in lines)


def test_a_diverged_run_stops_with_an_error_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = diverging(tmp_path, "run.max_skipped_steps=3", "run.checkpoint_every=2", "run.keep_last=1")
    with pytest.raises(DivergedError, match=r"the run diverged: the updates of the last 3 steps") as e:
        run_training(cfg, log=lambda line: None)
    run = tmp_path / "runs" / "d"
    kept = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    m = read_metrics(run / "metrics.jsonl")
    first_skip = int(m[m.skipped].step.min())
    # no checkpoint written once the skips began: the newest is from before them, and it is named in the error
    assert kept and all(int(k.removeprefix("step_")) < first_skip for k in kept), (kept, first_skip)
    assert kept[-1] in str(e.value) and "--resume" in str(e.value)
    assert int(m.step.max()) == first_skip + 2  # stopped at the third skipped step in a row


def test_the_cli_exits_non_zero_on_divergence(tmp_path, capsys):
    rc = main(["train", "--schedule", "arrival", "--lr", "1e6", "--set",
               "optimizer.warmup_steps=0", "--steps", "8", "--out-dir", str(tmp_path), "--no-progress",
               "--set", "run.simulate=false", "--set", "run.eval_every=0", "--batch", "2", "--seq", "32",
               "--set", "schedule.compute_dtype=fp32", "--set", "run.max_skipped_steps=2"])
    err = capsys.readouterr().err
    assert rc == 1 and "diverged" in err and "Traceback" not in err


def test_non_finite_weights_are_refused_on_load_naming_the_tensor(tmp_path):
    tiles = init_tiles(DEBUG)
    tiles[1][5] = math.nan
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(3, {"master": tiles, "adam_m": tiles, "adam_v": tiles}, {"x": 1})
    with pytest.raises(CheckpointError, match=r"master.safetensors: tensor 'layers.1' holds non-finite values"):
        manager.load()
    tiles = init_tiles(DEBUG)
    export_hf(tmp_path / "hf", DEBUG, tiles, dtype=torch.float32)  # export refuses non-finite weights: plant one after
    (shard,) = (tmp_path / "hf").glob("*.safetensors")
    state = safetensors.torch.load_file(str(shard))
    name = next(n for n in state if n.startswith("model.layers.0."))
    state[name].view(-1)[7] = math.inf
    safetensors.torch.save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.\S+' in .* holds non-finite values"):
        load_hf_tiles(tmp_path / "hf", DEBUG)
