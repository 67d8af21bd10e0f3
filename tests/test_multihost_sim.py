"""Several hosts in the simulator and the planner (`simulate/plan --gpus G --hosts H`, sim/collectives.py).

References are computed here from the model's shapes and the profile's numbers: a collective's duration from the
formula latency + bus bytes / min(bus bandwidth at that size, G x inter_host_Bps), a one-host simulation from the
engine run on a profile shared by hand, per-host memory from the one-GPU plan.
"""
import math
import re
from dataclasses import replace

import numpy as np
import pytest

import megatrain.parallel  # noqa: F401  (registers the sharded strategy)
from megatrain.cli import main
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.ir.dag import ScheduleError
from megatrain.ir.placement import Parallelism
from megatrain.units import GiB
from megatrain.compile.advice import plan_memory
from megatrain.compile.lower import lower
from megatrain.model.presets import PRESETS
from megatrain.sim import (
    CopyCurve,
    HardwareProfile,
    SimulationError,
    load_profile,
    simulate,
)
from megatrain.sim.engine import _Engine

SPEC = PRESETS["debug"].with_layers(3)
KNOBS = knobs_for("arrival", clip=0.0, weight_wire="bf16")
INTRA = {"sizes": [1e4, 1e6], "bus_Bps": [1e9, 1e10]}  # within a host: 1 GB/s at 10 kB up to 10 GB/s at 1 MB


def machine(**changes) -> HardwareProfile:
    """A host on which only what a test names takes time: copies, CPU updates and host memory are (nearly)
    free, collectives follow INTRA with a 10 us latency."""
    p = HardwareProfile(name="t", h2d=CopyCurve.constant(1e15), d2h=CopyCurve.constant(1e15),
                        matmul_flops_per_s={"bf16": 1e15, "fp32": 1e15}, gpu_memory_Bps=1e15,
                        cpu_adam_params_per_s={1: 1e18}, host_memory_Bps=math.inf,
                        collectives={k: dict(INTRA, latency_s=1e-5) for k in ("G", "Z", "A")},
                        inter_host_Bps=0.8e9, inter_host_latency_s=3e-5)
    return p.with_(**changes)


def program(world: int, hosts: int = 1):
    """One rank's Program of `world` ranks spread over `hosts` hosts (the placement carries both)."""
    return lower(build_schedule(SPEC, 2, 16, KNOBS, world=Parallelism(world, hosts)))


def durations(result) -> dict:
    tl = result.timeline.set_index("task")
    return (tl.end_s - tl.start_s).to_dict()


def expected_collective_s(kind: str, message_bytes: int, world: int, per_host: int, p: HardwareProfile) -> float:
    """The model's formula, from the message: bus bytes (world-1)/world of it, at the intra-host bus bandwidth
    for that size but at most the host's NICs (per_host x inter_host_Bps); a reduce-scatter pays one more latency
    for the norm's all-reduce."""
    bus = message_bytes * (world - 1) // world
    rate = min(np.interp(bus, INTRA["sizes"], INTRA["bus_Bps"]), per_host * p.inter_host_Bps)
    return p.inter_host_latency_s * (2 if kind == "Z" else 1) + bus / rate


