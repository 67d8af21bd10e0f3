"""`--schedule auto` switches a running trainer between candidates it measures (tests/test_auto_measure.py): a switch
keeps the host store and the numbers computed; without a profile of this machine it profiles quickly first."""

import re

import pytest
import torch

from megatrain.cli import main
from megatrain.exec.optim import AdamWConfig
from megatrain.compile.knobs import knobs_for
from megatrain.model.presets import PRESETS
from megatrain.sim import load_profile
from megatrain.train.autoswitch import switch_trainer
from megatrain.engine.trainer import StreamedTrainer



def test_a_switch_keeps_the_numbers():
    """Three steps of `overlap` (whose update is pending at the switch), then `serial` on the same store, then
    `overlap-split` (another host layout: some units' state is updated on the device, so the store is relaid in
    place) give the losses and weights of eight steps of `overlap`: the schedule changes speed, not results."""
    spec = PRESETS["debug"]
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, spec.vocab_size, (2, 17), generator=gen) for _ in range(8)]

    def trainer():
        return StreamedTrainer(spec, knobs_for("overlap"), optim=AdamWConfig(lr=1e-2), backend="cpu", seed=0)

    ref, sw = trainer(), trainer()
    ref_losses = [ref.step(d[:, :-1], d[:, 1:]).loss for d in data]
    losses = [sw.step(d[:, :-1], d[:, 1:]).loss for d in data[:3]]
    program, applied = switch_trainer(sw, 2, 16, knobs_for("serial"), "serial")
    assert applied is not None and program.placement.timing.value == "after" and sw.schedule_name == "serial"
    losses += [sw.step(d[:, :-1], d[:, 1:]).loss for d in data[3:5]]
    store, lines = sw.store, []
    switch_trainer(sw, 2, 16, knobs_for("overlap-split"), "overlap-split", lines.append)
    assert sw.store is not store and sw.store.layout.gpu_streamed_units and lines  # relaid, and said so
    losses += [sw.step(d[:, :-1], d[:, 1:]).loss for d in data[5:]]
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(sw.state_dict()[name], tensor, rtol=1e-6, atol=1e-7)


def test_auto_without_a_profile_of_this_machine_profiles_quickly_first(tmp_path, capsys):
    args = ["train", "--schedule", "auto", "--steps", "1", "--batch", "2", "--seq", "16", "--device", "cpu",
            "--no-progress", "--out-dir", str(tmp_path / "runs"), "--set", "run.checkpoint_every=0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "no profile of this machine" in out and "so it is profiled quickly first" in out
    # and where its time went
    assert re.search(r"profiled this machine in [0-9.]+ s: \S+ \(longest: .+ [0-9.]+ s, .+ [0-9.]+ s", out)
    from megatrain.profiling.store import cache_path  # the per-user cache (tests/conftest.py: a tmp dir)

    made = cache_path()
    assert made.is_file() and load_profile(made).machine["cores"] >= 1
    assert not (tmp_path / "runs" / "profiles").exists()  # the old per-run-dir cache is gone
    assert f"profile: {made} (this machine's profile in the cache)" in out  # the run used it, in one line
    assert main(args) == 0  # the next run finds it
    out = capsys.readouterr().out
    assert f"using this machine's profile {made}" in out and "profiled quickly" not in out
