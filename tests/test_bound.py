"""The physical bound of a step (sim/bound.py): hand-computed on a tiny Program under profiles that make each
resource bind in turn, never above a simulated step of any named schedule, and printed by simulate and compare."""
import json
import math

import pandas as pd
import pytest

from megatrain.cli import main
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import NAMED_SCHEDULES, knobs_for
from megatrain.compile.lower import lower
from megatrain.ir.facts import StepFacts
from megatrain.model.presets import PRESETS
from megatrain.profiling.compare import compare
from megatrain.sim import CopyCurve, HardwareProfile, simulate, step_bound

DEBUG = PRESETS["debug"]  # hidden 64, ffn 160, 4 heads x 16, 2 kv heads, vocab 256, 4 layers, untied: 205,376 params

# By hand, for `overlap` on batch 2 x seq 32 (64 tokens, one micro-batch, bf16 compute, bf16 weight wire, fp32
# gradient wire, fp32 state):
# - a layer's forward: 2 FLOPs per weight per token over q 64x64, k and v 64x32, o 64x64 and the MLP 3 x 64x160
#   (43,008 weights), plus causal attention 2 x seq^2 x hidden per sequence; each layer runs F (1 forward) and
#   B (recompute + backward: 3 forwards); the head's fused F is 3 forwards of 2 x 64 x 256 per token; the embedding
#   has no FLOPs.
LAYER_FWD = 64 * 2 * 43_008 + 2 * (2 * 32**2 * 64)
FLOPS = 4 * 4 * LAYER_FWD + 3 * (64 * 2 * 64 * 256)
# - host memory: every parameter updated once on the host, 28 B of AdamW + 6 B for the bf16 refresh of the
#   streaming copy; every copied byte drawn once (DMA). H2D: the bf16 weights once, layer 0's again for its
#   backward; D2H: every fp32 gradient once.
PARAMS = 205_376
H2D_BYTES = 2 * PARAMS + 2 * 43_136
D2H_BYTES = 4 * PARAMS
HOST_BYTES = PARAMS * (28 + 6) + H2D_BYTES + D2H_BYTES


def hand_profile(matmul: float, host: float, h2d: float, d2h: float, **more) -> HardwareProfile:
    return HardwareProfile("hand", CopyCurve.constant(h2d, latency_s=1e-6), CopyCurve.constant(d2h, latency_s=1e-6),
                           matmul_flops_per_s={"bf16": matmul, "fp32": matmul}, host_memory_Bps=host,
                           efficiency={"layer": 0.5, "embed": 0.5, "head": 0.5}, **more)


@pytest.fixture(scope="module")
def overlap():
    return lower(build_schedule(DEBUG, 2, 32, knobs_for("overlap")))


@pytest.mark.parametrize("rates, binds", [
    ((1e9, 1e12, 1e10, 1e10), "compute"),
    ((1e15, 1e8, 1e10, 1e10), "host memory"),
    ((1e15, 1e12, 1e6, 1e8), "h2d"),
    ((1e15, 1e12, 1e8, 1e6), "d2h"),
])
def test_hand_computed_bound_each_resource_binding_in_turn(overlap, rates, binds):
    matmul, host, h2d, d2h = rates
    b = step_bound(overlap, hand_profile(*rates))
    assert b.compute_s == pytest.approx(FLOPS / matmul)  # the matmul rate, not rate x efficiency
    assert b.host_memory_s == pytest.approx(HOST_BYTES / host)
    assert b.h2d_s == pytest.approx(H2D_BYTES / h2d)  # latencies left out
    assert b.d2h_s == pytest.approx(D2H_BYTES / d2h)
    assert b.binding == binds
    assert b.bound_s == max(b.compute_s, b.host_memory_s, b.h2d_s, b.d2h_s)
    assert b.efficiency(2 * b.bound_s) == pytest.approx(0.5) and b.efficiency(0.0) == 0.0
    line = b.describe()
    assert f"({binds} binds)" in line and "\n" not in line and f"{1e3 * b.bound_s:.2f} ms" in line
    fields = b.to_dict()
    assert fields["bound_binds"] == binds and fields["bound_s"] == b.bound_s and fields["bound_h2d_s"] == b.h2d_s


def test_copy_draw_and_conversion_passes_count_in_host_memory(overlap):
    # The CPU backend's memcpy reads and writes host memory (2 B per byte copied); a bf16 gradient wire adds a
    # conversion pass (6 B/param) to every update.
    p = hand_profile(1e15, 1e8, 1e10, 1e10, copy_host_bytes_per_byte=2.0)
    assert step_bound(overlap, p).host_memory_s == pytest.approx((HOST_BYTES + H2D_BYTES + D2H_BYTES) / 1e8)
    bf16 = lower(build_schedule(DEBUG, 2, 32, knobs_for("overlap", grad_wire="bf16")))
    assert step_bound(bf16, hand_profile(1e15, 1e8, 1e10, 1e10)).host_memory_s == pytest.approx(
        (PARAMS * (28 + 12) + H2D_BYTES + D2H_BYTES / 2) / 1e8)
    # A GPU update moves no host-memory update bytes, only its state's copies (gpu-adam keeps the embedding's and
    # the head's updates on the host: 16,384 + 16,448 params).
    gpu = lower(build_schedule(DEBUG, 2, 32, knobs_for("gpu-adam")))
    assert sorted(t.params for t in gpu.tasks.values() if t.kind == "U" and t.stream == "cpu") == [16_384, 16_448]
    b = step_bound(gpu, hand_profile(1e15, 1e8, 1e10, 1e10))
    copied = sum(t.bytes for t in gpu.tasks.values() if t.stream in ("h2d", "d2h"))
    assert b.host_memory_s == pytest.approx((copied + (16_384 + 16_448) * 34) / 1e8)


