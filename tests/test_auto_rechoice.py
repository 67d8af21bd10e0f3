"""`--schedule auto` after the warm-up: more than 10% off the prediction -> recalibrate and choose again, once;
a switch keeps the host store and the numbers computed."""
import json
from dataclasses import replace

import pytest
import torch

from megatrain.cli import main
from megatrain.exec.optim import AdamWConfig
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.compile.lower import lower
from megatrain.model.presets import PRESETS
from megatrain.sim import load_profile, simulate
from megatrain.sim.profile import STREAM_NAMES, TASK_KINDS
from megatrain.train.autoswitch import AutoChoice, switch_trainer
from megatrain.engine.trainer import StreamedTrainer

GiB = 2**30


def test_a_choice_the_calibrated_profile_no_longer_favours_is_replaced():
    """The machine is stood in by the simulator with a 'true' profile (its timelines are what a run measures);
    the run started on `serial` with a wrong profile (CPU AdamW 4x too fast). The re-check recalibrates to the true
    steps and switches to a schedule of the same host layout that is faster on the true machine."""
    spec = PRESETS["bench-3b"].with_layers(8)
    true = load_profile("h200-measured")
    wrong = true.with_(cpu_adam_params_per_s={k: 4 * v for k, v in true.cpu_adam_params_per_s.items()},
                       name="wrong")
    knobs = replace(knobs_for("serial"), buffers=2, clip=1.0)
    program = lower(build_schedule(spec, 4, 1024, knobs))
    measured = [simulate(program, true).timeline for _ in range(2)]
    lines = []
    auto = AutoChoice(spec, 4, 1024, knobs, 16 * GiB, None, "serial[buffers=2]")
    decision = auto.recheck(program, wrong, measured, lines.append)
    assert auto.done and "more than 10% off, so auto recalibrates and chooses again (once)" in lines[0]
    assert decision.knobs is not None
    assert any(line.startswith("auto: switching serial[buffers=2] -> ") for line in lines)
    assert decision.knobs.clip == 1.0  # exact clipping kept (arrival placements clip speculatively, exactly)
    new = simulate(lower(build_schedule(spec, 4, 1024, decision.knobs)), true).step_s
    assert new < simulate(program, true).step_s  # faster on the machine the run measured
    # Within 10%: the choice stands, nothing is recalibrated.
    again = AutoChoice(spec, 4, 1024, knobs, 16 * GiB, None, "serial[buffers=2]")
    lines.clear()
    assert again.recheck(program, true, measured, lines.append).calibration is None
    assert lines == [lines[0]] and lines[0].endswith("within 10%, the choice stands")


def test_a_switch_keeps_the_numbers():
    """Three steps of `overlap` (whose update is pending at the switch), then `serial` on the same store, give the
    losses and weights of six steps of `overlap`: the schedule changes speed, not results."""
    spec = PRESETS["debug"]
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, spec.vocab_size, (2, 17), generator=gen) for _ in range(6)]

    def trainer():
        return StreamedTrainer(spec, knobs_for("overlap"), optim=AdamWConfig(lr=1e-2), backend="cpu", seed=0)

    ref, sw = trainer(), trainer()
    ref_losses = [ref.step(d[:, :-1], d[:, 1:]).loss for d in data]
    losses = [sw.step(d[:, :-1], d[:, 1:]).loss for d in data[:3]]
    program, applied = switch_trainer(sw, 2, 16, knobs_for("serial"), "serial")
    assert applied is not None and program.placement.timing.value == "after" and sw.schedule_name == "serial"
    losses += [sw.step(d[:, :-1], d[:, 1:]).loss for d in data[3:]]
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(sw.state_dict()[name], tensor, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="same host layout"):
        switch_trainer(sw, 2, 16, knobs_for("overlap-split"), "overlap-split")


def test_train_auto_rechecks_after_the_warmup_with_a_wrong_profile(tmp_path, capsys):
    """A deliberately wrong profile (20 ms of launch overhead on every task: the debug model's step is predicted at
    a second or more whatever schedule auto picks, measured in tens of milliseconds however loaded the machine;
    scaling rates instead left the prediction within 10% when the chosen schedule did not use them): after 2
    warm-up + 2 measured steps the run says how far off it was, recalibrates, prints the candidates again, and says
    whether it switched. 8 steps: a switch after step 4 leaves 2 warm-up + 2 measured steps of the new schedule, so
    the run ends with a calibrated profile whichever way the re-check went."""
    p = load_profile("cpu")
    wrong = p.with_(task_overhead_s={k: 0.02 for k in (*TASK_KINDS, *STREAM_NAMES)}, name="wrong")
    wrong.save(tmp_path / "wrong.json")
    assert main(["train", "--schedule", "auto", "--steps", "8", "--batch", "2", "--seq", "16", "--device", "cpu",
                 "--no-progress", "--out-dir", str(tmp_path / "runs"),
                 "--set", f"run.profile={tmp_path / 'wrong.json'}",
                 "--set", "run.checkpoint_every=0", "--set", "run.eval_every=0"]) == 0
    out = capsys.readouterr().out.splitlines()
    checks = [line for line in out if line.startswith("auto: ")]
    assert "over 2 steps after the warm-up" in checks[0] and "more than 10% off" in checks[0]
    assert "with the calibrated profile" in checks[1] and "candidates with this host layout" in checks[1]
    last = checks[-1]
    assert "stays" in last or "switching" in last
    assert sum("recalibrates and chooses again" in line for line in out) == 1  # once
    run = tmp_path / "runs" / "debug"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and (run / "profile_calibrated.json").is_file()


def test_auto_without_a_profile_of_this_machine_profiles_quickly_first(tmp_path, capsys):
    args = ["train", "--schedule", "auto", "--steps", "1", "--batch", "2", "--seq", "16", "--device", "cpu",
            "--no-progress", "--out-dir", str(tmp_path / "runs"), "--set", "run.checkpoint_every=0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "no profile of this machine" in out and "so it is profiled quickly first" in out
    from megatrain.profiling.store import cache_path  # the per-user cache (tests/conftest.py: a tmp dir)

    made = cache_path()
    assert made.is_file() and load_profile(made).machine["cores"] >= 1
    assert not (tmp_path / "runs" / "profiles").exists()  # the old per-run-dir cache is gone
    assert f"profile: {made} (this machine's profile in the cache)" in out  # the run used it, in one line
    assert main(args) == 0  # the next run finds it
    out = capsys.readouterr().out
    assert f"using this machine's profile {made}" in out and "profiled quickly" not in out
