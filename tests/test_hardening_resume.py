"""Issue 12, items 4, 7, 10, 11 (resume part): a resume from an older checkpoint starts a new branch that cannot be
confused with the old one; checkpoints carry checksums of every file and of the unit list; a run directory is
locked while a run uses it; a kill mid-prune leaves nothing behind; a renamed HF model directory still resumes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatrain.model.init import init_tiles
from megatrain.model.presets import PRESETS
from megatrain.io.checkpoint import CheckpointManager
from megatrain.io.checkpoint_format import STATE_FILE
from megatrain.io.errors import CheckpointError
from megatrain.train.config import ConfigError
from megatrain.io.hf_checkpoint import export_hf
from megatrain.train.loop import run_training
from megatrain.train.metrics import read_metrics
from megatrain.train.rundir import RunLock
from runconfigs import small_run

DEBUG = PRESETS["debug"]


def tiny(tmp_path: Path, *extra: str, name: str = "t"):
    return small_run(tmp_path, "run.checkpoint_every=2", "run.keep_last=0", "optimizer.lr=3e-3", *extra, name=name)


def train(cfg, **kw):
    return run_training(cfg, log=lambda line: None, **kw)


def steps_of(run: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))


def test_a_resume_from_an_older_checkpoint_starts_a_new_branch(tmp_path):
    straight = train(tiny(tmp_path, name="ref"))
    train(tiny(tmp_path))  # checkpoints 2, 4, 6
    run = tmp_path / "runs" / "t"
    older = run / "checkpoints" / "step_00000002"
    s = train(tiny(tmp_path, f"run.resume={older}"), stop_at_step=3)  # the new branch: 3, checkpointed
    assert s.start_step == 2 and steps_of(run) == [2, 3]  # 4 and 6 belong to the abandoned branch
    aside = list((run / "checkpoints" / "abandoned").iterdir())
    assert len(aside) == 1 and sorted(p.name for p in aside[0].glob("step_*")) == ["step_00000004", "step_00000006"]
    assert list(read_metrics(aside[0] / "metrics.jsonl").step) == [3, 4, 5, 6]
    s = train(tiny(tmp_path, "run.resume=latest"))  # a plain resume continues the new branch, not the old one
    assert s.start_step == 3
    m = read_metrics(run / "metrics.jsonl")
    assert list(m.step) == [1, 2, 3, 4, 5, 6]  # one consistent history
    assert list(m.loss) == straight.losses  # and still bit-exact


def _checkpoint(tmp_path: Path) -> Path:
    manager = CheckpointManager(tmp_path / "ckpt")
    tiles = init_tiles(DEBUG)
    return manager.save(1, {"master": tiles, "adam_m": tiles, "adam_v": tiles}, {"x": 1})


def test_flipped_bytes_in_a_tensor_file_are_caught_by_the_checksum(tmp_path):
    path = _checkpoint(tmp_path)
    f = path / "adam_m.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x10  # a bit flip in a weight, still a finite float
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"adam_m.safetensors does not match the checksum"):
        CheckpointManager(tmp_path / "ckpt").load()


def test_an_edited_state_file_and_a_shortened_unit_list_are_caught(tmp_path):
    path = _checkpoint(tmp_path)
    state = path / STATE_FILE
    meta = json.loads(state.read_text())
    meta["units"] = meta["units"][:3]
    state.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        CheckpointManager(tmp_path / "ckpt").load()
    state.write_text('{"format": "megatrain-checkpoint", "version": 1, "step": "x", "units": [], "state": {}}')
    with pytest.raises(CheckpointError, match="is damaged"):
        CheckpointManager(tmp_path / "ckpt").load()


def test_a_resume_checks_the_unit_list_against_the_model(tmp_path):
    train(tiny(tmp_path, "run.steps=2"))
    ckpt = tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"
    # rewrite the checkpoint with a shortened unit list (checksums valid): still refused
    manager = CheckpointManager(ckpt.parent)
    loaded = manager.load(ckpt)
    short = {k: {u: t for u, t in v.items() if u in (-1, 0, 1)} for k, v in loaded.tensors.items()}
    manager.save(3, short, loaded.state)
    with pytest.raises(CheckpointError, match=r"holds units \[-1, 0, 1\]"):
        train(tiny(tmp_path, f"run.resume={ckpt.parent / 'step_00000003'}"))


def test_a_locked_run_directory_is_refused(tmp_path):
    train(tiny(tmp_path, "run.steps=2"))
    lock = RunLock(tmp_path / "runs" / "t")
    try:
        with pytest.raises(ConfigError, match=rf"is in use by another megatrain process \(pid {os.getpid()}\)"):
            train(tiny(tmp_path, "run.resume=latest", "run.steps=4"))
    finally:
        lock.release()
    assert train(tiny(tmp_path, "run.resume=latest", "run.steps=4")).steps == 4  # free again


def test_leftovers_of_a_killed_prune_are_removed_by_the_next_save(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=1)
    tiles = init_tiles(DEBUG)
    kinds = {"master": tiles, "adam_m": tiles, "adam_v": tiles}
    manager.save(1, kinds, {})
    (tmp_path / "ckpt" / "step_00000000").mkdir()  # no state file: not a save's (issue 22: the user's, it stays)
    (tmp_path / "ckpt" / ".tmp-deleting-step_00000001").mkdir()  # a kill mid-delete
    manager.save(2, kinds, {})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000000", "step_00000002"]


def test_a_renamed_hf_directory_still_resumes(tmp_path):
    export_hf(tmp_path / "hf-a", DEBUG, init_tiles(DEBUG), dtype=torch.float32)
    train(tiny(tmp_path, f"model.name={tmp_path / 'hf-a'}", "run.steps=2", "data.tokenizer=bytes"))
    (tmp_path / "hf-a").rename(tmp_path / "hf-b")
    s = train(tiny(tmp_path, f"model.name={tmp_path / 'hf-b'}", "run.steps=4", "run.resume=latest",
               "data.tokenizer=bytes"))
    assert s.start_step == 2 and s.steps == 4
