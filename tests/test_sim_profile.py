"""HardwareProfile: JSON round trip, shipped profiles, measured tables overriding the analytic fallback."""
import json
import math
import re

import pytest

from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.compile.lower import lower
from megatrain.model.presets import PRESETS
from megatrain.sim import (
    ComputeTable,
    CopyCurve,
    CostModel,
    HardwareProfile,
    ProfileError,
    load_profile,
    model_signature,
    shipped_profiles,
    simulate,
)

DEBUG = PRESETS["debug"]


def base_profile(**changes) -> HardwareProfile:
    p = HardwareProfile(
        name="t", h2d=CopyCurve((1024, 4096), (1e9, 3e9), latency_s=1e-5), d2h=CopyCurve.constant(2e9),
        duplex_Bps=2.5e9, matmul_flops_per_s={"bf16": 1e11, "fp32": 1e10},
        efficiency={"layer": 0.5, "embed": 1.0, "head": 0.25}, gpu_memory_Bps=1e10,
        cpu_adam_params_per_s={4: 1e8, 16: 2e8}, cpu_threads=16, gpu_adam_params_per_s=1e10,
        dma_factor_cpu_optimizer=0.9, task_overhead_s={"compute": 1e-4, "U": 2e-4},
    )
    return p.with_(**changes)


def test_json_round_trip_and_save(tmp_path):
    table = ComputeTable(model_signature(DEBUG), "F", "layer", 16, (32, 128), (1e-3, 3e-3))
    p = base_profile(compute_tables=(table,), notes={"h2d": "measured"}, cpu_optimizer_slowdown={2: 1.49})
    assert HardwareProfile.from_json(p.to_json()) == p
    p.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p
    assert load_profile(str(tmp_path / "p.json")) == p


@pytest.mark.parametrize("name", ["h200", "cpu"])
def test_shipped_profiles_load_and_document_their_numbers(name):
    assert name in shipped_profiles()
    p = load_profile(name)
    assert p.name == name
    for key in ("h2d", "d2h", "duplex_Bps", "matmul_flops_per_s", "cpu_adam_params_per_s", "task_overhead_s"):
        assert key in p.notes, f"{name}.json does not say where {key} comes from"


def test_h200_profile_carries_the_benchmark_numbers():
    p = load_profile("h200")
    assert p.h2d.rate(256 * 2**20) == pytest.approx(55e9, rel=0.01)
    assert p.d2h.rate(2**31) == pytest.approx(55.4e9, rel=1e-9)
    assert p.duplex_Bps == 100e9
    assert p.cpu_adam_rate() == 5.0e9 and p.gpu_adam_params_per_s == 121e9
    assert p.matmul_rate("bf16") == pytest.approx(795e12)


def test_copy_curve_interpolates_in_log_size_and_clamps():
    c = CopyCurve((1024, 4096), (1e9, 3e9), latency_s=1e-5)
    assert c.rate(2048) == pytest.approx(2e9)  # halfway in log2
    assert c.rate(10) == 1e9 and c.rate(1 << 30) == 3e9
    assert c.duration(2048) == pytest.approx(1e-5 + 2048 / 2e9)
    assert c.duration(0) == pytest.approx(1e-5)


def test_cpu_adam_rate_by_threads():
    p = base_profile()
    assert p.cpu_adam_rate() == 2e8
    assert p.cpu_adam_rate(10) == pytest.approx(1.5e8)  # linear between measured counts
    assert p.cpu_adam_rate(2) == pytest.approx(0.5e8)  # proportional below the smallest
    assert p.cpu_adam_rate(64) == 2e8  # flat above the largest


def test_analytic_fallback_and_overheads():
    prog = lower(build_schedule(DEBUG, 4, 16, "overlap"))
    p = base_profile()
    cost = CostModel(prog, p)
    f0, fh, fe, u0 = (prog.tasks[t] for t in ("F0.0", "FH.0", "FE.0", "U0"))
    assert cost.duration_s(f0) == pytest.approx(1e-4 + f0.flops / (1e11 * 0.5))
    assert cost.duration_s(fh) == pytest.approx(1e-4 + fh.flops / (1e11 * 0.25))
    assert cost.duration_s(fe) == pytest.approx(1e-4 + 64 * DEBUG.hidden_size * 8 / 1e10)  # memory bound
    assert cost.duration_s(u0) == pytest.approx(2e-4 + u0.params / 2e8)  # kind overrides stream (none here)
    fp32 = lower(build_schedule(DEBUG, 4, 16, knobs_for("overlap", compute_dtype="fp32")))
    assert CostModel(fp32, p).compute_s(fp32.tasks["F0.0"]) == pytest.approx(f0.flops / (1e10 * 0.5))


