"""`megatrain profile` at the runtime's operating point (issue 24 item 2): the copies measured are the runtime's (a
layer's PREFETCH and OFFLOAD bytes, from the host store's pinned tiles), the update measured is the runtime's own
task body at its threads, and the profile takes its copy points, duplex cap, host fit and CPU rate from them.

Timings on a shared 2-core machine are noise: these tests check what was measured (sizes, code path, structure,
positivity) and how the profile is built from it, never how two timings compare."""
import math
import statistics

import pytest
import torch

from megatrain.compile.knobs import knobs_for
from megatrain.exec.backend import get_backend
from megatrain.exec.updates import Updates
from megatrain.model.presets import PRESETS
from megatrain.profiling import ProfileRequest, measure_profile
from megatrain.profiling.assemble import _update_slowdown, in_step_cpu_rate, operating_cpu_rate
from megatrain.profiling.bench import Worker
from megatrain.profiling.copies import with_point
from megatrain.profiling.operating import RuntimeCut, conversion_passes, measure_operating_point
from megatrain.profiling import units as units_module
from megatrain.profiling.units import layer_variants, measure_unit, run_batches
from megatrain.sim import load_profile
from megatrain.sim.profile import CopyCurve

DEBUG = PRESETS["debug"]
WIRES = {"bf16 weights, fp32 grads": knobs_for("overlap", compute_dtype="fp32"),
         "bf16 weights, bf16 grads": knobs_for("overlap", compute_dtype="fp32", grad_wire="bf16"),
         "fp32 weights": knobs_for("overlap", compute_dtype="fp32", weight_wire="fp32"),
         # a run's 4 resident layers on the 2-layer cut: one stays resident, layer 1 streams and is measured
         "resident layers": knobs_for("arrival-resident", compute_dtype="fp32", resident_layers=4)}


@pytest.mark.parametrize("wires", list(WIRES))
def test_the_copies_measured_are_the_runtimes_prefetch_and_offload(wires):
    knobs = WIRES[wires]
    cut = RuntimeCut(DEBUG, 2, 16, knobs, get_backend("cpu"))
    tasks = cut.program.tasks
    assert cut.unit == (1 if knobs.resident_layers else 0) and cut.program.placement.unit(cut.unit).resident is False
    # The bytes of the Program's PREFETCH and OFFLOAD of a layer: what the runtime copies, in its wire dtypes.
    assert cut.weight_bytes == tasks[f"P{cut.unit}"].bytes and cut.grad_bytes == tasks[f"O{cut.unit}"].bytes
    assert cut.params == tasks[f"U{cut.unit}"].params
    # From the host store's own tiles (the streaming copy, or the master on an fp32 wire; the landing tile).
    sources = [src for _, src in cut._in]
    assert [s.data_ptr() for s in sources] == [s.data_ptr() for _, s in cut.store.stream_segments(cut.unit)]
    assert cut.landing.data_ptr() == cut.store.grad(cut.unit).data_ptr() and cut.landing.dtype == cut.store.grad_dtype
    cut.copy_in()
    cut.copy_out()
    assert torch.equal(cut.weights[:sources[0].numel()].float(), sources[0].float())
    assert torch.allclose(cut.landing.float(), torch.full_like(cut.landing, 1e-3).float())
    lay = cut.store.layout
    assert cut.passes == conversion_passes(cut.store) == ((lay.weight_wire == "bf16") + (lay.grad_wire == "bf16"))


def test_the_update_measured_is_the_runtimes_own_task_body(monkeypatch):
    calls = {"update": 0, "clip_redo": 0}
    for name in calls:
        real = getattr(Updates, name)

        def spy(self, t, real=real, name=name):
            calls[name] += 1
            assert t.unit == 0 and t.stream == "cpu"
            return real(self, t)
        monkeypatch.setattr(Updates, name, spy)
    backend = get_backend("cpu")
    w = {s: Worker(backend, s) for s in ("h2d", "d2h", "cpu")}
    try:
        rec = measure_operating_point(DEBUG, 2, 16, WIRES["bf16 weights, fp32 grads"], backend, w, 1, 0.05, True)
    finally:
        for wk in w.values():
            wk.close()
    assert calls["update"] > 0 and calls["clip_redo"] > 0
    assert rec["update_path"] == "exec.updates.Updates.update" and rec["redo_path"] == "exec.updates.Updates.clip_redo"
    c, k = rec["copies"], rec["contention"]
    for key in ("h2d_alone_s", "d2h_alone_s", "h2d_shared_s", "d2h_shared_s", "duplex_Bps"):
        assert 0 < c[key] < math.inf, key
    assert c["duplex_Bps"] == pytest.approx(c["h2d_shared_Bps"] + c["d2h_shared_Bps"])
    for key in ("update_alone_s", "update_h2d_s", "update_d2h_s", "update_both_s", "h2d_update_Bps",
                "d2h_update_Bps", "h2d_both_Bps", "d2h_both_Bps"):
        assert 0 < k[key] < math.inf, key
    assert (k["copy_bytes"], k["copy_out_bytes"]) == (rec["weight_bytes"], rec["grad_bytes"])
    for mix in ("alone", "h2d", "d2h", "both"):  # each mix's least disturbed round, and every round recorded
        rounds = k[f"update_{mix}_rounds_s"]
        assert len(rounds) == k["rounds"] and k[f"update_{mix}_s"] == min(rounds)
    assert k["threads"] == rec["threads"] == 1 and k["params"] == rec["params"] and k["source"] == "operating point"
    assert rec["redo_s"] > 0 and rec["redo_over_update"] > 0


