"""`megatrain plan` prints the table and the verdict; user mistakes are one clear line."""
import pytest

from megatrain.cli import main
from megatrain.compile.knobs import NAMED_SCHEDULES
from megatrain.model.presets import PRESETS


def test_plan_prints_table_and_fit(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--batch", "8", "--seq", "2048", "--host-gib", "128", "--gpu-gib", "139"])
    out = capsys.readouterr().out
    assert rc == 1  # does not fit 128 GiB with fp32 gradients and a bf16 copy
    assert "fp32 master" in out and "B/param" in out and "short by" in out and "grad_wire=bf16" in out
    rc = main(["plan", "--model", "llama3-8b", "--set", "grad_wire=bf16", "--set", "weight_wire=fp32",
               "--host-gib", "128", "--gpu-gib", "139"])
    assert rc == 0 and "host: fits" in capsys.readouterr().out


def test_plan_user_errors_are_one_line(capsys):
    assert main(["plan", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatrain plan: error: unknown model 'nope'") and err.count("\n") == 1
    assert main(["plan", "--set", "buffers=zero"]) == 2
    assert "must be an integer" in capsys.readouterr().err


def test_gpu_checkpoints_move_checkpoints_from_host_to_gpu_in_the_plan():
    """Keeping the top n offloaded checkpoints on the GPU shrinks the host plan by n checkpoints and grows the GPU
    plan by as many; the DAG loses their X/Y copies."""
    from megatrain.compile.builders import build_schedule
    from megatrain.compile.knobs import knobs_for
    from megatrain.compile.advice import plan_memory
    from megatrain.model.presets import PRESETS

    spec, batch, seq = PRESETS["debug"], 2, 64
    one = batch * seq * spec.hidden_size * 2  # a bf16 checkpoint
    base = plan_memory(spec, batch, seq, knobs_for("long-context"))
    kept = plan_memory(spec, batch, seq, knobs_for("long-context", gpu_checkpoints=2))
    assert base.host.total_bytes - kept.host.total_bytes == 2 * one
    assert kept.gpu.peak_bytes - base.gpu.peak_bytes == 2 * one
    ids = {t.id for t in build_schedule(spec, batch, seq, knobs_for("long-context", gpu_checkpoints=2)).graph}
    top = spec.num_layers - 1
    assert f"X{top}.0" not in ids and f"X{top - 1}.0" not in ids and "X1.0" in ids


@pytest.mark.parametrize("name", sorted(NAMED_SCHEDULES))
def test_plan_rows_add_up_to_the_peak_with_every_buffer_kind(name, capsys):
    """`megatrain plan` lists every GPU buffer kind the placement has, and its rows sum to the peak it reports
    (bench-3b at 8 x 2048, every named schedule; resident units, state and kept-gradient buffers included)."""
    import re

    from megatrain.plan.memory import gpu_rows
    from megatrain.units import GiB
    from megatrain.compile.resolve import resolve

    spec = PRESETS["bench-3b"]
    extra = {"arrival-resident": ["--set", "resident_layers=4"], "overlap-split": ["--set", "retain_grads=2"]}
    argv = ["plan", "--model", "bench-3b", "--batch", "8", "--seq", "2048", "--schedule", name, *extra.get(name, []),
            "--host-gib", "4096", "--gpu-gib", "4096"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    gpu = out[out.index("GPU memory"):out.index("peak")]
    rows = [float(m) for m in re.findall(r"^  .*?(\d+\.\d\d)$", gpu, flags=re.M)]
    peak = float(re.search(r"peak \(the sum of the rows\)\s+(\d+\.\d\d)", out).group(1))
    assert sum(rows) == pytest.approx(peak, abs=0.01 * len(rows))  # each row is rounded to 0.01 GiB
    from megatrain.compile.knobs import resolve_knobs

    plan_knobs = resolve_knobs(name, [a for a in extra.get(name, []) if a != "--set"])[1]
    p = resolve(spec, 8, 2048, plan_knobs)
    from megatrain.plan.memory import plan_placement

    plan = plan_placement(p)
    assert sum(b for _, b in gpu_rows(plan)) == plan.gpu.peak_bytes  # exactly, in bytes
    for kind, word in (("state", "state buffers"), ("kept-grads", "kept-gradient"), ("resident", "resident buffers")):
        assert (word in gpu) == any(b.kind.value == kind for b in p.buffers), (kind, gpu)
    assert peak == pytest.approx(plan.gpu.peak_bytes / GiB, abs=0.01)


def test_plan_and_train_agree_on_what_is_valid(tmp_path, capsys):
    """One resolver: a schedule `train` refuses, `plan` refuses with the same words (and the reverse)."""
    bad = ["--set", "recompute_block=10"]  # more layers per recompute block than weight buffers
    assert main(["plan", "--model", "debug", "--batch", "4", "--seq", "32", *bad]) == 2
    plan_err = capsys.readouterr().err
    assert main(["train", "--model", "debug", "--batch", "4", "--seq", "32", "--steps", "1", "--device", "cpu",
                 "--out-dir", str(tmp_path), *bad]) == 2
    train_err = capsys.readouterr().err
    why = "weight buffer(s) cannot hold the 10 layers"
    assert why in plan_err and why in train_err
    # The fastest schedules train with their defaults: they do not clip, and nothing else has to be switched off.
    assert main(["train", "--model", "debug", "--batch", "2", "--seq", "16", "--steps", "1", "--device", "cpu",
                 "--schedule", "arrival-resident", "--set", "compile_layers=false", "--no-progress",
                 "--out-dir", str(tmp_path)]) == 0


def test_one_set_grammar_for_every_command(tmp_path, capsys):
    """`--set` values parse the same way for plan, simulate and train: on/off booleans, 1_000, quoted strings,
    none for an optional knob (megatrain/settings.py)."""
    sets = ["--set", "compile_layers=on", "--set", "loss_chunk_tokens=1_024", "--set", "grad_wire='bf16'",
            "--set", "gpu_optimizer_fraction=none"]
    assert main(["plan", "--model", "debug", "--batch", "2", "--seq", "16", *sets]) == 0
    assert main(["simulate", "--model", "debug", "--batch", "2", "--seq", "16", "--profile", "cpu", "--no-plots",
                 "--out", str(tmp_path / "sim"), *sets]) == 0
    import argparse

    from megatrain.train.command import add_train_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    knobs = config_from_args(parser.parse_args(sets)).schedule.knobs()
    assert (knobs.compile_layers, knobs.loss_chunk_tokens, knobs.grad_wire) == (True, 1024, "bf16")
    assert knobs.gpu_optimizer_fraction is None
