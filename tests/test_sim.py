"""Simulator engine: closed-form step times, the fluid PCIe model, determinism, deadlock detection."""
import dataclasses
import math

import pandas as pd
import pytest

from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.ir.program import Program, ProgramTask
from megatrain.compile.lower import lower
from megatrain.model.presets import PRESETS
from megatrain.sim import CopyCurve, HardwareProfile, SimulationError, simulate

DEBUG = PRESETS["debug"]


def make_profile(h2d=math.inf, d2h=math.inf, flops=1e9, cpu_adam=math.inf, duplex=math.inf, dma=1.0,
                 overhead=None) -> HardwareProfile:
    """Every cost zero or linear, so step times have closed forms."""
    return HardwareProfile(
        name="test", h2d=CopyCurve.constant(h2d), d2h=CopyCurve.constant(d2h), duplex_Bps=duplex,
        matmul_flops_per_s={"bf16": flops, "fp32": flops}, efficiency={"layer": 1.0, "embed": 1.0, "head": 1.0},
        gpu_memory_Bps=math.inf, cpu_adam_params_per_s={1: cpu_adam}, cpu_threads=1,
        gpu_adam_params_per_s=math.inf, clip_norm_params_per_s=math.inf, dma_factor_cpu_optimizer=dma,
        task_overhead_s=overhead or {},
    )


def program(knobs, batch=4, seq=16, spec=DEBUG) -> Program:
    return lower(build_schedule(spec, batch, seq, knobs))


def tasks_of(prog: Program, stream: str) -> list[ProgramTask]:
    return [prog.tasks[t] for t in prog.streams[stream]]


def test_one_buffer_step_is_the_sum_of_copies_and_compute():
    """Nothing overlaps with one weight buffer: every layer's copy waits for the previous layer's compute.
    Only the head, which has its own buffer, is fetched while the last layer computes (it is shorter)."""
    h2d, flops = 1e7, 1e9
    prog = program(knobs_for("serial"))  # buffers=1, optimizer after the backward
    f_last = prog.tasks[f"F{DEBUG.num_layers - 1}.0"].flops / flops
    assert prog.tasks["PH"].bytes / h2d < f_last  # precondition of the closed form
    copies = sum(t.bytes for t in tasks_of(prog, "h2d") if t.id != "PH") / h2d
    compute = sum(t.flops for t in tasks_of(prog, "compute")) / flops
    res = simulate(prog, make_profile(h2d=h2d, flops=flops))
    assert res.step_s == pytest.approx(copies + compute, rel=1e-12)
    # Everything is on the critical path, and the GPU's idle time is exactly the exposed copies.
    assert sum(res.summary.critical_path_s.values()) == pytest.approx(res.step_s, rel=1e-12)
    assert res.summary.wait_s["weights"] == pytest.approx(copies, rel=1e-9)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_two_buffers_with_short_copies_hide_all_but_the_first(micro_batches):
    """Double buffering, copies shorter than compute: step = copies before the first layer + sum of compute."""
    h2d, flops = 1e8, 1e9
    prog = program(knobs_for("double-buffer", micro_batches=micro_batches))
    layer_copy = prog.tasks["P0"].bytes / h2d
    assert layer_copy < prog.tasks["F0.0"].flops / flops  # precondition: copies hide behind compute
    first = (prog.tasks["PE"].bytes + prog.tasks["P0"].bytes) / h2d  # FE (a gather) is free here
    compute = sum(t.flops for t in tasks_of(prog, "compute")) / flops
    res = simulate(prog, make_profile(h2d=h2d, flops=flops))
    assert res.step_s == pytest.approx(first + compute, rel=1e-12)
    assert res.summary.gpu_busy_s == pytest.approx(compute, rel=1e-12)


def test_cpu_optimizer_slower_than_the_forward_shows_as_optimizer_wait():
    """Overlap placement: forward(l) waits for update(l). With updates longer than a layer's forward, the
    forward is paced by the CPU: step = all updates + head + backward, and the GPU idle time is all optimizer."""
    flops, rate = 1e9, 2e6
    prog = program(knobs_for("overlap"))
    updates = [t for t in tasks_of(prog, "cpu") if t.kind == "U"]
    assert [t.step_offset for t in updates] == [-1] * len(updates)
    f_layer = prog.tasks["F0.0"].flops / flops
    assert f_layer < min(t.params for t in updates) / rate  # precondition: every update outlasts a forward
    total_u = sum(t.params for t in updates) / rate
    after = sum(t.flops for t in tasks_of(prog, "compute") if t.kind == "B" or t.unit == -2) / flops
    res = simulate(prog, make_profile(flops=flops, cpu_adam=rate))
    assert res.step_s == pytest.approx(total_u + after, rel=1e-12)
    s = res.summary
    idle = res.step_s - s.gpu_busy_s
    forward = sum(t.flops for t in tasks_of(prog, "compute") if t.kind == "F" and t.unit >= 0) / flops
    assert idle == pytest.approx(total_u - forward, rel=1e-9)  # the layers' forwards run inside the updates
    assert s.wait_s["optimizer"] == pytest.approx(idle, rel=1e-9)
    assert s.wait_s["weights"] == s.wait_s["gradients"] == s.wait_s["other"] == 0.0


