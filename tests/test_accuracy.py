"""scripts/accuracy.py, the standing out-of-sample accuracy benchmark (issue 24): its CPU path end to end, and the
simulator's errors on the rows recorded on one H100 (docs/runs/24-accuracy/h100-run2) and one H200 (h200-run1) kept
within bounds.

The recorded rows are GPU measurements nobody can re-run in CI; the predictions are recomputed here by the current
profiler (each quick profile rebuilt from its recorded measurements: `report --rebuild`), simulator and calibration
from the rows' Program records and the measured timelines. A change that makes the profiler or the simulator
predict those runs worse fails here. The bounds sit a little above what the tree
of issue 24 gives (in the comments); tighten them as the simulator improves, never loosen them to pass.
"""
import importlib.util
import json
import statistics
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "runs" / "24-accuracy" / "h100-run2"


def _script():
    spec = importlib.util.spec_from_file_location("accuracy_script", ROOT / "scripts" / "accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _abs(errors):
    return sorted(abs(e) for e in errors)


@pytest.fixture(scope="module")
def recorded_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    for tgz in sorted(RECORDED.glob("acc-*.tgz")):
        with tarfile.open(tgz) as t:
            t.extractall(root, filter="data")
    return root


@pytest.fixture(scope="module")
def recorded(recorded_root):
    return _script().evaluate(recorded_root, "bench-3b:arrival", rebuild="as measured")


def test_compute_ran_slower_beside_copies_in_the_recorded_h100_steps(recorded_root):
    """`accuracy.py copies`: the layer tasks of the 63 recorded rows against their quick profile's tables. With no
    copy beside them they match the tables (F median 1.004); with copies over most of them F is 1.060 and B 1.082
    (medians), and the fit gives F 1.049, B 1.069: the profile's compute_beside_copy that the simulator applies."""
    r = _script().beside_copies([recorded_root])
    tasks = r["tasks"]
    alone = tasks[(tasks["kind"] == "F") & (tasks["fraction"] == 0)]["ratio"]
    assert len(alone) > 500 and abs(alone.median() - 1.0) < 0.02
    (_, slope_f, n_f), (_, slope_b, n_b) = r["fit"]["F"], r["fit"]["B"]
    assert n_f > 5000 and n_b > 5000
    assert 1.03 < 1 + slope_f < 1.07 and 1.04 < 1 + slope_b < 1.10, (slope_f, slope_b)


def test_recorded_h100_predictions_stay_within_their_errors(recorded):
    errors = recorded["errors"]
    assert len(errors["a"]) == 21 and len(errors["b"]) == 12  # 3 shapes x 7 schedules; 2 x 6 strictly out of sample
    a, b, c = _abs(errors["a"]), _abs(errors["b"]), _abs(errors["c"])
    # (a) a fresh --quick profile, no training run: median 6.3%, max 17.1% (6.7%, 17.1% with the CPU rate from the
    # operating point alone, before the median of its three estimates; 6.5%, 17.1% before copy_beside_update)
    assert statistics.median(a) <= 0.075 and a[-1] <= 0.19, a
    # (b) the quick profile calibrated on bench-3b `arrival`, other shapes and schedules: median 4.1%, max 22.5%
    # (4.1%, 25.9% before)
    assert statistics.median(b) <= 0.055 and b[-1] <= 0.24, b
    # (c) in-sample (a fit of each row to its own steps, not a prediction): median 0.3%, max 2.1% (0.4%, 3.1%
    # before; 0.8% and 5.5% before the fit left the slowest of 3 timed steps out)
    assert statistics.median(c) <= 0.005 and c[-1] <= 0.025, c
    for shape, tau_a, tau_b in recorded["taus"]:  # the measured order of the 7 schedules, per shape: 0.81-1.0
        assert tau_a >= 0.8 and tau_b >= 0.85, (shape, tau_a, tau_b)


@pytest.fixture(scope="module")
def recorded_h200(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc200")
    for tgz in sorted((RECORDED.parent / "h200-run1").glob("acc-*.tgz")):
        with tarfile.open(tgz) as t:
            t.extractall(root, filter="data")
    return _script().evaluate(root, "bench-3b:arrival", rebuild="as measured")


def test_recorded_h200_predictions_stay_within_their_errors(recorded_h200):
    """The second machine kind (one H200, 16 cores, 125 GiB; docs/runs/24-accuracy/h200-run1). llama-4.5b and
    qwen2-3b were profiled by the two-wire profiler, bench-3b by the one before it (docs/accuracy.md)."""
    errors = recorded_h200["errors"]
    assert len(errors["a"]) == 21 and len(errors["b"]) == 12
    a, b, c = _abs(errors["a"]), _abs(errors["b"]), _abs(errors["c"])
    # (a) median 3.1%, max 13.5%; (b) median 3.3%, max 12.2%; (c) in-sample median 0.1%, max 1.0%. With the CPU
    # rate from the operating point alone (before the median of its three estimates): 5.6 / 13.5, 3.3 / 9.9,
    # 0.2 / 1.0 (the median helps the fresh profile and costs the transfer's worst row 2.3 points; docs/accuracy.md)
    assert statistics.median(a) <= 0.04 and a[-1] <= 0.15, a
    assert statistics.median(b) <= 0.035 and b[-1] <= 0.13, b
    assert statistics.median(c) <= 0.004 and c[-1] <= 0.015, c
    for shape, tau_a, tau_b in recorded_h200["taus"]:  # 1.0 / 0.9 / 1.0 both ways
        assert tau_a >= 0.85 and tau_b >= 0.85, (shape, tau_a, tau_b)


def test_the_report_labels_in_sample_and_out_of_sample(recorded):
    text = recorded["text"]
    assert "IN-SAMPLE" in text and "| out-of-sample |" in text and "| in-sample |" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 21


def test_measure_then_report_on_the_cpu(tmp_path, monkeypatch, capsys):
    """`measure` on the CPU backend (tiny model, two schedules of two host layouts, 2 rounds) writes rows and
    timelines as it goes, resumes without measuring a row twice, and `report` predicts every row."""
    acc = _script()
    monkeypatch.chdir(ROOT)
    args = ["measure", "--model", "debug", "--batch", "2", "--seq", "16", "--out", str(tmp_path), "--device", "cpu",
            "--rounds", "1", "--steps", "2", "--warmup", "1", "--schedules", "arrival,lean"]
    assert acc.main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "debug" / "rows.jsonl").read_text().splitlines()]
    assert sorted((r["config"], r["round"]) for r in rows) == [("arrival", 0), ("lean", 0)]
    assert {r["layout_group"] for r in rows} == {0, 1}  # lean's host store differs (a gradient ring)
    args[args.index("--rounds") + 1] = "2"
    assert acc.main(args) == 0  # resumed: round 0 is kept, round 1 measured
    rows = [json.loads(line) for line in (tmp_path / "debug" / "rows.jsonl").read_text().splitlines()]
    assert sorted((r["config"], r["round"]) for r in rows) == [("arrival", 0), ("arrival", 1), ("lean", 0),
                                                               ("lean", 1)]
    result = acc.evaluate(tmp_path, "debug:arrival")
    assert len(result["errors"]["a"]) == 2 and len(result["errors"]["c"]) == 2
    assert "| debug | lean |" in result["text"] and "| in-sample |" in result["text"]
    assert "measured step against its physical bound" in result["text"]
    # ablate: the profile rebuilt from its measurements as measured predicts as the saved profile does
    capsys.readouterr()
    assert acc.main(["ablate", str(tmp_path / "debug"), "--model", "debug"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| lean")]
    assert len(table) == 1
    as_measured = float(table[0].split("|")[3].strip().rstrip("%")) / 100
    lean = next(e for e, line in zip(result["errors"]["a"], [ln for ln in result["text"].splitlines()
                                                             if ln.startswith("| debug |")]) if "| lean |" in line)
    assert as_measured == pytest.approx(lean, abs=0.0011)  # both rounded to 0.1% in print
    # report --rebuild: the profiles rebuilt from the measurements predict as the saved ones; a part left out moves
    # nothing it should not (the row count, the labels)
    rebuilt = acc.evaluate(tmp_path, "debug:arrival", rebuild="as measured")
    assert rebuilt["errors"]["a"] == pytest.approx(result["errors"]["a"], abs=1e-9)
    assert "rebuilt from the measurements by today's profiler: as measured" in rebuilt["text"]
    plain = acc.evaluate(tmp_path, "debug:arrival", rebuild="copies not slowed by the update")
    assert len(plain["errors"]["a"]) == 2 and "| debug | lean |" in plain["text"]
    # the CPU update rate from one of its estimates instead of their median: said so in its note
    measured = acc.rebuild_profile(tmp_path / "debug", "debug").notes["cpu_adam_params_per_s"]
    in_step = acc.rebuild_profile(tmp_path / "debug", "debug", "in-step CPU rate").notes["cpu_adam_params_per_s"]
    assert "the median of the estimates" in measured
    from megatrain.profiling.assemble import CPU_RATE_SOURCES, MEDIAN_OF_THREE

    assert set(acc.CPU_RATE_OF_VARIANT.values()) == set(CPU_RATE_SOURCES) - {MEDIAN_OF_THREE}  # one each, all known
    assert "taken from the host updates of the real steps" in in_step and in_step != measured


def test_recorded_h200_start6_predictions_stay_within_their_errors(tmp_path):
    """A sixth H200 start (docs/runs/24-accuracy/h200-run3): llama-4.5b and qwen2-3b by the profiler that measures
    compute beside copies; (b) calibrated on llama-4.5b `arrival` (bench-3b was not measured on that start)."""
    for tgz in sorted((RECORDED.parent / "h200-run3").glob("acc-*.tgz")):
        with tarfile.open(tgz) as t:
            t.extractall(tmp_path, filter="data")
    result = _script().evaluate(tmp_path, "llama-4.5b:arrival", rebuild="as measured")
    errors = result["errors"]
    assert len(errors["a"]) == 14 and len(errors["b"]) == 6  # 2 shapes x 7 schedules; qwen2-3b's 6 other schedules
    a, b, c = _abs(errors["a"]), _abs(errors["b"]), _abs(errors["c"])
    # (a) median 5.0%, max 13.1%; (b) median 8.3%, max 12.7%; (c) in-sample median 0.3%, max 3.5%. With the CPU
    # rate from the operating point alone (before the median of its three estimates): 6.0 / 17.2 (qwen2-3b's
    # host-bound rows, whose update the operating point timed 20-30% fast), 9.1 / 11.5, 0.3 / 3.7
    assert statistics.median(a) <= 0.06 and a[-1] <= 0.145, a
    assert statistics.median(b) <= 0.095 and b[-1] <= 0.135, b
    assert statistics.median(c) <= 0.005 and c[-1] <= 0.04, c


# The H100 table's start (docs/peers.md, "The H100 table"; docs/runs/25-peers/h100-table*): each row's median
# tokens/s over 3 runs (own processes), batch 8 x 2048, `arrival-resident` with the decoder layer compiled.
H100_TABLE_LOGS = ROOT / "docs" / "runs" / "25-peers" / "h100-table4" / "h100-llama8b-8x2048-logs.tgz"
H100_TABLE_ROWS = [  # (model, resident layers, clip, measured tokens/s median)
    ("bench-3b", 24, 1.0, 20_801), ("bench-3b", 24, 0.0, 21_008),
    ("llama3-8b", 12, 1.0, 6_279), ("llama3-8b", 12, 0.0, 8_822)]


def _h100_table_errors(root: Path, back_to_back: bool) -> list[float]:
    """Predicted / measured step - 1 of the H100 table's megatrain rows, each shape's quick profile rebuilt from its
    recorded measurements by today's profiler (with or without the back-to-back measurement)."""
    from megatrain.compile.builders import build_schedule
    from megatrain.compile.knobs import knobs_for
    from megatrain.compile.lower import lower
    from megatrain.model.presets import get_model
    from megatrain.sim import simulate
    from megatrain.sim.engine import StepFacts

    errors = []
    for model, resident, clip, tokens_per_s in H100_TABLE_ROWS:
        slug = {"bench-3b": "bench3b", "llama3-8b": "llama8b"}[model]
        m = json.loads((root / "25-logs" / f"25-profile-h100-{slug}-8x2048.measurements.json").read_text())
        if not back_to_back:
            m.pop("compute_sustained")
        profile = _script().profile_from_measurements(m, model)
        knobs = knobs_for("arrival-resident", resident_layers=resident, compile_layers=True, clip=clip)
        step_s = simulate(lower(build_schedule(get_model(model), 8, 2048, knobs)), profile,
                          StepFacts(clip_share=1.0 if clip else 0.0)).mean_step_s
        errors.append(step_s / (8 * 2048 / tokens_per_s) - 1)
    return errors


def test_the_h100_table_is_priced_at_the_back_to_back_compute_rate(tmp_path):
    """The profile prices the decoder layer at its back-to-back time (profiling/assemble.sustained_factors). On the
    H100 table's start the steps ran bench-3b's compiled layer at F 6.2 / B 18.6 ms against 5.25 / 16.9 in the
    table, and the predictions (measured before the runs, same start) were 11.4-12.2% short of the measured steps
    (13.8% / 12.9% fast in tokens/s); with the tables scaled: -3.4% / -2.5% (bench-3b), -1.8% / +1.4%
    (llama3-8b; -3.1% / +0.4% before, the unclipped row the one it does not help). The rule was chosen after this
    start: these rows are its fit, the next start its test (docs/accuracy.md)."""
    with tarfile.open(H100_TABLE_LOGS) as t:
        t.extractall(tmp_path, filter="data")
    scaled = _h100_table_errors(tmp_path, back_to_back=True)
    assert max(abs(e) for e in scaled) <= 0.04, scaled
    burst = _h100_table_errors(tmp_path, back_to_back=False)  # the tables as timed in bursts
    assert burst[0] < -0.10 and burst[1] < -0.10, burst  # bench-3b's steps priced >10% short
    assert all(abs(s) < abs(b) for s, b in zip(scaled[:3], burst[:3])), (scaled, burst)
