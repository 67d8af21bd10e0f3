"""Issue 12, items 5, 6, 8, 9: write errors (disk full) during metrics, checkpoints and export end the run with one
message after checkpointing the state in memory, and the run resumes; cheap checks (HF tensors, schedule rules,
profile file) run before the host store is allocated; malformed config.json values and escaping paths are clear
errors."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from megatrain.exec import store as store_module
from megatrain.model.init import init_tiles
from megatrain.model.presets import PRESETS
from megatrain.model.spec import SpecError, load_hf_config
from megatrain.train import metrics as metrics_module
from megatrain.io import safetensors_io as stio
from megatrain.io.errors import CheckpointError
from megatrain.train.config import ConfigError
from megatrain.train.errors import TrainingError
from megatrain.io.hf_checkpoint import export_hf, weight_files
from megatrain.train.loop import run_training
from megatrain.train.metrics import read_metrics
from runconfigs import small_run

DEBUG = PRESETS["debug"]


def tiny(tmp_path: Path, *extra: str, name: str = "t"):
    return small_run(tmp_path, "run.checkpoint_every=0", "optimizer.lr=3e-3", *extra, name=name)


def train(cfg, **kw):
    return run_training(cfg, log=lambda line: None, **kw)


class _FullDisk:
    """A file whose writes fail with ENOSPC once `fail_when(data)` says so."""

    def __init__(self, f, fail_when):
        self._f, self._fail_when = f, fail_when

    def write(self, data):
        if self._fail_when(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


# ---- write errors ----------------------------------------------------------------------------------------------
def test_disk_full_while_appending_metrics_checkpoints_and_stops_and_the_run_resumes(tmp_path, monkeypatch):
    real_init = metrics_module.MetricsLogger.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self._f = _FullDisk(self._f, lambda data: '"step": 3,' in data)

    monkeypatch.setattr(metrics_module.MetricsLogger, "__init__", init)
    with pytest.raises(TrainingError) as e:
        train(tiny(tmp_path))
    msg = str(e.value)
    assert "could not append step 3" in msg and "the disk is full" in msg and "--resume" in msg, msg
    run = tmp_path / "runs" / "t"
    assert (run / "checkpoints" / "step_00000003").is_dir()  # the state in memory was checkpointed
    monkeypatch.setattr(metrics_module.MetricsLogger, "__init__", real_init)
    s = train(tiny(tmp_path, "run.resume=latest"))
    straight = train(tiny(tmp_path, name="ref"))
    assert s.start_step == 3 and s.losses == straight.losses[3:]
    assert list(read_metrics(run / "metrics.jsonl").step) == [1, 2, 4, 5, 6]  # step 3's record was lost


def test_a_failed_checkpoint_deletes_no_older_one(tmp_path, monkeypatch):
    """A full disk at a checkpoint ends the run in one line naming the newest complete checkpoint, and every older
    checkpoint is kept (an earlier version pruned the older ones to make room and retried: that deleted the user's
    checkpoints when the disk had turned read-only)."""
    real_write = stio._write

    def full_at_step_6(f, data):
        if "step_00000006" in getattr(f, "name", ""):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(f, data)

    monkeypatch.setattr(stio, "_write", full_at_step_6)
    with pytest.raises(TrainingError, match=r"step_00000004") as e:
        run_training(tiny(tmp_path, "run.checkpoint_every=2", "run.keep_last=0"))
    assert "\n" not in str(e.value).strip()
    kept = sorted(p.name for p in (tmp_path / "runs" / "t" / "checkpoints").glob("step_*"))
    assert kept == ["step_00000002", "step_00000004"], kept


def test_a_failed_export_names_the_checkpoint_holding_the_weights(tmp_path, monkeypatch):
    real_write = stio._write

    def full(f, data):
        if ".hfout.tmp" in getattr(f, "name", ""):  # export writes into a hidden temporary directory
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(f, data)

    monkeypatch.setattr(stio, "_write", full)
    with pytest.raises(TrainingError, match=r"export to .* failed.*trained weights are in checkpoint .*step_00000006"):
        train(tiny(tmp_path, f"run.export_hf={tmp_path / 'hfout'}"))


# ---- cheap checks first ----------------------------------------------------------------------------------------
@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if the host store is allocated."""
    def refuse(*a, **k):
        raise AssertionError("the host store was allocated before the check")

    monkeypatch.setattr(store_module.HostStore, "__init__", refuse)


def _hf_dir(tmp_path: Path, shards: bool = False) -> Path:
    path = tmp_path / "hf"
    export_hf(path, DEBUG, init_tiles(DEBUG), dtype=torch.float32, max_shard_bytes=2**17 if shards else 5 * 2**30)
    return path


def test_a_missing_shard_fails_before_the_store_and_the_run_directory_exist(tmp_path, no_allocation):
    path = _hf_dir(tmp_path, shards=True)
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="names shard model-00002"):
        train(tiny(tmp_path, f"model.name={path}", "data.tokenizer=bytes"))
    assert not (tmp_path / "runs").exists()


def test_a_wrong_tensor_shape_fails_before_the_store(tmp_path, no_allocation):
    path = _hf_dir(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has shape"):
        train(tiny(tmp_path, f"model.name={path}", "data.tokenizer=bytes"))


def test_schedule_rules_fail_before_the_store(tmp_path, no_allocation):
    # The resolver's rules run when the config is loaded (for its model and batch), before anything else.
    with pytest.raises(ConfigError, match="recompute_block"):
        train(tiny(tmp_path, "schedule.name=serial", "schedule.buffers=2", "schedule.recompute_block=4"))


def test_a_bad_profile_file_is_a_config_error_before_the_store(tmp_path, no_allocation):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"')
    with pytest.raises(ConfigError, match="run.profile"):
        train(tiny(tmp_path, "run.simulate=true", f"run.profile={bad}"))
    bad.write_text('[1, 2]')
    with pytest.raises(ConfigError, match="run.profile"):
        train(tiny(tmp_path, "run.simulate=true", f"run.profile={bad}"))


# ---- config.json values and paths ------------------------------------------------------------------------------
@pytest.mark.parametrize("patch, match", [({"vocab_size": "abc"}, "vocab_size='abc' must be a positive integer"),
                                          ({"num_hidden_layers": -2}, "num_hidden_layers=-2"),
                                          ({"rms_norm_eps": "x"}, "rms_norm_eps"),
                                          ({"rope_scaling": [1]}, "rope_scaling must be an object"),
                                          ({"model_type": ["llama"]}, "model_type")])
def test_malformed_config_json_values_are_spec_errors(tmp_path, patch, match):
    (tmp_path / "config.json").write_text(json.dumps({**DEBUG.to_hf_config(), **patch}))
    with pytest.raises(SpecError, match=match):
        load_hf_config(tmp_path)


def test_a_config_json_that_is_not_an_object_is_a_spec_error(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(SpecError, match="must hold a JSON object"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("name", ["..", ".", "a/b", "a\\b"])
def test_a_run_name_cannot_leave_the_output_directory(tmp_path, name):
    with pytest.raises(ConfigError, match="run.name"):
        tiny(tmp_path, name=name)


def test_a_shard_index_cannot_point_outside_the_model_directory(tmp_path):
    path = _hf_dir(tmp_path, shards=True)
    other = tmp_path / "other"
    other.mkdir()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    shard = index["weight_map"][first]
    (path / shard).rename(other / "model.safetensors")
    index["weight_map"] = {k: ("../other/model.safetensors" if v == shard else v)
                           for k, v in index["weight_map"].items()}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside"):
        weight_files(path)
