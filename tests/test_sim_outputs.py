"""What people look at: step summaries of any Timeline, Chrome trace, Gantt chart, `megatrain simulate`."""
import json

import pandas as pd
import pytest

from megatrain.analysis.summary import (
    critical_path,
    gpu_memory_curve,
    idle_gaps,
    summarize,
)
from megatrain.analysis.viz import chrome_trace, gantt, write_chrome_trace
from megatrain.cli import main
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.ir.program import STREAMS
from megatrain.compile.lower import lower
from megatrain.model.presets import PRESETS
from megatrain.sim import simulate

DEBUG = PRESETS["debug"]


@pytest.fixture(scope="module")
def sim():
    prog = lower(build_schedule(DEBUG, 4, 16, knobs_for("overlap", micro_batches=2)))
    return simulate(prog, "cpu")


def as_measured(tl: pd.DataFrame, steps=3, offset=0.25) -> pd.DataFrame:
    """The same step repeated, shifted in time, labelled measured: what an executor's timeline looks like."""
    parts = []
    for k in range(steps):
        part = tl.copy()
        part["start_s"] += offset + k * (tl["end_s"].max() + 0.1)
        part["end_s"] += offset + k * (tl["end_s"].max() + 0.1)
        part["step"] = k
        part["source"] = "measured"
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def test_summary_of_a_measured_multi_step_timeline_matches_its_step(sim):
    measured = as_measured(sim.timeline)
    a, b = sim.summary.to_dict(), summarize(measured, sim.program).to_dict()
    assert b.pop("source") == "measured" and a.pop("source") == "predicted"
    assert b.pop("step_s") == pytest.approx(a.pop("step_s"), rel=1e-9)
    for key in ("tokens_per_s", "model_tflops", "gpu_busy_frac", "h2d_GBps"):
        assert b.pop(key) == pytest.approx(a.pop(key), rel=1e-9)
    assert b["critical_path"] == a["critical_path"] and b["wait_s"] == pytest.approx(a["wait_s"], abs=1e-9)
    with pytest.raises(ValueError, match="no step 7"):
        summarize(measured, sim.program, step=7)


def test_summary_numbers_are_consistent(sim):
    s, tl = sim.summary, sim.timeline
    assert s.step_s == tl["end_s"].max()
    assert s.tokens_per_s == pytest.approx(4 * 16 / s.step_s)
    assert s.model_tflops == pytest.approx(6 * DEBUG.num_params * 64 / s.step_s / 1e12)
    assert s.gpu_busy_frac + s.gpu_idle_frac == pytest.approx(1.0)
    # GPU idle time is fully explained by the causes; the critical path spans the whole step.
    assert sum(s.wait_s.values()) == pytest.approx(s.step_s * s.gpu_idle_frac, rel=1e-9)
    path = critical_path(tl, sim.program)
    assert path["start_s"].iloc[0] == 0.0 and path["end_s"].iloc[-1] == pytest.approx(s.step_s)
    assert (path["start_s"].iloc[1:].values == pytest.approx(path["end_s"].iloc[:-1].values))
    gaps = idle_gaps(tl, sim.program)
    assert set(gaps["cause"]) <= {"weights", "optimizer", "gradients", "other"}
    assert s.h2d_GBps == pytest.approx(tl.loc[tl.stream == "h2d", "bytes"].sum() / s.step_s / 1e9)


@pytest.mark.parametrize("knobs", [knobs_for("overlap", micro_batches=2),
                                   knobs_for("overlap", recompute_block=2, buffers=3),
                                   knobs_for("serial")])
def test_memory_curve_peaks_at_the_plans_peak(knobs):
    prog = lower(build_schedule(DEBUG, 4, 16, knobs))
    curve = gpu_memory_curve(simulate(prog, "h200").timeline, prog)
    whole_step = prog.memory.buffers_bytes + prog.memory.rope_bytes  # buffers and RoPE tables
    assert curve["bytes"].iloc[0] == whole_step
    assert curve["bytes"].max() == prog.memory.peak_bytes
    assert curve["bytes"].iloc[-1] == whole_step  # every checkpoint freed by its backward