def test_measured_table_overrides_the_fallback_and_interpolates_in_tokens():
    sig = model_signature(DEBUG)
    table = ComputeTable(sig, "F", "layer", 16, (32, 128), (1e-3, 3e-3))
    p = base_profile(compute_tables=(table,), task_overhead_s={})
    prog = lower(build_schedule(DEBUG, 4, 16, "overlap"))  # 64 tokens per task
    tl = simulate(prog, p).timeline.set_index("task")
    dur = tl["end_s"] - tl["start_s"]
    assert dur["F0.0"] == pytest.approx(1e-3 + 2e-3 * (64 - 32) / (128 - 32))
    assert dur["B0.0"] == pytest.approx(prog.tasks["B0.0"].flops / (1e11 * 0.5))  # no B table: analytic
    # Outside the measured tokens: in proportion from the nearest point.
    assert table.at(16) == pytest.approx(0.5e-3) and table.at(256) == pytest.approx(6e-3)


def test_table_at_another_seq_is_rescaled_by_analytic_flops():
    sig = model_signature(DEBUG)
    table = ComputeTable(sig, "F", "layer", 32, (32, 128), (1e-3, 3e-3))
    prog = lower(build_schedule(DEBUG, 4, 16, "overlap"))
    cost = CostModel(prog, base_profile(compute_tables=(table,)))
    here = DEBUG.unit_forward_flops(0, 4, 16)
    there = DEBUG.unit_forward_flops(0, 2, 32)  # the same 64 tokens at the table's seq
    assert here < there  # attention costs more at the longer sequence
    assert cost.compute_s(prog.tasks["F0.0"]) == pytest.approx(table.at(64) * here / there)
    # A table of another model does not apply.
    other = ComputeTable("llama-other", "F", "layer", 16, (64,), (9.0,))
    cost = CostModel(prog, base_profile(compute_tables=(other,)))
    assert cost.compute_s(prog.tasks["F0.0"]) == pytest.approx(prog.tasks["F0.0"].flops / (1e11 * 0.5))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("format"), "not a megatrain hardware profile"),
    (lambda d: d.update(h2d_bandwidth=1), r"unknown field\(s\) \['h2d_bandwidth'\]"),
    (lambda d: d.pop("d2h"), "missing field 'd2h'"),
    (lambda d: d["h2d"].update(Bps=[1.0]), "as many sizes_bytes as Bps"),
    (lambda d: d.update(efficiency={"layer": 0.5}), "efficiency needs a value"),
    (lambda d: d.update(task_overhead_s={"gpu": 1e-5}), r"unknown keys \['gpu'\]"),
    (lambda d: d.update(compute_tables=[{"model": "m", "kind": "Q", "unit": "layer", "seq": 1, "tokens": [1],
                                         "dur_s": [1.0]}]), "kind must be one of"),
])
def test_bad_profiles_say_what_is_wrong(edit, message):
    d = base_profile().to_dict()
    edit(d)
    with pytest.raises(ProfileError, match=message):
        HardwareProfile.from_json(json.dumps(d), where="my.json")


def test_unknown_profile_name_lists_the_shipped_ones(tmp_path):
    names = shipped_profiles()
    assert {"cpu", "h200"} <= set(names)
    with pytest.raises(ProfileError, match=re.escape(f"shipped profile ({', '.join(names)})")):
        load_profile("h100")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


def test_profile_without_a_dtype_rate_is_an_error():
    prog = lower(build_schedule(DEBUG, 4, 16, knobs_for("overlap", compute_dtype="fp32")))
    p = base_profile(matmul_flops_per_s={"bf16": 1e12})
    with pytest.raises(ProfileError, match="no matmul rate for compute dtype 'fp32'"):
        simulate(prog, p)


def test_infinite_rates_survive_json():
    p = base_profile(gpu_adam_params_per_s=math.inf)
    assert HardwareProfile.from_json(p.to_json()).gpu_adam_params_per_s == math.inf


def test_compiled_layer_tables_are_used_only_by_programs_that_compile_their_layers():
    """compile_layers=true picks the compiled tables; eager Programs keep the eager ones; a profile without
    compiled tables predicts a compiling Program with the eager timings and warns once that it does."""
    sig = model_signature(DEBUG)
    eager = ComputeTable(sig, "F", "layer", 16, (64,), (4e-3,))
    compiled = ComputeTable(sig, "F", "layer", 16, (64,), (3e-3,), compiled=True)
    both = base_profile(compute_tables=(eager, compiled), task_overhead_s={})
    plain = lower(build_schedule(DEBUG, 4, 16, "overlap"))
    fused = lower(build_schedule(DEBUG, 4, 16, knobs_for("overlap", compile_layers=True)))
    assert CostModel(plain, both).compute_s(plain.tasks["F0.0"]) == pytest.approx(4e-3)
    assert CostModel(fused, both).compute_s(fused.tasks["F0.0"]) == pytest.approx(3e-3)
    assert HardwareProfile.from_json(both.to_json()) == both  # the flag survives JSON
    only_eager = base_profile(name="eager-only", compute_tables=(eager,), task_overhead_s={})
    with pytest.warns(UserWarning, match="no compiled-layer compute tables"):
        assert CostModel(fused, only_eager).compute_s(fused.tasks["F0.0"]) == pytest.approx(4e-3)
