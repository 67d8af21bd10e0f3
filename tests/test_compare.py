"""`megatrain compare`: predicted vs measured task by task, and the CPU-backend profile -> simulate -> compare loop
end to end, with assertions on the error this test measures."""
import json
import math

import pandas as pd
import pytest

from megatrain.cli import main
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.compile.lower import lower
from megatrain.model.presets import PRESETS
from megatrain.profiling import ProfileRequest, measure_profile
from megatrain.profiling.compare import compare, kendall_tau, ranking, task_group
from megatrain.profiling.rounds import measure_rounds
from megatrain.sim import load_profile, simulate
from megatrain.sim.profile import ComputeTable, model_signature
from megatrain.model.spec import EMBED, HEAD

DEBUG = PRESETS["debug"]


def synthetic_profile(scale: float = 1.0):
    """The shipped CPU profile with compute tables for the debug model (times x scale), no overheads, and a link
    whose copies do not depend on what else runs: copies and updates then take the same time at any scale."""
    sig = model_signature(DEBUG)
    tables = [ComputeTable(sig, k, u, 16, (16, 64), tuple(scale * d for d in ds), "fp32")
              for u, k, ds in (("layer", "F", (1e-3, 2e-3)), ("layer", "R", (1e-3, 2e-3)),
                               ("layer", "B", (3e-3, 6e-3)), ("embed", "F", (1e-4, 2e-4)),
                               ("embed", "B", (2e-4, 4e-4)), ("head", "F", (2e-3, 5e-3)))]
    return load_profile("cpu").with_(compute_tables=tuple(tables), task_overhead_s={}, duplex_Bps=math.inf,
                                     dma_factor_cpu_optimizer=1.0, name=f"synthetic x{scale}")


def as_measured(tl: pd.DataFrame, step: int) -> pd.DataFrame:
    out = tl.copy()
    out["source"], out["step"] = "measured", step
    out["start_s"] += 0.5 + step  # measured steps do not start at 0
    out["end_s"] += 0.5 + step
    return out


def test_errors_are_those_of_a_known_slowdown():
    # "Measured" = the simulation with every compute task 25% slower: compute tasks are 20% off (|1 - 1.25| / 1.25),
    # copies and updates exactly right, and the step and GPU idle numbers are those of the two summaries.
    prog = lower(build_schedule(DEBUG, 4, 16, knobs_for("overlap", compute_dtype="fp32")))
    slow = simulate(prog, synthetic_profile(1.25)).timeline
    c = compare(prog, [as_measured(slow, k) for k in range(3)], synthetic_profile())
    g = c.by_group.set_index("group")
    for grp in ("F", "B", "FE", "BE", "FH"):
        assert g.at[grp, "median_err_pct"] == pytest.approx(20.0) and g.at[grp, "bias_pct"] == pytest.approx(-20.0)
    for grp in ("P", "PE", "PH", "O", "OE", "OH", "U", "UE", "UH", "N"):
        assert g.at[grp, "median_err_pct"] == pytest.approx(0.0, abs=1e-6), grp
    assert set(c.tasks["task"]) == set(prog.tasks) and g["n"].sum() == len(prog.tasks)
    assert c.meas_summary.step_s == pytest.approx(slow["end_s"].max())
    assert c.step_error == pytest.approx(c.pred_summary.step_s / slow["end_s"].max() - 1)
    assert c.worst(3)["group"].isin(["F", "B", "FH"]).all()
    text = c.report()
    assert "step time (ms)" in text and "largest errors" in text and "median error" in text


