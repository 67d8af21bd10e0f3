"""Lowering a schedule to a Program: streams, per-stream order, waits, slots, memory, JSON, determinism."""
import pytest

from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import NAMED_SCHEDULES, ScheduleKnobs, knobs_for
from megatrain.units import GiB
from megatrain.compile.advice import fit_report, plan_memory
from megatrain.ir.hostlayout import GRAD_SCRATCH_ELEMENTS
from megatrain.ir.program import OPTIONAL_STREAMS, STREAMS, Program
from megatrain.compile.lower import lower
from megatrain.compile.resolve import resolve
from megatrain.model.presets import PRESETS

DEBUG = PRESETS["debug"]


def program(knobs="overlap", model="debug", batch=4, seq=16):
    return lower(build_schedule(PRESETS[model], batch, seq, knobs))


@pytest.mark.parametrize("name", sorted(NAMED_SCHEDULES))
def test_every_dag_edge_is_enforced_by_stream_order_or_a_wait(name):
    sched = build_schedule(DEBUG, 4, 16, knobs_for(name, micro_batches=2))
    prog = lower(sched)
    for a, b in sched.graph.edges:
        ta, tb = prog.tasks[a.id], prog.tasks[b.id]
        if ta.stream == tb.stream:
            assert prog.position(a.id)[1] < prog.position(b.id)[1], f"{a} after {b} on {ta.stream}"
        else:
            # b waits on some task of a's stream that is at or after a in that stream's order.
            later = [w for w in tb.waits if prog.tasks[w].stream == ta.stream]
            assert later and prog.position(later[0])[1] >= prog.position(a.id)[1], f"{a} -> {b} not enforced"


def test_waits_are_reduced_to_the_latest_task_of_each_stream():
    prog = program(ScheduleKnobs(buffers=2, optimizer="after"))
    for t in prog.tasks.values():
        streams = [prog.tasks[w].stream for w in t.waits]
        assert len(streams) == len(set(streams)) and t.stream not in streams
    assert prog.tasks["N"].waits == ("OE",)  # OE is the last offload, so it implies all the others


def test_streams_by_kind():
    prog = program(knobs_for("gpu-adam"))
    kinds = {s: {prog.tasks[t].kind for t in q} for s, q in prog.streams.items()}
    assert kinds["h2d"] == {"P", "S"} and kinds["d2h"] == {"O", "W"}
    assert kinds["compute"] == {"F", "B", "U"} and kinds["cpu"] == {"U", "N"}
    assert prog.tasks["U0"].stream == "compute" and prog.tasks["UE"].stream == "cpu"
    assert set(prog.streams) == set(STREAMS) - set(OPTIONAL_STREAMS)  # no collectives on one GPU


def test_json_round_trip_and_determinism():
    a = program(knobs_for("long-context", micro_batches=2))
    b = program(knobs_for("long-context", micro_batches=2))
    assert a.to_json() == b.to_json()  # byte for byte
    back = Program.from_json(a.to_json())
    assert back.to_json() == a.to_json() and back.tasks == a.tasks and back.model == a.model
    with pytest.raises(ValueError, match="not a megatrain Program"):
        Program.from_dict({"format": "something else"})


def test_slots_follow_the_ring():
    prog = program(ScheduleKnobs(buffers=2, optimizer="after"), model="debug")
    prefetch_slots = [prog.tasks[t].slot for t in prog.streams["h2d"]]
    assert prefetch_slots[:4] == ["embed", "w0", "w1", "w0"]
    assert prog.tasks["F2.0"].slot == prog.tasks["P2"].slot


def test_gpu_memory_is_flat_in_depth():
    """Doubling the layer count changes the GPU peak by < 10% (BENCHMARKS target), checkpoints offloaded."""
    spec = PRESETS["bench-3b"]
    knobs = knobs_for("long-context")
    p28 = plan_memory(spec, 8, 2048, knobs).gpu.peak_bytes
    p56 = plan_memory(spec.with_layers(56), 8, 2048, knobs).gpu.peak_bytes
    assert abs(p56 - p28) / p28 < 0.10


def test_host_bytes_per_parameter():
    spec = PRESETS["llama3-8b"]
    std = plan_memory(spec, 8, 2048, ScheduleKnobs()).host
    lean = plan_memory(spec, 8, 2048, ScheduleKnobs(weight_wire="fp32", grad_wire="bf16")).host
    # 12 (master, m, v) + 2 (bf16 copy) + 4 (fp32 grads); streamed-only params add a little (untied: none)
    assert std.bytes_per_param == pytest.approx(18.0, rel=1e-9)
    scratch = 4 * resolve(spec, 8, 2048, ScheduleKnobs(grad_wire="bf16")).host_layout.grad_scratch_elements
    # bf16 gradients are converted through one fp32 buffer, at most GRAD_SCRATCH_ELEMENTS long
    assert lean.components["fp32 gradient scratch"] == scratch == 4 * GRAD_SCRATCH_ELEMENTS
    assert lean.bytes_per_param == pytest.approx(14.0 + scratch / spec.num_params, rel=1e-9)
    assert lean.pinned_bytes == pytest.approx(spec.num_params * (4 + 2), rel=1e-9)


def test_fit_report_names_the_knob_that_helps():
    plan = plan_memory(PRESETS["llama3-8b"], 8, 2048, ScheduleKnobs())
    ok, lines = fit_report(plan, host_bytes=128 * GiB, gpu_bytes=139 * GiB)
    text = "\n".join(lines)
    assert not ok and "host: DOES NOT FIT" in text and "short by" in text
    assert "grad_wire=bf16" in text and "(fits)" in text
    ok, lines = fit_report(plan, host_bytes=256 * GiB, gpu_bytes=8 * GiB)
    assert not ok and "GPU: DOES NOT FIT" in "\n".join(lines) and "offload_checkpoints=true" in "\n".join(lines)
    ok, _ = fit_report(plan, host_bytes=256 * GiB, gpu_bytes=139 * GiB)
    assert ok


def test_memory_plan_counts_state_slots_and_kept_gradients():
    spec = PRESETS["bench-3b"]
    base = plan_memory(spec, 8, 2048, knobs_for("overlap")).gpu
    knobs = knobs_for("overlap-split", gpu_optimizer_fraction=0.4, state_buffers=3, retain_grads=4)
    plan = plan_memory(spec, 8, 2048, knobs).gpu
    # 11 of 28 layers on the GPU, spread from layer 0; the first 4 keep their gradients
    assert set(plan.slot_bytes) - set(base.slot_bytes) == {"s0", "s1", "s2", "g0", "g2", "g5", "g7"}
    assert plan.peak_bytes - base.peak_bytes == (3 * 16 + 4 * 4) * spec.layer_params
    prog = lower(build_schedule(spec, 8, 2048, knobs))
    used = {n for t in prog.tasks.values() for n in (t.slot, t.fills) if n}
    assert used == set(plan.slot_bytes)  # every buffer a task uses is planned, and only those


def test_named_overlap_split_fits_16_gib_on_bench_3b():
    plan = plan_memory(PRESETS["bench-3b"], 8, 2048, knobs_for("overlap-split")).gpu
    assert plan.peak_bytes <= 16 * GiB