def test_chrome_trace_is_valid_and_has_one_process_per_source(sim, tmp_path):
    measured = as_measured(sim.timeline, steps=2)
    path = write_chrome_trace(tmp_path / "trace.json", [sim.timeline, measured], sim.program)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "predicted", 2: "measured"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(threads.values()) == sorted(STREAMS * 2)
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 3 * len(sim.timeline)
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0 and threads[e["pid"], e["tid"]] == sim.program.tasks[e["name"]].stream
    f0 = next(e for e in spans if e["name"] == "F0.1" and e["pid"] == 1)
    row = sim.timeline.set_index("task").loc["F0.1"]
    assert f0["ts"] == pytest.approx(row.start_s * 1e6) and f0["args"]["micro"] == 1 and f0["args"]["layer"] == 0
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {1, 2}
    assert max(e["args"]["bytes"] for e in counters) == sim.program.memory.peak_bytes
    # Without the Program there is nothing to count.
    assert not [e for e in chrome_trace(sim.timeline)["traceEvents"] if e["ph"] == "C"]


def test_gantt_png_for_one_timeline_and_a_pair(sim, tmp_path):
    gantt(sim.timeline, tmp_path / "one.png", title="overlap")
    measured = as_measured(sim.timeline, steps=1, offset=0.0)
    fig = gantt({"predicted": sim.timeline, "measured": measured}, tmp_path / "pair.png", layout="side")
    assert len(fig.axes) == 2
    fig = gantt([sim.timeline, measured], tmp_path / "stacked.png")
    assert len(fig.axes[0].get_yticks()) == 2 * len(STREAMS)
    for name in ("one.png", "pair.png", "stacked.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="layout"):
        gantt(sim.timeline, layout="diagonal")


def test_cli_simulate_sweep_writes_artefacts_and_table(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["simulate", "--model", "debug", "--batch", "4", "--seq", "16", "--profile", "cpu",
               "--schedule", "overlap", "--sweep", "buffers=1,2", "--sweep", "optimizer=after,overlap",
               "--set", "micro_batches=2", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["schedule", "knobs", "step", "ms"]  # fastest first (tests/test_cli_basics.py)
    assert {tuple(line.split()[:2]) for line in lines[2:6]} == {
        ("overlap[micro_batches=2]", f"buffers={b},optimizer={o}") for b in (1, 2) for o in ("after", "overlap")}
    table = pd.read_csv(out / "comparison.csv")
    assert len(table) == 4 and (table["step_s"] > 0).all()
    assert list(table["knobs"]) == [f"buffers={b},optimizer={o}" for b in (1, 2) for o in ("after", "overlap")]
    d = out / "overlap_micro_batches-2_buffers-2_optimizer-overlap"
    for name in ("timeline_sim.csv", "timeline_sim.json", "trace.json", "gantt.png", "summary.json",
                 "config.json"):
        assert (d / name).is_file(), name
    config = json.loads((d / "config.json").read_text())
    assert config["knobs"]["buffers"] == 2 and config["knobs"]["micro_batches"] == 2
    tl = pd.read_csv(d / "timeline_sim.csv")
    assert len(tl) == len(json.loads((d / "timeline_sim.json").read_text()))
    summary = json.loads((d / "summary.json").read_text())
    assert summary["step_s"] == pytest.approx(table.loc[3, "step_s"])


def test_cli_simulate_toml_schedule_and_errors(tmp_path, capsys):
    toml = tmp_path / "mine.toml"
    toml.write_text('[schedule]\nname = "overlap"\nbuffers = 2\n')
    rc = main(["simulate", "--model", "debug", "--batch", "2", "--seq", "16", "--schedule", str(toml),
               "--no-plots", "--out", str(tmp_path / "o")])
    assert rc == 0 and "mine" in capsys.readouterr().out
    assert not (tmp_path / "o" / "mine" / "gantt.png").exists()
    assert main(["simulate", "--model", "debug", "--profile", "h100", "--out", str(tmp_path / "x")]) == 2
    assert "no hardware profile 'h100'" in capsys.readouterr().err
    assert main(["simulate", "--model", "debug", "--sweep", "buffers", "--out", str(tmp_path / "x")]) == 2
    assert "is not knob=v1,v2" in capsys.readouterr().err
    # A sweep value that cannot build is reported in its row; the others still run.
    rc = main(["simulate", "--model", "debug", "--batch", "4", "--seq", "16", "--sweep", "micro_batches=2,3",
               "--no-plots", "--out", str(tmp_path / "y")])
    assert rc == 0 and "skipped: batch 4 does not split into micro_batches=3" in capsys.readouterr().out


def test_a_96_layer_step_with_8_micro_batches_simulates():
    """Its speed (target < 1 s on the 2-core CI machine) is measured by scripts/sim_speed.py, a benchmark, not
    asserted here: a loaded machine must not fail the suite."""
    prog = lower(build_schedule(PRESETS["dense-120b"], 8, 2048, knobs_for("overlap", micro_batches=8)))
    res = simulate(prog, "h200")
    assert len(res.timeline) == len(prog.tasks) > 1500