def test_task_groups_ranking_and_kendall():
    assert [task_group(k, u) for k, u in (("F", 3), ("F", HEAD), ("B", EMBED), ("N", None), ("U", pd.NA))] == \
        ["F", "FH", "BE", "N", "U"]
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0 and kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(4 / 6)
    prog = lower(build_schedule(DEBUG, 4, 16, knobs_for("overlap", compute_dtype="fp32")))
    pairs = {}
    for name, (pred, meas) in {"a": (1.0, 1.0), "b": (1.0, 1.5), "c": (1.5, 1.0)}.items():
        tl = simulate(prog, synthetic_profile(meas)).timeline
        pairs[name] = compare(prog, [as_measured(tl, k) for k in range(2)], synthetic_profile(pred))
    rk = ranking(pairs).set_index("variant")
    assert rk.at["a", "pred_rank"] == 1 and rk.at["c", "pred_rank"] == 3 and rk.at["c", "meas_rank"] == 1


# ---- the loop on the CPU backend ---------------------------------------------------------------------------------
VARIANTS = {
    "serial": knobs_for("serial", compute_dtype="fp32"),
    "overlap": knobs_for("overlap", compute_dtype="fp32"),
    "overlap, 4 micro-batches": knobs_for("overlap", compute_dtype="fp32", micro_batches=4),
}
# How close the prediction is (and whether it ranks the variants as measured) is a measurement of the machine, not
# a property of the code: it belongs in a benchmark (`megatrain compare`, docs/calibration.md), not in a test
# that a loaded CI machine can fail. The test checks what the loop must produce whatever the timing.


def _loop():
    cal = measure_profile(ProfileRequest(DEBUG, batch=4, seqs=[64], device="cpu", dtypes=["fp32"], quick=True,
                                         knobs=VARIANTS["overlap"]), log=lambda _: None)
    rows = measure_rounds(DEBUG, VARIANTS, 4, 64, rounds=1, warmup=1, steps=2, device="cpu")
    return cal, {row.config: compare(row.program, row.timelines, cal.profile, warmup=0) for row in rows}


def test_profile_simulate_compare_loop_on_the_cpu_backend():
    cal, cmp = _loop()
    assert {t.dtype for t in cal.profile.compute_tables} == {"fp32"}
    for name, c in cmp.items():
        # Every task of the Program is in the comparison, predicted and measured, with a finite error.
        assert len(c.tasks) == len(c.program.tasks) and set(c.tasks["task"]) == set(c.program.tasks)
        assert (c.tasks["pred_span_s"] >= 0).all() and c.tasks["rel_err"].map(math.isfinite).all(), name
        g = c.by_group.set_index("group")
        assert {"F", "B"} <= set(g.index) and g["n"].sum() == len(c.program.tasks)
        assert c.pred_summary.tokens == c.meas_summary.tokens == 4 * 64
        assert c.pred_summary.step_s > 0 and c.meas_summary.step_s > 0
        assert c.step_error == pytest.approx(c.pred_summary.step_s / c.meas_summary.step_s - 1)
    # 4 micro-batches of 64 tokens pay the per-task costs four times: the tables' token dependence predicts it
    # (a statement about the simulator on this profile, not about the measured times).
    assert cmp["overlap, 4 micro-batches"].pred_summary.step_s > cmp["overlap"].pred_summary.step_s
    # Whether the two rankings agree is the machine's business (above); that each ranks its own column's times, row by
    # row in the variants' order, is the code's: rank = 1 + the number of strictly faster variants (ties share one).
    rk = ranking(cmp)
    assert sorted(rk["variant"]) == sorted(VARIANTS)
    for time, rank in (("pred_step_s", "pred_rank"), ("meas_step_s", "meas_rank")):
        assert list(rk[rank]) == [1 + sum(t < x for t in rk[time]) for x in rk[time]], rk


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    cal = measure_profile(ProfileRequest(DEBUG, batch=2, seqs=[32], device="cpu", dtypes=["fp32"], quick=True,
                                         knobs=VARIANTS["overlap"]), log=lambda _: None)
    cal.save(path)
    return path


