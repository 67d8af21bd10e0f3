"""No silent FLOP fallback: compute tasks the profile has no measured table for are counted by the simulator
(SimResult.estimated, sim/estimates.py) and every command that prints a prediction says so in one line."""
import pytest

from megatrain.cli import main
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.compile.lower import lower
from megatrain.model.presets import PRESETS
from megatrain.profiling.compare import compare
from megatrain.sim import ComputeTable, estimate_line, load_profile, model_signature, simulate

DEBUG = PRESETS["debug"]
SIG = model_signature(DEBUG)
# Tables for every compute task of the debug model at seq 32 (bf16, eager): kind, unit class, seconds at 64 tokens
TABLES = (("F", "layer", 1e-3), ("R", "layer", 1e-3), ("B", "layer", 3e-3), ("F", "embed", 1e-4),
          ("B", "embed", 2e-4), ("F", "head", 2e-3))


def profile_with(tables=TABLES):
    ts = tuple(ComputeTable(SIG, k, u, 32, (64,), (s,), "bf16") for k, u, s in tables)
    return load_profile("h200").with_(compute_tables=ts, name="with-tables")


@pytest.fixture(scope="module")
def overlap():
    return lower(build_schedule(DEBUG, 2, 32, knobs_for("overlap")))  # F x6 (embed, 4 layers, head), B x5


def test_a_profile_without_the_models_tables_marks_every_compute_task_estimated(overlap):
    r = simulate(overlap, "h200")  # the shipped h200 profile has no compute tables at all
    assert r.estimated == {"F": 6, "B": 5} and r.compute_tasks == 11
    compute = r.timeline[r.timeline["kind"].isin(["F", "R", "B"])]
    assert r.estimated_s == pytest.approx(float((compute["end_s"] - compute["start_s"]).sum()))
    line = estimate_line(r)
    share = 100 * r.estimated_s / r.step_s
    assert line.startswith(f"11 of 11 compute tasks ({share:.0f}% of the predicted step) estimated from FLOPs: ")
    assert f"the model {SIG} has no measured timings in profile h200" in line
    assert "docs/benchmarks.md" in line and "docs/calibration.md" in line  # where the missed-by figures come from
    assert "`megatrain profile --model debug --batch 2 --seq 32` to measure them" in line and "\n" not in line


def test_a_profile_with_the_tables_estimates_nothing(overlap):
    r = simulate(overlap, profile_with())
    assert r.estimated == {} and r.estimated_s == 0.0 and r.compute_tasks == 11
    assert estimate_line(r) is None


def test_missing_kinds_are_named_and_compiled_layers_profiled_compiled(overlap):
    r = simulate(overlap, profile_with([t for t in TABLES if t[1] != "layer"]))
    assert r.estimated == {"F": 4, "B": 4}
    assert "8 of 11 compute tasks" in estimate_line(r) and "(B x4, F x4)" in estimate_line(r)
    compiled = lower(build_schedule(DEBUG, 2, 32, knobs_for("overlap", compile_layers=True)))
    assert "--set compile_layers=true` to measure them" in estimate_line(simulate(compiled, "h200"))


def test_simulate_and_compare_print_the_line_only_when_something_is_estimated(tmp_path, capsys, overlap):
    argv = ["simulate", "--model", "debug", "--batch", "2", "--seq", "32", "--schedule", "overlap", "--no-plots"]
    assert main([*argv, "--profile", "h200", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert sum("estimated from FLOPs" in line for line in out.splitlines()) == 1
    assert "11 of 11 compute tasks" in out
    path = tmp_path / "with.json"
    profile_with().save(path)
    assert main([*argv, "--profile", str(path), "--out", str(tmp_path / "b")]) == 0
    assert "estimated from FLOPs" not in capsys.readouterr().out
    # compare: a "measured" step equal to the prediction; the report says what the prediction rests on
    tl = simulate(overlap, "h200").timeline.assign(source="measured")
    steps = [tl.assign(step=k) for k in range(2)]
    assert "11 of 11 compute tasks" in compare(overlap, steps, "h200").report()
    assert "estimated from FLOPs" not in compare(overlap, steps, profile_with()).report()
    assert compare(overlap, steps, "h200").headline()["estimated_tasks"] == 11


def test_auto_says_its_ranking_rests_on_flop_estimates(tmp_path, capsys):
    rc = main(["simulate", "--model", "debug", "--batch", "2", "--seq", "32", "--schedule", "auto", "--profile",
               "h200", "--gpu-budget-gib", "1", "--no-plots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    chosen = out.splitlines().index(next(line for line in out.splitlines() if line.startswith("chosen: ")))
    assert "estimated from FLOPs" in out.splitlines()[chosen + 1]
