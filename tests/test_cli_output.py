"""What a run prints, where it goes, and what a tracker receives: readable in a terminal and in a pipe."""
from __future__ import annotations

import subprocess
import sys

from megatrain.ir.knobs import knobs_for
from megatrain.training.config import load_config
from megatrain.training.log import RunLog, compile_note
from megatrain.training.loop import run_training
from megatrain.training.metrics import METRIC_KEYS


def test_piped_train_output_has_no_bar_and_a_line_every_n_steps(tmp_path):
    # A real pipe (what `| tee` and CI logs see): no carriage returns, no progress-bar frames, short lines.
    cmd = [sys.executable, "-m", "megatrain", "train", "--steps", "4", "--batch", "2", "--seq", "32",
           "--out-dir", str(tmp_path / "runs"), "--set", "run.log_every=2", "--set", "run.simulate=false",
           "--set", "run.eval_every=0", "--set", "schedule.compute_dtype=fp32"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stdout + p.stderr and "it/s" not in p.stderr and "step/s" not in p.stderr
    lines = p.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["2/4", "4/4"]
    assert max(len(line) for line in lines) < 250
    assert lines[0].startswith("config: model debug") and lines[0].endswith("runs/debug/config.toml)")
    log = (tmp_path / "runs" / "debug" / "train.log").read_text()
    assert log == p.stdout  # train.log holds what the console showed


def test_run_log_keeps_lines_until_the_run_directory_exists(tmp_path):
    seen: list[str] = []
    log = RunLog(seen.append)
    log("before")
    assert not (tmp_path / "train.log").exists()
    log.open(tmp_path)
    log("after")
    bar = log.progress_bar(total=3, initial=0, enabled=True, desc="x")  # a sink, not a terminal: no bar
    bar.update(1)
    log.close()
    assert (tmp_path / "train.log").read_text() == "before\nafter\n" and seen == ["before", "after"]
    resumed = RunLog(seen.append)  # a resumed run appends to its log
    resumed.open(tmp_path)
    resumed("again")
    resumed.close()
    assert (tmp_path / "train.log").read_text() == "before\nafter\nagain\n"


def test_a_compiled_schedule_says_so_before_its_silent_first_step():
    assert compile_note(knobs_for("overlap"), "cpu") is None
    note = compile_note(knobs_for("overlap", compile_layers=True), "cpu")
    assert note.startswith("step 1 compiles the decoder layer") and "minute" in note


def test_trackers_get_every_steps_record(tmp_path):
    records: list[dict] = []
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.steps=3", "run.eval_every=0", "run.simulate=false",
                             "run.progress=false", "run.checkpoint_every=0", "data.batch_size=2", "data.seq_len=32",
                             "schedule.compute_dtype=fp32"])
    lines: list[str] = []
    s = run_training(cfg, log=lines.append, trackers=[records.append])
    assert [r["step"] for r in records] == [1, 2, 3] and all(tuple(r) == METRIC_KEYS for r in records)
    assert [r["loss"] for r in records] == s.losses
    # log_every (default 10) > steps: only the last step's line, and train.log has every line.
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["3/3"]
    assert (tmp_path / "debug" / "train.log").read_text() == "".join(line + "\n" for line in lines)