def test_a_collective_across_hosts_takes_the_formula_time():
    """4 ranks on 2 hosts: the all-gather of a layer's bf16 weights and the reduce-scatter of its fp32 gradients
    take the network's latency plus bus bytes over min(intra-host bus bandwidth, 2 x inter_host_Bps); the cap
    binds for the larger reduce-scatter only (so both branches of the min are checked)."""
    p, prog = machine(), program(4, hosts=2)
    got = durations(simulate(prog, p))
    n = SPEC.unit_params(1)
    for tid, kind, message in (("G1", "G", 2 * n), ("Z1", "Z", 4 * n)):
        assert prog.tasks[tid].bytes == message * 3 // 4  # the Program carries the bus bytes of one rank
        assert got[tid] == pytest.approx(expected_collective_s(kind, message, 4, 2, p), rel=1e-12)
    g_rate = np.interp(2 * n * 3 // 4, INTRA["sizes"], INTRA["bus_Bps"])
    z_rate = np.interp(4 * n * 3 // 4, INTRA["sizes"], INTRA["bus_Bps"])
    assert g_rate < 2 * p.inter_host_Bps < z_rate  # the test exercises both sides of the min
    one = durations(simulate(program(4), p))  # one host of 4: the intra-host table, its own latency
    assert one["G1"] == pytest.approx(1e-5 + 2 * n * 3 // 4 / g_rate, rel=1e-12)


def test_hosts_slow_the_step_exactly_by_the_collectives_on_the_critical_path():
    """The same 4-rank Program on 1 host and on 2 hosts (CPU and host memory free, so only the network differs).
    Collective-bound (fast compute): the collectives are the critical path and 2 hosts are much slower.
    Compute-bound: every collective got slower, but most are hidden behind compute; only those on the critical
    path (the first gathers, before any compute, and the last reduce-scatters, after the last backward) delay the
    step, which grows by exactly their extra time."""
    prog, prog2 = program(4), program(4, hosts=2)
    fast = machine()
    one, two = simulate(prog, fast), simulate(prog2, fast)
    assert one.summary.critical_path_s["comm"] > 0.5 * one.step_s
    assert two.step_s > 1.5 * one.step_s

    slow = machine(matmul_flops_per_s={"bf16": 1e10, "fp32": 1e10})
    one, two = simulate(prog, slow), simulate(prog2, slow)
    assert one.summary.critical_path == two.summary.critical_path  # the network did not move the path
    comm = [t for t in prog.tasks if prog.tasks[t].stream == "comm"]
    on_path = [t for t in one.summary.critical_path if t in comm]
    hidden = set(comm) - set(on_path)
    assert on_path and len(hidden) > len(on_path)
    d1, d2 = durations(one), durations(two)
    assert all(d2[t] > d1[t] for t in comm)  # the network is slower for every collective ...
    extra = sum(d2[t] - d1[t] for t in on_path)  # ... but only those on the path delay the step
    assert two.step_s - one.step_s == pytest.approx(extra, rel=1e-9)


def test_a_rank_shares_host_memory_and_cpu_with_the_ranks_of_its_own_host_only():
    """A CPU update's time scales with the ranks per host, not with the world: 4 ranks on 2 hosts update at half
    the host's rate (2 per host), 4 on one host at a quarter; 2 ranks on 2 hosts (one per host) at the full rate."""
    p = machine(cpu_adam_params_per_s={1: 1e6}, host_memory_Bps=1e12)
    params = program(4).tasks["U1"].params
    for hosts, per_host in ((1, 4), (2, 2), (4, 1)):
        got = durations(simulate(program(4, hosts), p))["U1"]
        assert got == pytest.approx(params / (1e6 / per_host), rel=1e-6)
    with pytest.raises(ScheduleError, match="cannot be spread evenly over 3 host"):  # the resolver refuses it
        program(4, hosts=3)


def test_one_host_is_the_model_of_before():
    """hosts=1 (the default) runs the engine on the profile shared by the ranks of one host, exactly: the
    reference shares it by hand (host memory bandwidth and CPU AdamW rate / world) and runs the engine."""
    p = load_profile("h200-measured")
    for world in (1, 2, 4):
        prog = program(world)
        rates = {t: r / world for t, r in p.cpu_adam_params_per_s.items()}
        ref = p if world == 1 else replace(p, host_memory_Bps=p.host_memory_Bps / world, cpu_adam_params_per_s=rates)
        rows = {r["task"]: (r["start_s"], r["end_s"]) for r in _Engine(prog, ref).run()}
        for result in (simulate(prog, p), simulate(program(world, hosts=1), p)):
            tl = result.timeline
            assert dict(zip(tl.task, zip(tl.start_s, tl.end_s))) == rows


def test_profile_network_fields_default_to_documented_assumptions_and_round_trip(tmp_path):
    old = load_profile("h200-measured").to_dict()
    for key in ("inter_host_Bps", "inter_host_latency_s"):
        old.pop(key)
    old["notes"].pop("inter_host_Bps")
    p = HardwareProfile.from_dict(old)  # a profile written before the fields existed
    assert (p.inter_host_Bps, p.inter_host_latency_s) == (47e9, 50e-6)
    assert "assumption" in p.notes["inter_host_Bps"]
    mine = p.with_(inter_host_Bps=12e9, notes={"inter_host_Bps": "measured: nccl-tests"})
    mine.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == mine and load_profile(tmp_path / "p.json").inter_host_Bps == 12e9


def _gib(pattern: str, out: str) -> float:
    return float(re.search(pattern, out).group(1))


def test_plan_judges_host_memory_per_host(capsys):
    """`plan --gpus 4 --hosts 2`: a host holds its 4 ranks (4 x one rank), each host about half the model's store
    (the one-GPU plan's, page padding aside), the job both hosts; the fit is judged against one host's memory."""
    args = ["plan", "--model", "bench-3b", "--batch", "2", "--seq", "512", "--schedule", "arrival", "--gpus", "4",
            "--hosts", "2", "--gpu-gib", "139"]
    assert main(args + ["--host-gib", "100"]) == 0
    out = capsys.readouterr().out
    rank = _gib(r"  total\s+([\d.]+) GiB", out)
    host, host_store = _gib(r"host, each of 2 \(4 ranks\): ([\d.]+) GiB", out), _gib(r"\(store ([\d.]+) GiB", out)
    job = _gib(r"job, 2 hosts: ([\d.]+) GiB", out)
    assert host == pytest.approx(4 * rank, abs=4e-3) and job == pytest.approx(2 * host, abs=2e-3)
    store = plan_memory(PRESETS["bench-3b"], 2, 512, knobs_for("arrival")).host.store_bytes / GiB
    assert host_store == pytest.approx(store / 2, rel=0.01)
    assert "fits: yes (each host 100.0 GiB" in out
    assert main(args + ["--host-gib", f"{host - 1:.1f}"]) == 1  # one host short, though the job is less than 2x
    assert "fits: NO" in capsys.readouterr().out


def test_cli_simulate_hosts(capsys, tmp_path):
    base = ["simulate", "--model", "debug", "--batch", "2", "--seq", "16", "--schedule", "arrival", "--no-plots",
            "--gpus", "2"]
    assert main(base + ["--hosts", "2", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "per GPU x 2 GPUs x 2 hosts" in out and "collectives cross hosts at most 2 x 47 GB/s" in out
    assert main(base + ["--hosts", "0", "--out", str(tmp_path / "b")]) == 2
    assert "--hosts 0: give at least 1" in capsys.readouterr().err


def test_the_comm_queue_issues_gathers_ahead_of_reductions_they_do_not_need():
    """Lowering moves each all-gather ahead of the reduce-scatters queued just before it when no path (DAG edge or
    any stream's order) leads from the Z to the G: afterwards no such pair is left, some G did move, the Program
    runs to the end, and it is never slower than the topological order (here faster: the backward stops paying
    B + Z + G in series per layer)."""
    import networkx as nx

    from megatrain.compile.strategies import register_strategy, strategy_of

    spec = PRESETS["bench-3b"].with_layers(6)
    schedule = build_schedule(spec, 4, 1024, knobs_for("arrival", clip=0.0), world=2)
    moved = lower(schedule)
    original = strategy_of(schedule.placement)  # the sharded strategy, its comm order replaced for a moment
    register_strategy(replace(original, order_comm=lambda graph, queues: queues["comm"]))
    try:
        topological = lower(schedule)
    finally:
        register_strategy(original)
    assert moved.streams["comm"] != topological.streams["comm"]
    assert sorted(moved.streams["comm"]) == sorted(topological.streams["comm"])
    lowered = nx.DiGraph()  # the moved Program's dependencies: waits and every stream's order
    for t in moved.tasks.values():
        lowered.add_edges_from((w, t.id) for w in t.waits)
    for q in moved.streams.values():
        lowered.add_edges_from(zip(q, q[1:]))
    comm = moved.streams["comm"]
    for z, g in zip(comm, comm[1:]):
        if moved.tasks[z].kind == "Z" and moved.tasks[g].kind == "G":
            lowered.remove_edge(z, g)
            assert nx.has_path(lowered, z, g), (z, g)  # left behind only because it needs that Z
            lowered.add_edge(z, g)
    profile = load_profile("h200-measured")
    assert simulate(moved, profile).step_s < simulate(topological, profile).step_s