def test_a_profile_without_the_matmul_rate_is_refused(overlap):
    p = hand_profile(1e12, 1e12, 1e10, 1e10).with_(matmul_flops_per_s={"fp32": 1e12})
    with pytest.raises(Exception, match="no matmul rate for compute dtype 'bf16'"):
        step_bound(overlap, p)


@pytest.mark.parametrize("profile", ["h200-measured", "h200"])
def test_no_named_schedule_is_predicted_faster_than_its_bound(profile):
    """bench-3b 8 x 2048: every resource is within a factor ~2 of the step, so a simulator that ran a task faster
    than its rate alone (or a bound that counted too much) fails here. Clipping steps too: their updates move
    the same bytes."""
    spec = PRESETS["bench-3b"]
    for name in NAMED_SCHEDULES:
        prog = lower(build_schedule(spec, 8, 2048, knobs_for(name)))
        for facts in (StepFacts(), StepFacts(clip_share=1.0)):
            r = simulate(prog, profile, facts)
            b = step_bound(prog, profile, facts)
            assert b.bound_s > 0.25 * r.step_s, (name, b.describe())  # the check has teeth: the bound is not tiny
            assert r.step_s >= b.bound_s, f"{name} on {profile}: step {r.step_s:.4f} s < {b.describe()}"
            assert r.bound == b  # SimResult.bound: the same, on the profile one rank sees


def test_data_parallel_ranks_share_host_memory():
    prog = lower(build_schedule(DEBUG, 2, 32, knobs_for("overlap"), world=2))
    one = lower(build_schedule(DEBUG, 2, 32, knobs_for("overlap")))
    import megatrain.parallel  # noqa: F401  (registers the collective strategies' rank profiles)
    p = hand_profile(1e15, 1e8, 1e10, 1e10)
    # two ranks on one host each see half its memory bandwidth, and each updates half the parameters
    assert step_bound(prog, p).host_memory_s > step_bound(one, p).host_memory_s / 2
    assert simulate(prog, p).bound == step_bound(prog, p)


def test_simulate_prints_the_limit_and_writes_its_fields(tmp_path, capsys):
    path = tmp_path / "hand.json"
    hand_profile(1e15, 1e8, 1e10, 1e10).save(path)
    out = tmp_path / "out"
    rc = main(["simulate", "--model", "debug", "--batch", "2", "--seq", "32", "--schedule", "overlap",
               "--profile", str(path), "--no-plots", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    b = step_bound(lower(build_schedule(DEBUG, 2, 32, knobs_for("overlap"))), str(path))
    limit = [line for line in text.splitlines() if line.startswith("limit: ")]
    assert len(limit) == 1 and "(host memory binds)" in limit[0] and "efficiency" in limit[0]
    assert f"{1e3 * b.bound_s:.2f}" in limit[0]
    row = pd.read_csv(out / "comparison.csv").iloc[0]
    assert row["bound_s"] == pytest.approx(b.bound_s) and row["bound_binds"] == "host memory"
    assert row["efficiency"] == pytest.approx(b.bound_s / row["step_s"])
    assert row["bound_host_memory_s"] == pytest.approx(HOST_BYTES / 1e8)
    summary = json.loads((out / "overlap" / "summary.json").read_text())
    assert summary["bound_s"] == pytest.approx(b.bound_s) and summary["bound_binds"] == "host memory"
    header = text.splitlines()[1]
    assert "bound ms" in header and "binds" in header and "eff %" in header


def test_compare_reports_the_efficiency_of_predicted_and_measured(tmp_path):
    # "Measured" = the prediction with every task twice as long: its efficiency is half the predicted one.
    p = hand_profile(1e11, 1e9, 1e9, 1e9)
    prog = lower(build_schedule(DEBUG, 2, 32, knobs_for("overlap", compute_dtype="fp32")))
    tl = simulate(prog, p).timeline
    steps = []
    for k in range(3):
        s = tl.copy()
        s["start_s"], s["end_s"], s["source"], s["step"] = 2 * s["start_s"] + k, 2 * s["end_s"] + k, "measured", k
        steps.append(s)
    c = compare(prog, steps, p)
    b = step_bound(prog, p)
    h = c.headline()
    assert h["bound_s"] == pytest.approx(b.bound_s) and h["bound_binds"] == b.binding
    assert h["pred_efficiency"] == pytest.approx(b.bound_s / c.pred_summary.step_s)
    assert h["meas_efficiency"] == pytest.approx(h["pred_efficiency"] / 2)
    text = c.report()
    assert f"predicted {100 * h['pred_efficiency']:.0f}%, measured {100 * h['meas_efficiency']:.0f}%" in text
    saved = json.loads(c.write(tmp_path, plots=False)["summary"].read_text())
    assert saved["headline"]["bound_s"] == pytest.approx(b.bound_s)
    assert math.isfinite(saved["headline"]["meas_efficiency"])
