"""Issue 12, item 11: SIGTERM and SIGINT checkpoint at the next step boundary and exit with a message saying how
to resume; Ctrl-C during start-up is one line, no traceback; "--resume" is only suggested when a checkpoint exists."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from megatrain.cli import main
from megatrain.train import loop, preflight
from megatrain.train.loop import run_training
from megatrain.train.metrics import read_metrics
from runconfigs import small_run


def tiny(tmp_path: Path, *extra: str, name: str = "t"):
    return small_run(tmp_path, "run.checkpoint_every=0", "run.log_every=1", "optimizer.lr=3e-3", *extra, name=name)


def signal_at_step(signum: int, step: int, lines: list[str]):
    """A log callable that sends `signum` to this process when the log line of `step` is written (mid-run)."""
    def log(line: str) -> None:
        lines.append(line)
        if line.startswith(f"step {step}/"):
            os.kill(os.getpid(), signum)
    return log


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_at_the_step_boundary_and_says_how_to_resume(tmp_path, signum):
    lines: list[str] = []
    s = run_training(tiny(tmp_path), log=signal_at_step(signum, 2, lines))
    name = signal.Signals(signum).name
    assert s.stopped_early and s.stop_signal == name and s.steps == 2
    assert s.checkpoint is not None and s.checkpoint.name == "step_00000002"
    assert any(f"{name} received" in line for line in lines)
    assert any("stopped after step 2" in line and "--resume" in line for line in lines)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are restored
    straight = run_training(tiny(tmp_path, name="ref"), log=lambda line: None)
    r = run_training(tiny(tmp_path, "run.resume=latest"), log=lambda line: None)
    assert r.start_step == 2 and list(read_metrics(r.run_dir / "metrics.jsonl").loss) == straight.losses


def test_the_cli_exits_with_128_plus_the_signal(tmp_path, monkeypatch, capsys):
    real = loop.run_training

    def run(cfg, **kw):
        return real(cfg, log=signal_at_step(signal.SIGTERM, 1, []))

    monkeypatch.setattr(loop, "run_training", run)
    rc = main(["train", "--out-dir", str(tmp_path), "--steps", "4", "--no-progress", "--set", "run.simulate=false",
               "--set", "run.log_every=1",
               "--set", "run.eval_every=0", "--batch", "2", "--seq", "32"])
    assert rc == 128 + signal.SIGTERM
    assert (tmp_path / "debug" / "checkpoints" / "step_00000001").is_dir()


def test_ctrl_c_during_start_up_is_one_line_without_a_traceback(tmp_path, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(preflight, "open_data", interrupted)
    rc = main(["train", "--out-dir", str(tmp_path), "--steps", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err


def test_an_interrupt_before_any_checkpoint_does_not_suggest_resume(tmp_path):
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("step 1/"):
            raise KeyboardInterrupt  # as a second Ctrl-C does

    with pytest.raises(KeyboardInterrupt):
        run_training(tiny(tmp_path), log=log)
    assert any("no checkpoint was written" in line for line in lines)
    assert not any("--resume" in line for line in lines)
