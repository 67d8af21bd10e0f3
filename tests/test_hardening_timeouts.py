"""Issue 12, item 1: nothing hangs. A task body that never returns makes `step()` raise within the wait timeout,
with an error naming the task and what every stream was doing; the timeout is settable in the config and the CLI."""
from __future__ import annotations

import time

import pytest
import torch

from megatrain.exec.backend import ExecError
from megatrain.exec.optim import AdamWConfig
from megatrain.model.presets import PRESETS
from megatrain.train.command import add_train_arguments, config_from_args
from megatrain.engine.trainer import StreamedTrainer

DEBUG = PRESETS["debug"]
B, T = 2, 16


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, DEBUG.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _hang_first_prefetch(trainer: StreamedTrainer, sleep_s: float) -> None:
    """Replace the `P` handler with one that sleeps `sleep_s` once (as the issue's reproduction does)."""
    work = trainer._work
    real, state = work.handlers["P"], {"hung": False}

    def prefetch(task):
        if not state["hung"]:
            state["hung"] = True
            time.sleep(sleep_s)
        real(task)

    work.handlers["P"] = prefetch


def _hung_trainer(timeout_s: float, sleep_s: float) -> StreamedTrainer:
    """A CPU trainer whose first PREFETCH sleeps `sleep_s` (a hang when far beyond `timeout_s`)."""
    trainer = StreamedTrainer(DEBUG, "overlap", optim=AdamWConfig(lr=1e-3), backend="cpu", timeout_s=timeout_s)
    trainer.program(B, T)
    _hang_first_prefetch(trainer, sleep_s)
    return trainer


def test_a_hung_task_makes_step_raise_within_the_timeout_naming_the_task():
    trainer = _hung_trainer(2.0, 1000.0)
    ids, targets = _batch()
    t0 = time.perf_counter()
    with pytest.raises(ExecError) as e:
        trainer.step(ids, targets)
    assert time.perf_counter() - t0 < 30, "step() must give up soon after the timeout, not wait for the task"
    msg = str(e.value)
    assert "P" in msg and "h2d" in msg and "Streams:" in msg, msg
    assert "running P" in msg, msg  # what the stuck stream was doing
    # The stream is still inside the sleeping task: another step is refused with a clear error, not a hang.
    t0 = time.perf_counter()
    with pytest.raises(ExecError, match="cannot run another step"):
        trainer.step(ids, targets)
    assert time.perf_counter() - t0 < 30


def test_a_slow_task_surfaces_the_timeout_at_the_timeout_not_when_the_task_ends():
    trainer = _hung_trainer(1.0, 20.0)
    ids, targets = _batch()
    t0 = time.perf_counter()
    with pytest.raises(ExecError):
        trainer.step(ids, targets)
    assert time.perf_counter() - t0 < 15  # not at 20 s


def test_wait_timeout_is_settable_in_the_config_and_on_the_command_line():
    import argparse

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--wait-timeout", "7.5"]))
    assert cfg.run.wait_timeout_s == 7.5
    cfg = config_from_args(parser.parse_args(["--set", "run.wait_timeout_s=12"]))
    assert cfg.run.wait_timeout_s == 12.0
    from megatrain.train.config import ConfigError

    with pytest.raises(ConfigError, match="run.wait_timeout_s"):
        config_from_args(parser.parse_args(["--set", "run.wait_timeout_s=0"]))


def test_profiler_waits_are_bounded_and_name_the_measurement(monkeypatch):
    from megatrain.exec.backend import CpuBackend
    from megatrain.profiling import bench

    monkeypatch.setattr(bench, "WAIT_TIMEOUT_S", 0.5)
    worker = bench.Worker(CpuBackend(), "compute")
    try:
        def stuck():
            time.sleep(30)

        t0 = time.perf_counter()
        with pytest.raises(ExecError, match="stuck on stream compute did not finish within"):
            worker.call(stuck)
        assert time.perf_counter() - t0 < 15  # at the 0.5 s timeout (plus slack for a loaded machine), not at 30 s
    finally:
        worker._pool.shutdown(wait=False)


def test_a_hung_step_ends_the_run_with_an_error_naming_the_task_and_the_checkpoint(tmp_path, monkeypatch):
    from megatrain.exec import work as work_module
    from megatrain.train.config import load_config
    from megatrain.train.errors import TrainingError
    from megatrain.train.loop import run_training

    real, state = work_module.StepWork.prefetch, {"calls": 0}

    def prefetch(self, task):
        state["calls"] += 1
        if state["calls"] == 40:  # some way into the run, after the first checkpoint
            time.sleep(15)
        return real(self, task)

    monkeypatch.setattr(work_module.StepWork, "prefetch", prefetch)
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=h", "run.steps=20", "run.eval_every=0",
                             "run.checkpoint_every=2", "run.progress=false", "run.simulate=false",
                             "data.batch_size=2", "data.seq_len=32", "run.wait_timeout_s=4"])
    t0 = time.perf_counter()
    with pytest.raises(TrainingError) as e:
        run_training(cfg, log=lambda line: None)
    assert time.perf_counter() - t0 < 30
    msg = str(e.value)
    assert "failed: task P" in msg or "for P" in msg, msg
    assert "newest complete checkpoint" in msg and "--resume" in msg, msg