def test_a_measured_copy_becomes_a_point_of_the_curve():
    curve = CopyCurve((4096, 1 << 20, 1 << 26), (10e9, 20e9, 25e9), 10e-6)
    n, t = 3 << 20, 200e-6
    c = with_point(curve, n, t)
    assert n in c.sizes_bytes and c.duration(n) == pytest.approx(t, rel=1e-12) and c.latency_s == curve.latency_s
    assert c.duration(1 << 26) == curve.duration(1 << 26)  # the other points stay
    assert with_point(c, n, 2 * t).duration(n) == pytest.approx(2 * t)  # a size measured again: replaced
    assert with_point(curve, 4096, 15e-6) is curve  # mostly latency: nothing to learn about the rate


def test_layer_tables_at_the_runs_micro_batch_and_eager_beside_compiled():
    assert run_batches([1, 8], knobs_for("overlap", micro_batches=4)) == [1, 2, 8]
    assert run_batches([1, 8], knobs_for("overlap")) == [1, 8]
    compiled = knobs_for("overlap", compile_layers=True)
    assert layer_variants("layer", compiled) == [False, True] and layer_variants("head", compiled) == [False]
    assert layer_variants("layer", knobs_for("overlap")) == [False]
    backend = get_backend("cpu")
    w = Worker(backend, "compute")
    try:
        tables, raw = measure_unit(DEBUG, "layer", knobs_for("overlap", compute_dtype="fp32", micro_batches=2), 16,
                                   [1, 4], backend, w, 0.05)
    finally:
        w.close()
    assert {t.tokens for t in tables} == {(16, 32, 64)} and all(not t.compiled for t in tables)
    assert all(d > 0 for t in tables for d in t.dur_s) and len(raw) == 9


def test_a_quick_profile_compiles_the_layer_at_the_runs_micro_batch_only(monkeypatch):
    """torch.compile builds kernels per shape (dynamic=False): a quick profile measures the compiled layer at the
    one token count the run's tasks have, and the eager layer at every size."""
    measured = []

    def variant(spec, uclass, knobs, seq, batches, backend, worker, budget_s):
        measured.append((knobs.compile_layers, list(batches)))
        return [], []
    monkeypatch.setattr(units_module, "_measure_variant", variant)
    knobs = knobs_for("overlap", compile_layers=True, micro_batches=2)
    measure_unit(DEBUG, "layer", knobs, 16, [1, 8], None, None, 0.05, quick=True)
    assert measured == [(False, [1, 4, 8]), (True, [4])]
    measured.clear()
    measure_unit(DEBUG, "layer", knobs, 16, [1, 8], None, None, 0.05)
    assert measured == [(False, [1, 4, 8]), (True, [1, 4, 8])]


@pytest.fixture(scope="module")
def calibration():
    req = ProfileRequest(DEBUG, batch=2, seqs=[16], device="cpu", dtypes=["fp32"], quick=True,
                         knobs=knobs_for("overlap", compute_dtype="fp32", grad_wire="bf16"))
    return measure_profile(req, log=lambda _: None)


