"""Runs are named after their config file or their model, not `debug` for everything (issue 23, item 4); a second
run of a name takes name-1 (train/rundir.py claim_run_dir)."""
import argparse
from pathlib import Path

import pytest

from megatrain.train.command import add_train_arguments, config_from_args
from megatrain.train.config import RunConfig, default_run_name, load_config
from megatrain.train.loop import run_training

TINY = ["--steps", "1", "--batch", "2", "--seq", "32", "--no-progress", "--set", "run.eval_every=0",
        "--set", "run.simulate=false", "--set", "run.checkpoint_every=0", "--set", "schedule.compute_dtype=fp32"]


def _cfg(*argv: str) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def _toml(path: Path, run_table: str = "") -> Path:
    path.write_text(f'[model]\nname = "debug"\n\n[run]\nsteps = 1\n{run_table}')
    return path


@pytest.mark.parametrize("argv, name", [
    ([], "debug"),                                     # the default model
    (["--model", "llama3-8b"], "llama3-8b"),           # a preset
    (["--model", "bench-3b", "--name", "mine"], "mine"),  # --name wins
])
def test_a_run_is_named_after_its_model(argv, name):
    assert _cfg(*argv).run.name == name


def test_a_hugging_face_directory_names_the_run_by_its_last_component():
    assert default_run_name(None, "/models/SmolLM-135M/") == "SmolLM-135M"
    assert default_run_name(None, "Qwen2.5-0.5B") == "Qwen2.5-0.5B"


def test_a_run_is_named_after_its_config_file_unless_it_names_itself(tmp_path):
    assert _cfg("--config", str(_toml(tmp_path / "my-exp.toml"))).run.name == "my-exp"
    assert _cfg("--config", str(_toml(tmp_path / "my-exp.toml")), "--model", "bench-3b").run.name == "my-exp"
    assert _cfg("--config", str(_toml(tmp_path / "b.toml", 'name = "set-here"\n'))).run.name == "set-here"
    assert _cfg("--config", str(_toml(tmp_path / "c.toml")), "--name", "cli").run.name == "cli"
    # the saved config keeps the name: loading it again (a resume) gives the same run directory
    cfg = _cfg("--config", str(_toml(tmp_path / "my-exp.toml")))
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.toml").write_text(cfg.to_toml())
    assert load_config(tmp_path / "saved" / "config.toml").run.name == "my-exp"


def test_two_runs_of_one_config_take_name_and_name_1(tmp_path):
    config = _toml(tmp_path / "my-exp.toml")
    out = ["--out-dir", str(tmp_path / "runs")]
    first = run_training(_cfg("--config", str(config), *out, *TINY), log=lambda line: None)
    second = run_training(_cfg("--config", str(config), *out, *TINY), log=lambda line: None)
    assert (first.run_dir.name, second.run_dir.name) == ("my-exp", "my-exp-1")