def test_optimizer_wait_includes_copies_it_held_back():
    """With real copies, a prefetch that could only start after its update is charged to the optimizer too."""
    prog = program(knobs_for("overlap"))
    res = simulate(prog, make_profile(h2d=1e7, flops=1e9, cpu_adam=2e6))
    s = res.summary
    assert s.wait_s["weights"] == 0.0
    assert s.wait_s["optimizer"] == pytest.approx(res.step_s - s.gpu_busy_s, rel=1e-9)


# ---- the fluid PCIe model ------------------------------------------------------------------------------------
def copy_program(h2d_bytes, d2h_bytes, cpu_params=0, d2h_waits_cpu=False, h2d_waits_cpu=False) -> Program:
    """A hand-made Program: one h2d copy, one d2h copy, optionally a CPU update the copies wait for."""
    base = program(knobs_for("serial"))
    tasks = {"P0": ProgramTask("P0", "P", 0, None, "h2d", ("U0",) if h2d_waits_cpu else (), "w0", h2d_bytes, 0.0,
                               0, 0),
             "O0": ProgramTask("O0", "O", 0, None, "d2h", ("U0",) if d2h_waits_cpu else (), "w0", d2h_bytes, 0.0,
                               0, 0)}
    streams = {"h2d": ["P0"], "compute": [], "d2h": ["O0"], "cpu": []}
    if cpu_params:
        tasks["U0"] = ProgramTask("U0", "U", 0, None, "cpu", (), None, 0, 0.0, 0, cpu_params)
        streams["cpu"] = ["U0"]
    return dataclasses.replace(base, tasks=tasks, streams=streams, _index=None)


def ends(res) -> dict:
    return dict(zip(res.timeline["task"], res.timeline["end_s"]))


def test_both_directions_share_the_duplex_bandwidth_and_rerate_when_one_ends():
    # Alone 10 B/s each; together capped at 10 B/s summed -> 5 B/s each until d2h's 50 bytes are done at t=10,
    # then h2d's remaining 50 bytes at 10 B/s: done at t=15.
    res = simulate(copy_program(100, 50), make_profile(h2d=10, d2h=10, duplex=10))
    assert ends(res) == pytest.approx({"P0": 15.0, "O0": 10.0}, rel=1e-12)
    # Without a cap the directions are independent.
    res = simulate(copy_program(100, 50), make_profile(h2d=10, d2h=10))
    assert ends(res) == pytest.approx({"P0": 10.0, "O0": 5.0}, rel=1e-12)


def test_a_copy_joining_midway_slows_the_other_only_while_both_run():
    # d2h starts at t=5 (after a 5 s CPU update): h2d alone 0-5 s moves 50 bytes; both at 5 B/s from 5 s,
    # d2h's 30 bytes done at 11 s; h2d then has 20 bytes left at 10 B/s -> 13 s.
    prog = copy_program(100, 30, cpu_params=5, d2h_waits_cpu=True)
    res = simulate(prog, make_profile(h2d=10, d2h=10, duplex=10, cpu_adam=1.0))
    assert ends(res) == pytest.approx({"U0": 5.0, "P0": 13.0, "O0": 11.0}, rel=1e-12)


# How a CPU update and the copies share host memory: tests/test_sim_host_memory.py.


@pytest.mark.parametrize("start_s", [4999.37, 77777.7])
def test_small_copies_late_in_a_long_run_finish(start_s):
    """Regression: a re-rated copy must not be left a residue of bytes too small to advance the clock (a hang)."""
    prog = copy_program(1234, 618, cpu_params=1, d2h_waits_cpu=True, h2d_waits_cpu=True)
    res = simulate(prog, make_profile(h2d=5e10, d2h=3e10, duplex=5.5e10, cpu_adam=1 / start_s))
    # Shared 5.5e10 B/s in proportion 5:3 until d2h's 618 bytes are done, then h2d alone at 5e10.
    d2h_end = 618 / (3e10 * 5.5 / 8)
    h2d_end = d2h_end + (1234 - d2h_end * 5e10 * 5.5 / 8) / 5e10
    assert ends(res) == pytest.approx({"U0": start_s, "O0": start_s + d2h_end, "P0": start_s + h2d_end},
                                      rel=1e-12, abs=1e-11)


def test_copy_latency_and_launch_overhead_delay_the_bytes():
    prog = copy_program(100, 0)
    prof = dataclasses.replace(make_profile(d2h=10, overhead={"h2d": 0.5}), h2d=CopyCurve.constant(10, 1.5))
    assert ends(simulate(prog, prof))["P0"] == pytest.approx(0.5 + 1.5 + 10.0, rel=1e-12)