def test_the_profile_is_built_from_the_operating_point(calibration):
    p, m = calibration.profile, calibration.measurements
    op = m["operating_point"]
    assert m["host_contention"] is op["contention"] and op["passes"] == 2  # bf16 refresh + bf16 gradients
    assert p.duplex_Bps == pytest.approx(op["copies"]["duplex_Bps"])
    for curve, nbytes, key in ((p.h2d, op["weight_bytes"], "h2d_alone_s"), (p.d2h, op["grad_bytes"], "d2h_alone_s")):
        t = op["copies"][key]
        if t > 2 * curve.latency_s:  # a copy that is not all latency is a point of the curve, at the runtime's size
            assert nbytes in curve.sizes_bytes and curve.duration(nbytes) == pytest.approx(t, rel=1e-9)
    # the rate at the runtime's threads: the median of its three estimates, the runtime's own update at the
    # operating point (conversion passes taken out), the isolated loop and the profiler's real steps
    rate = operating_cpu_rate(op, m["cpu_adam"]["fixed_s"], p.cpu_convert_params_per_s)
    loop = {int(t): r for t, r in m["cpu_adam"]["by_threads"].items()}[p.cpu_threads]
    in_step = in_step_cpu_rate(m, _update_slowdown(m), p.cpu_convert_params_per_s)
    known = sorted(r for r in (rate, loop, in_step) if r)
    assert p.cpu_adam_rate() == pytest.approx(statistics.median(known), rel=1e-9)
    assert "the median of the estimates" in p.notes["cpu_adam_params_per_s"]
    # The update at the other weight wire too (fp32: one conversion pass fewer), and the host fields fitted to both.
    other = op["contention_other"]
    assert other["weight_wire"] == "fp32" and other["passes"] == op["passes"] - 1 and other["params"] == op["params"]
    wires = m["host_fit_wires"]
    assert (p.host_memory_Bps, p.cpu_update_bytes_per_param, p.cpu_convert_bytes_per_param) == pytest.approx(
        (wires["host_memory_Bps"], wires["cpu_update_bytes_per_param"], wires["cpu_convert_bytes_per_param"]))
    extra_s = op["contention"]["update_alone_s"] - other["update_alone_s"]
    if extra_s > 0:  # the conversion pass alone: the two updates' difference, which the simulator adds back
        assert p.cpu_convert_params_per_s == pytest.approx(op["params"] / extra_s, rel=1e-9)
    else:  # no difference to take (a noisy host): the isolated refresh loop's rate
        assert p.cpu_convert_params_per_s == m["cpu_refresh"]["rate"]
    assert "both weight wires" in p.notes["host_memory_Bps"]
    # the copies beside the update, as the host fit assumed them: each direction's measured rate beside the
    # update (and beside it and the other direction) over its rate alone, the mean of the two wires' records
    recs = (op["contention"], other)
    for key, rate, alone in (("h2d", "h2d_update_Bps", "h2d_alone_Bps"),
                             ("d2h", "d2h_update_Bps", "d2h_alone_Bps"),
                             ("h2d_both", "h2d_both_Bps", "h2d_alone_Bps"),
                             ("d2h_both", "d2h_both_Bps", "d2h_alone_Bps")):
        mean = sum(c[rate] / c[alone] for c in recs) / 2
        assert p.copy_beside_update[key] == pytest.approx(min(1.0, max(0.05, mean)), rel=1e-12)
    assert "beside the runtime's update" in p.notes["copy_beside_update"]
    # the clipping redo of a device unit (undo + update) measured in updates, no longer the default of 2
    assert p.clip_redo_updates == pytest.approx(m["gpu_adam"]["redo_updates"]) and p.clip_redo_updates > 1.0
    assert m["gpu_adam"]["redo_s"] > 0 and "measured" in p.notes["clip_redo_updates"]
    assert "Updates.update" in p.notes["operating point"] and "redo" in p.notes["operating point"]
    assert "operating point" in p.notes["duplex_Bps"]


def test_profiles_written_before_the_operating_point_still_load():
    p = load_profile("h200-measured")
    assert p.duplex_Bps > 0 and p.h2d.rate(1 << 28) > 0


def test_the_fallback_efficiency_is_fitted_on_the_variant_the_run_asks_for():
    from megatrain.profiling.assemble import _efficiency
    from megatrain.sim.profile import ComputeTable, model_signature

    sig = model_signature(DEBUG)

    def tables(compiled, scale, seq=16):
        return [ComputeTable(sig, k, "layer", seq, (64,), (scale * (2 if k == "B" else 1),), "fp32", compiled)
                for k in ("F", "B")]
    m = {"matmul_flops_per_s": {"fp32": 1e12}}
    eager, compiled = tables(False, 1e-3), tables(True, 0.5e-3)
    both = _efficiency(m, DEBUG, eager + compiled, "fp32", compiled=True)["layer"]
    assert both == _efficiency(m, DEBUG, compiled, "fp32", compiled=True)["layer"] != 1.0
    assert _efficiency(m, DEBUG, eager + compiled, "fp32")["layer"] == _efficiency(m, DEBUG, eager, "fp32")["layer"]
    # several sequence lengths: the longest one's tables (a fit was skipped altogether before)
    assert _efficiency(m, DEBUG, eager + tables(False, 1e-3, seq=8), "fp32")["layer"] != 1.0