def test_compare_command_writes_the_stacked_trace_and_ranks(profile_path, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--model", "debug", "--batch", "2", "--seq", "32", "--schedule", "serial,overlap",
                 "--set", "compute_dtype=fp32", "--steps", "3", "--device", "cpu", "--profile", str(profile_path),
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("step time (ms)") == 2 and "per-task error" in text and "largest errors" in text
    assert "same order predicted and measured:" in text
    for variant in ("serial_compute_dtype-fp32", "overlap_compute_dtype-fp32"):
        d = out / variant
        for f in ("timeline_sim.csv", "timeline_measured.csv", "tasks.csv", "by_group.csv", "compare.json",
                  "trace.json", "gantt.png"):
            assert (d / f).is_file(), f
        trace = json.loads((d / "trace.json").read_text())["traceEvents"]
        procs = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
        assert sorted(procs.values()) == ["measured", "predicted"]
        spans = pd.DataFrame([e for e in trace if e["ph"] == "X"])
        tasks = pd.read_csv(d / "tasks.csv")
        assert spans.groupby("pid").size().tolist() == [len(tasks)] * 2  # one step each, every task
        assert len(pd.read_csv(d / "timeline_measured.csv")) == 2 * len(tasks)  # the timed steps: 3 - 1 warm-up
    rank = json.loads((out / "ranking.json").read_text())
    assert len(rank["rows"]) == 2 and isinstance(rank["same_order"], bool)
    assert [json.loads(line)["config"] for line in (out / "rows.jsonl").read_text().splitlines()] == \
        ["serial[compute_dtype=fp32]", "overlap[compute_dtype=fp32]"]


def test_compare_measures_every_variant_and_round_in_one_process(tmp_path, capsys):
    """Three schedules, two rounds: six rows, each the Program that ran (its hash is the fingerprint of the
    schedule's Program), interleaved whatever their host layout (lean's differs: the store is taken over in
    place), each row saying its layout."""
    out = tmp_path / "cmp"
    assert main(["compare", "--model", "debug", "--batch", "2", "--seq", "16", "--schedule", "overlap,arrival,lean",
                 "--rounds", "2", "--steps", "3", "--device", "cpu", "--profile", "cpu", "--no-plots",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 host layout(s)" in text and "min_ms" in text and "median over 2 rounds" in text
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [(r["config"], r["round"], r["layout_group"]) for r in rows] == [
        ("overlap", 0, 0), ("arrival", 0, 0), ("lean", 0, 1), ("overlap", 1, 0), ("arrival", 1, 0), ("lean", 1, 1)]
    for r in rows:
        knobs = knobs_for(r["config"])
        assert r["program_hash"] == lower(build_schedule(DEBUG, 2, 16, knobs)).fingerprint(), r["config"]
        assert r["steps"] == 2 and r["predicted_step_s[cpu]"] > 0 and r["record"]["knobs"] == knobs.to_dict()
    timelines = pd.read_csv(out / "timelines.csv.gz")
    assert timelines.groupby(["config", "round"])["timed_step"].nunique().tolist() == [2] * 6
    for name in ("overlap", "arrival", "lean"):
        summary = json.loads((out / name / "compare.json").read_text())
        assert len(summary["measured_steps_s"]) == 2  # the median round's timed steps
    rank = json.loads((out / "ranking.json").read_text())
    assert rank["rounds"] == 2 and [r["variant"] for r in rank["rows"]] == ["overlap", "arrival", "lean"]
    assert all(r["min_s"] <= r["meas_step_s"] <= r["max_s"] for r in rank["rows"])


def test_compare_can_measure_its_own_profile(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--model", "debug", "--batch", "2", "--seq", "16", "--set", "compute_dtype=fp32",
                 "--steps", "2", "--device", "cpu", "--measure-profile", "--quick", "--no-plots",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measurements, about" in text and "step time (ms)" in text
    assert load_profile(out / "profile.json").compute_tables[0].dtype == "fp32"
    assert not list(out.rglob("gantt.png"))


@pytest.mark.parametrize("argv, message", [
    (["--steps", "1"], "at least 2 steps"),
    (["--profile", "nope"], "no hardware profile 'nope'"),
    (["--schedule", "nope"], "unknown schedule"),
])
def test_compare_user_errors_are_one_line(argv, message, capsys, tmp_path):
    assert main(["compare", "--model", "debug", "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