# ---- determinism and failures --------------------------------------------------------------------------------
def test_simulation_is_deterministic_and_survives_json():
    prog = program(knobs_for("overlap", micro_batches=2))
    prof = make_profile(h2d=2e7, d2h=1.5e7, duplex=2.5e7, flops=1e9, cpu_adam=1e7, dma=0.8)
    a = simulate(prog, prof).timeline
    b = simulate(prog, prof).timeline
    c = simulate(Program.from_json(prog.to_json()), prof).timeline
    pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(a, c)
    assert set(a["task"]) == set(prog.tasks) and (a["source"] == "predicted").all()
    # Every task starts after its waits end and after its stream predecessor.
    end, start = dict(zip(a["task"], a["end_s"])), dict(zip(a["task"], a["start_s"]))
    for q in prog.streams.values():
        for x, y in zip(q, q[1:]):
            assert start[y] >= end[x]
    for t in prog.tasks.values():
        assert all(start[t.id] >= end[w] for w in t.waits)


def test_deadlock_names_the_stuck_tasks_and_their_waits():
    prog = program(knobs_for("serial"))
    d = prog.to_dict()
    for t in d["tasks"]:
        if t["id"] == "P0":  # P0 now waits for F1.0, which needs P1, queued behind P0: a cycle
            t["waits"] = ["F1.0"]
    edited = Program.from_dict(d)
    with pytest.raises(SimulationError) as e:
        simulate(edited, make_profile(h2d=1e8))
    msg = str(e.value)
    assert "deadlocked" in msg
    assert "h2d: P0 waits for F1.0 (compute, queued behind F0.0)" in msg
    assert "compute: F0.0 waits for P0 (h2d, itself stuck)" in msg
    assert "wait cycle:" in msg and "P0 (h2d)" in msg and "F0.0 (compute)" in msg


def test_wait_on_unknown_task_is_an_error():
    prog = program(knobs_for("serial"))
    d = prog.to_dict()
    d["tasks"][0]["waits"] = ["P99"]
    with pytest.raises(SimulationError, match=r"waits for \['P99'\], which are not tasks of this program"):
        simulate(Program.from_dict(d), make_profile())


# ---- the GPU share of the optimizer ---------------------------------------------------------------------------------
def test_overlap_split_takes_its_layers_updates_off_the_host_threads():
    """Free copies and compute, host AdamW at 1 Mparam/s: the step is the host's update time, so moving a layer to
    the GPU (whose update is free here) shortens it by exactly that layer's update."""
    profile = make_profile(flops=math.inf, cpu_adam=1e6)
    layer, rest = DEBUG.layer_params, DEBUG.num_params - DEBUG.num_layers * DEBUG.layer_params
    for fraction, on_gpu in ((0.0, 0), (0.5, 2), (1.0, 4)):
        knobs = knobs_for("overlap-split", gpu_optimizer_fraction=fraction)
        assert simulate(program(knobs), profile).step_s == pytest.approx((DEBUG.num_params - on_gpu * layer) / 1e6)
    assert simulate(program(knobs_for("overlap-split", gpu_optimizer_fraction=1.0)), profile).step_s \
        == pytest.approx(rest / 1e6)


def test_best_gpu_fraction_follows_the_slower_of_host_threads_and_pcie():
    from megatrain.compile.advice import plan_memory
    from megatrain.tune.search import best_gpu_fraction

    start = knobs_for("overlap")
    # Host AdamW free, PCIe slow: every GPU update only adds copies, so none.
    best = best_gpu_fraction(DEBUG, 4, 16, start, make_profile(h2d=1e9, d2h=1e9, flops=math.inf, cpu_adam=math.inf))
    assert best.knobs.optimizer == "overlap-split" and best.knobs.gpu_optimizer_fraction == 0.0
    assert len(best.table) == DEBUG.num_layers + 1 and best.table.step_s.is_monotonic_increasing
    # Host AdamW slow, PCIe fast: all layers on the GPU, their gradients kept there when memory allows.
    slow_host = make_profile(h2d=1e12, d2h=1e12, flops=math.inf, cpu_adam=1e6)
    best = best_gpu_fraction(DEBUG, 4, 16, start, slow_host)
    assert best.knobs.gpu_optimizer_fraction == 1.0 and best.knobs.retain_grads == DEBUG.num_layers
    assert best.result.step_s == pytest.approx(best.table.step_s.min())
    # A GPU memory limit caps the kept gradients (and the table holds only variants that fit).
    all_gpu = knobs_for("overlap-split", gpu_optimizer_fraction=1.0)
    limit = plan_memory(DEBUG, 4, 16, dataclasses.replace(all_gpu, retain_grads=1)).gpu.peak_bytes
    capped = best_gpu_fraction(DEBUG, 4, 16, start, slow_host, gpu_bytes=limit)
    assert capped.knobs.retain_grads == 1 and (capped.table.gpu_peak_gib <= limit / 2**30).all()
    with pytest.raises(ValueError, match="no GPU share"):
        best_gpu_fraction(DEBUG, 4, 16, knobs_for("arrival"), slow_host)