def test_the_cut_measured_keeps_the_layer_and_drops_a_large_vocabulary():
    """Only a decoder layer is measured: a 128 K vocabulary's embedding and head (llama3-8b) would have been most
    of the cut's store and of the measurement's time, so the cut has CUT_VOCAB tokens, and the same layer."""
    from dataclasses import replace

    from megatrain.model.layout import unit_layout
    from megatrain.profiling.operating import CUT_VOCAB

    spec = replace(DEBUG, vocab_size=4 * CUT_VOCAB)
    cut = RuntimeCut(spec, 2, 16, WIRES["bf16 weights, fp32 grads"], get_backend("cpu"))
    assert cut.cut.vocab_size == CUT_VOCAB and cut.cut.hidden_size == spec.hidden_size
    assert cut.params == unit_layout(spec, cut.unit).numel  # the measured layer is the model's own
    assert cut.store.master(cut.unit).numel() == cut.params
    small = RuntimeCut(DEBUG, 2, 16, WIRES["bf16 weights, fp32 grads"], get_backend("cpu"))
    assert small.cut.vocab_size == DEBUG.vocab_size  # a small vocabulary is kept as it is


def test_a_compute_task_that_slows_under_sustained_load_is_measured_so():
    """measure_compute_sustained: a body that keeps its speed for its first calls (the bursts the compute tables
    time) and then runs 10x slower, as a device whose clocks fall under load would, shows a factor well above 1; one
    of constant speed does not. Sleeps are the bodies: a 1 ms sleep may overrun on a loaded machine, not by 9 ms."""
    import time

    from megatrain.profiling.rates import measure_compute_sustained

    calls = {"F": 0}

    def tiring():
        calls["F"] += 1
        time.sleep(0.001 if calls["F"] <= 12 else 0.010)

    w = Worker(get_backend("cpu"), "compute")
    try:
        r = measure_compute_sustained(w, {"F": tiring, "B": lambda: time.sleep(0.001)}, budget_s=0.1, block=4)
    finally:
        w.close()
    assert set(r) == {"F", "B"} and r["F"]["calls"] == r["B"]["calls"] and r["F"]["calls"] % 4 == 0
    assert r["F"]["calls"] >= 4  # at least one cycle after the first, which is left out
    assert r["F"]["burst_s"] < 0.005 and r["F"]["sustained_s"] >= 0.010 and r["F"]["factor"] > 2.0
    assert r["B"]["sustained_s"] < 0.009  # constant speed: no such factor


def test_the_layer_tables_take_the_back_to_back_factor_and_nothing_else_does():
    """sustained_factors / scale_layer_tables: the factor is the back-to-back time over the table of the run's
    variant at the profiled tokens (R takes F's; below 1 is noise and kept at 1); it scales the profiled model's
    layer tables of that dtype, eager and compiled, every sequence length, and no embedding, head, other dtype or
    other model's table; measurements without it scale nothing."""
    from megatrain.profiling.assemble import scale_layer_tables, sustained_factors
    from megatrain.sim.profile import ComputeTable, model_signature

    sig = model_signature(DEBUG)

    def table(kind, unit="layer", compiled=False, seq=16, dtype="bf16", model=sig, dur=(1.0, 4.0)):
        return ComputeTable(model, kind, unit, seq, (16, 64), dur, dtype, compiled)

    tables = [table("F", compiled=True), table("B", compiled=True, dur=(2.0, 8.0)), table("R", compiled=True),
              table("F"), table("B", dur=(3.0, 9.0)), table("F", seq=32), table("F", unit="head"),
              table("F", dtype="fp32"), table("F", model="other")]
    m = {"compute_sustained": {"F": {"sustained_s": 5.0}, "B": {"sustained_s": 6.0}}}
    f = sustained_factors(m, tables, DEBUG, "bf16", 16, 64, compiled=True)
    assert f == {"F": 1.25, "R": 1.25, "B": 1.0}  # F 5 / 4; B 6 / 8 < 1: kept at 1
    eager = sustained_factors({"compute_sustained": {"F": {"sustained_s": 6.0}, "B": {"sustained_s": 10.8}}},
                              tables, DEBUG, "bf16", 16, 64, compiled=False)
    assert eager == pytest.approx({"F": 1.5, "R": 1.5, "B": 1.2})  # against the eager tables: 6 / 4, 10.8 / 9
    assert sustained_factors({}, tables, DEBUG, "bf16", 16, 64, compiled=True) == {}
    scaled = scale_layer_tables(tables, sig, "bf16", f)
    assert [t.dur_s for t in scaled] == [(1.25, 5.0), (2.0, 8.0), (1.25, 5.0), (1.25, 5.0), (3.0, 9.0), (1.25, 5.0),
                                         (1.0, 4.0), (1.0, 4.0), (1.0, 4.0)]
