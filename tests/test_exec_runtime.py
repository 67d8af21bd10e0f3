"""The executor's machinery on the CPU backend: waits that time out with a clear error, failing tasks, the measured
timeline, slot checks, the host store's bytes against the memory planner, the optimizer against torch, overlap's
flush, user errors, and `megatrain train`. (Training equality is in test_exec_training.py.)"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import time

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters  # the compiler's own tallies: frames converted, graphs, graph breaks

from megatrain.analysis.timeline import TIMELINE_COLUMNS
from megatrain.cli import main
from megatrain.exec.backend import CpuBackend, ExecError
from megatrain.exec.optim import (
    AdamWConfig,
    UpdatePlan,
    adamw_update,
    clip_coefficient,
    global_norm,
)
from megatrain.exec.runtime import Runtime
from megatrain.exec.store import HostStore
from megatrain.exec.work import StepWork
from megatrain.model.init import init_tiles
from megatrain.compile.builders import build_schedule
from megatrain.ir.dag import ScheduleError
from megatrain.compile.knobs import ScheduleKnobs, knobs_for
from megatrain.plan.memory import NOT_STORE
from megatrain.compile.advice import plan_memory
from megatrain.compile.lower import lower
from megatrain.compile.resolve import resolve_host_layout
from megatrain.model.presets import PRESETS
from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.engine.trainer import StreamedTrainer

DEBUG = PRESETS["debug"]
TIED = ModelSpec(**{**DEBUG.to_dict(), "name": "debug-tied", "tie_word_embeddings": True,
                    "rope_scaling": DEBUG.rope_scaling})
FP32 = dict(compute_dtype="fp32", weight_wire="fp32")
B, T = 4, 16


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, DEBUG.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def prepared(knobs, timeout_s=5.0, program=None):
    """A runtime over a StepWork with one batch bound, as the trainer sets it up."""
    program = program or lower(build_schedule(DEBUG, B, T, knobs))
    store = HostStore(DEBUG, resolve_host_layout(DEBUG, knobs), CpuBackend(), init_tiles(DEBUG))
    work = StepWork(program, store, CpuBackend(), AdamWConfig(lr=1e-3))
    work.begin_step(*batch(), UpdatePlan(step=0, lr=1e-3), None)
    return Runtime(program, CpuBackend(), work, timeout_s=timeout_s), program


# ---- waits and failures --------------------------------------------------------------------------------------------
def test_a_wait_that_cannot_be_satisfied_times_out_with_an_error_naming_task_stream_and_producer():
    knobs = knobs_for("serial", **FP32)
    program = lower(build_schedule(DEBUG, B, T, knobs))
    # PE (h2d) now also waits for FE.0 (compute), which itself waits for PE: a deadlock.
    program.tasks["PE"] = dataclasses.replace(program.tasks["PE"], waits=("FE.0",))
    rt, _ = prepared(knobs, timeout_s=0.5, program=program)
    t0 = time.perf_counter()
    with pytest.raises(ExecError) as e:
        rt.run()
    # Liveness, not speed: a 0.5 s timeout ends the step in seconds; a hang would never return (bound: 30 s).
    assert time.perf_counter() - t0 < 30, "the runtime must give up after the timeout, not hang"
    msg = str(e.value)
    assert "PE" in msg and "h2d" in msg and "FE.0" in msg and "compute" in msg, msg
    assert "0.5 s" in msg


def test_a_failing_task_stops_every_stream_and_names_the_task():
    knobs = knobs_for("overlap", **FP32)
    rt, _ = prepared(knobs)
    real = rt.work

    def work(task):
        if task.id == "B2.0":
            raise RuntimeError("boom")
        real(task)

    rt.work = work
    with pytest.raises(ExecError, match=r"task B2\.0 on stream compute failed: RuntimeError: boom") as e:
        rt.run()
    assert isinstance(e.value.__cause__, RuntimeError)


def test_a_program_whose_slots_do_not_match_is_caught():
    knobs = knobs_for("double-buffer", **FP32)
    program = lower(build_schedule(DEBUG, B, T, knobs))
    f1 = program.tasks["F1.0"]
    program.tasks["F1.0"] = dataclasses.replace(f1, slot="w0")  # P1 fills w1; F1 would read layer 0's weights
    rt, _ = prepared(knobs, program=program)
    # w0 holds layer 0, or already layer 2 when the h2d thread's P2 got there first (its wait is on F0.0, not F1.0)
    with pytest.raises(ExecError, match=r"F1\.0 reads slot w0, which holds unit [02], not 1"):
        rt.run()


def test_waits_on_unknown_tasks_are_rejected_before_running():
    knobs = knobs_for("serial", **FP32)
    program = lower(build_schedule(DEBUG, B, T, knobs))
    program.tasks["P0"] = dataclasses.replace(program.tasks["P0"], waits=("F9.0",))
    with pytest.raises(ExecError, match="P0 waits for F9.0, which is not a task"):
        Runtime(program, CpuBackend(), lambda t: None)


# ---- timeline ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["overlap", "gpu-adam", "long-context", "overlap-split"])
def test_measured_timeline_has_the_simulator_columns_and_respects_order_and_waits_and_slot_bytes(name):
    knobs = knobs_for(name, micro_batches=2, **FP32)
    if name == "overlap-split":  # kept gradients are buffers too
        knobs = dataclasses.replace(knobs, gpu_optimizer_fraction=0.5, retain_grads=1)
    rt, program = prepared(knobs)
    assert rt.work.gpu_bytes() == program.memory.buffers_bytes  # the slots are what the planner counts
    tl = rt.run(step=3)
    assert list(tl.columns) == TIMELINE_COLUMNS
    assert set(tl.task) == set(program.tasks) and len(tl) == len(program.tasks)
    assert (tl.source == "measured").all() and (tl.step == 3).all()
    assert (tl.end_s >= tl.start_s).all() and (tl.start_s >= 0).all()
    row = tl.set_index("task")
    for stream, queue in program.streams.items():
        for a, b in zip(queue, queue[1:]):  # in-order streams: b starts after a ends
            assert row.end_s[a] <= row.start_s[b], (stream, a, b)
    for t in program.tasks.values():
        for w in t.waits:
            assert row.end_s[w] <= row.start_s[t.id], (w, t.id)
        assert row.stream[t.id] == t.stream and row.bytes[t.id] == t.bytes


# ---- host store ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [DEBUG, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("knobs", [ScheduleKnobs(), ScheduleKnobs(weight_wire="fp32", grad_wire="bf16"),
                                   ScheduleKnobs(optimizer="split", grad_wire="bf16")], ids=["bf16", "fp32", "split"])
def test_store_bytes_match_the_memory_planner(spec, knobs):
    store = HostStore(spec, resolve_host_layout(spec, knobs), CpuBackend(), init_tiles(spec))
    have = store.bytes_by_component()
    planned = plan_memory(spec, B, T, knobs, backend="cpu").host.components
    assert have == {k: v for k, v in planned.items() if k not in NOT_STORE}  # every store component, exactly
    assert sum(have.values()) <= store.allocated_bytes() <= sum(have.values()) + 4096 * 6 * len(spec.units())
    assert store.pinned_bytes() == 0  # the CPU backend pins nothing
    per_param = sum(have[k] for k in ("fp32 master", "adam m (fp32)", "adam v (fp32)")) / spec.num_params
    assert per_param == 12


def test_store_round_trips_tiles_and_ties_the_head_to_the_embedding():
    tiles = init_tiles(TIED, seed=3)
    store = HostStore(TIED, resolve_host_layout(TIED, ScheduleKnobs()), CpuBackend(), tiles)
    out = store.tiles()
    for u in TIED.units():
        assert torch.equal(out[u], tiles[u])
    vd = TIED.vocab_size * TIED.hidden_size
    assert store.master(HEAD).numel() == TIED.hidden_size  # the head owns only its norm
    # The bf16 streaming copy of the head's lm_head is the embedding's master, rounded.
    assert torch.equal(store.stream_tile(HEAD)[:vd], store.master(EMBED).to(torch.bfloat16))
    store.master(EMBED).add_(1.0)
    store.refresh_stream(EMBED)
    assert torch.equal(store.stream_tile(HEAD)[:vd], store.master(EMBED).to(torch.bfloat16))


def test_tied_gradients_merge_once_per_landing():
    store = HostStore(TIED, resolve_host_layout(TIED, ScheduleKnobs()), CpuBackend(), init_tiles(TIED))
    vd = TIED.vocab_size * TIED.hidden_size
    store.grad(EMBED).fill_(1.0)
    store.grad(HEAD).fill_(2.0)
    assert store.optimizer_grad(EMBED).eq(3.0).all()
    assert store.optimizer_grad(EMBED).eq(3.0).all()  # idempotent until gradients land again
    assert store.optimizer_grad(HEAD).numel() == TIED.hidden_size and store.optimizer_grad(HEAD).eq(2.0).all()
    store.gradients_landing(EMBED)
    store.grad(EMBED)[:vd].fill_(1.0)
    assert store.optimizer_grad(EMBED).eq(3.0).all()


# ---- optimizer -----------------------------------------------------------------------------------------------------
def test_adamw_on_a_tile_equals_torch_adamw_with_decay_on_the_matrix_prefix_only():
    g = torch.Generator().manual_seed(0)
    mat, vec = torch.randn(6, 5, generator=g), torch.randn(5, generator=g)
    flat = torch.cat([mat.flatten(), vec])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    ref_mat, ref_vec = mat.clone().requires_grad_(), vec.clone().requires_grad_()
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW([{"params": [ref_mat], "weight_decay": 0.1}, {"params": [ref_vec], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(1, 4):
        grad = torch.randn(flat.shape, generator=g)
        ref_mat.grad, ref_vec.grad = grad[:30].view(6, 5).clone(), grad[30:].clone()
        opt.step()
        adamw_update(flat, grad.clone(), m, v, step, 30, 1e-2, cfg)
        torch.testing.assert_close(flat, torch.cat([ref_mat.detach().flatten(), ref_vec.detach()]),
                                   rtol=1e-6, atol=1e-7)


def test_clipping_follows_clip_grad_norm():
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(7, generator=g) * 3, torch.randn(4, generator=g)]
    total = global_norm([x.norm().item() for x in grads])
    params = [torch.zeros_like(x, requires_grad=True) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x.clone()
    ref = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert total == pytest.approx(ref.item(), rel=1e-6)
    coef = clip_coefficient(total, 1.0)
    for p, x in zip(params, grads):
        torch.testing.assert_close(p.grad, x * coef)
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(5.0, None) == 1.0


# ---- trainer -------------------------------------------------------------------------------------------------------
def test_overlap_defers_the_last_update_until_flush():
    ids, targets = batch()
    optim = AdamWConfig(lr=1e-2)
    overlap = StreamedTrainer(DEBUG, knobs_for("overlap", **FP32), optim=optim, backend="cpu")
    after = StreamedTrainer(DEBUG, knobs_for("double-buffer", **FP32), optim=optim, backend="cpu")
    for _ in range(2):
        assert overlap.step(ids, targets).loss == pytest.approx(after.step(ids, targets).loss, rel=1e-6)
    pending = overlap.store.master(0).clone()
    assert not torch.allclose(pending, after.store.master(0))  # the second update has not run yet
    plan = overlap.flush()
    assert plan is not None and plan.step == 1 and sorted(plan.applied_units) == sorted(DEBUG.units())
    assert overlap.flush() is None  # nothing left
    torch.testing.assert_close(overlap.store.master(0), after.store.master(0), rtol=1e-6, atol=1e-7)
    assert overlap.store.steps == after.store.steps == {u: 2 for u in DEBUG.units()}


@pytest.mark.parametrize("knobs", [knobs_for("arrival", **FP32),
                                   knobs_for("arrival-split", gpu_optimizer_fraction=1.0, retain_grads=2, **FP32),
                                   knobs_for("arrival", resident_layers=4, resident_embeddings=True, **FP32)],
                         ids=["arrival", "arrival-split-all-gpu", "arrival-all-resident"])
def test_without_a_global_norm_only_the_unit_with_non_finite_gradients_is_skipped(knobs, monkeypatch):
    """clip=0 ("arrival" updates a unit as soon as its gradients land): nothing can wait for a global norm,
    so a unit whose own gradients are not finite is skipped and reported; the others are updated. A GPU update
    ("arrival-split") decides the skip on the device, and the step's bookkeeping says the same afterwards."""
    from megatrain.exec.layers import layer_functions

    real = layer_functions(False)[1]
    tr = StreamedTrainer(DEBUG, knobs, optim=AdamWConfig(lr=1e-2), backend="cpu")
    ids, targets = batch()
    tr.step(ids, targets)
    tr.flush()  # resident units: bring the host store up to date before reading it
    before = {u: tr.store.master(u).clone() for u in DEBUG.units()}
    calls = {"n": 0}

    def poison_layer_2(w, x, cos, sin, spec, grad_out, grad_acc):
        out = real(w, x, cos, sin, spec, grad_out, grad_acc)
        if calls["n"] == 1:  # backward runs layers 3, 2, 1, 0: the second call is layer 2
            grad_acc["self_attn.q_proj.weight"][0, 0] = float("inf")
        calls["n"] += 1
        return out

    monkeypatch.setattr(tr._work.compute, "layer_backward", poison_layer_2)  # the StepWork the first step built
    r = tr.step(ids, targets)
    tr.flush()
    assert not r.skipped and r.update.skipped_units == [2]
    assert sorted(r.update.applied_units) == sorted(u for u in DEBUG.units() if u != 2)
    assert torch.equal(tr.store.master(2), before[2]) and tr.store.steps[2] == 1
    assert not torch.equal(tr.store.master(1), before[1]) and tr.store.steps[1] == 2


def test_user_mistakes_get_clear_errors():
    tr = StreamedTrainer(DEBUG, knobs_for("serial", **FP32), backend="cpu")
    ids, targets = batch()
    with pytest.raises(ValueError, match="every target of the batch is -100"):
        tr.step(ids, torch.full_like(targets, -100))
    with pytest.raises(ValueError, match=r"must both be \(batch, seq\)"):
        tr.step(ids, targets[:, :-1])
    with pytest.raises(ScheduleError, match="retain_grads=1 keeps them on the GPU"):  # before any allocation
        StreamedTrainer(DEBUG, knobs_for("arrival-split", clip=1.0, retain_grads=1, **FP32), backend="cpu")


def test_megatrain_train_runs_the_debug_model(capsys, tmp_path):
    csv = tmp_path / "timeline.csv"
    assert main(["train", "--model", "debug", "--steps", "3", "--seq", "16", "--schedule", "long-context",
                 "--device", "cpu", "--set", "compute_dtype=fp32", "--timeline", str(csv), "--no-progress",
                 "--out-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert out.count("loss") >= 3 and "done: 3 steps" in out
    assert csv.read_text().splitlines()[0].split(",") == TIMELINE_COLUMNS
    # Clipping is one setting, the schedule's: a clipping schedule that cannot redo its updates on the host is one
    # clear error naming both ways out, and the old optimizer.grad_clip says where it went.
    assert main(["train", "--schedule", "arrival-split", "--set", "clip=1.0", "--set", "retain_grads=1", "--device",
                 "cpu", "--steps", "1", "--out-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "clip=0" in err and "retain_grads=0" in err and err.count("\n") == 1
    assert main(["train", "--set", "optimizer.grad_clip=0", "--device", "cpu", "--steps", "1",
                 "--out-dir", str(tmp_path / "runs")]) == 2
    assert "schedule.clip" in capsys.readouterr().err


def test_host_rss_grows_by_the_planned_store_bytes():
    """No hidden copies or rounding: building the store raises the process RSS by its planned size (within 5%)."""
    import psutil  # a test dependency: missing, the suite fails (never skips)
    spec = ModelSpec(**{**DEBUG.to_dict(), "name": "rss", "hidden_size": 256, "intermediate_size": 704,
                        "vocab_size": 4096, "num_layers": 6, "head_dim": 64, "rope_scaling": DEBUG.rope_scaling})
    knobs = ScheduleKnobs()
    tiles = init_tiles(spec)
    proc = psutil.Process()
    # Heap pages freed by earlier tests stay in the RSS and would be reused by the store, hiding its growth: give
    # them back to the OS first (glibc).
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = proc.memory_info().rss
    store = HostStore(spec, resolve_host_layout(spec, knobs), CpuBackend(), tiles)
    grown = proc.memory_info().rss - before
    planned = plan_memory(spec, B, T, knobs, backend="cpu").host.store_bytes
    print(f"\nstore of {spec.num_params / 1e6:.1f} M params: RSS +{grown / 2**20:.1f} MiB, "
          f"planned {planned / 2**20:.1f} MiB")
    assert abs(grown - planned) <= 0.05 * planned
    del store


def test_measured_and_predicted_timelines_of_one_program_match_task_by_task():
    from megatrain.sim.engine import simulate

    knobs = knobs_for("overlap", micro_batches=2, **FP32)
    rt, program = prepared(knobs)
    measured = rt.run()
    predicted = simulate(program, "cpu").timeline
    assert list(measured.columns) == list(predicted.columns)
    assert dict(measured.dtypes) == dict(predicted.dtypes)
    keys = ["task", "kind", "layer", "micro", "stream", "bytes", "flops"]
    m = measured[keys].sort_values("task").reset_index(drop=True)
    p = predicted[keys].sort_values("task").reset_index(drop=True)
    assert m.equals(p)


@pytest.mark.parametrize("wire", ["bf16", "fp32"])
def test_bf16_compute_tracks_fp32_compute(wire):
    """bf16 activations (weights streamed in bf16, or fp32 cast on the device) stay within bf16 tolerance of fp32."""
    losses = {}
    for compute in ("fp32", "bf16"):
        tr = StreamedTrainer(DEBUG, knobs_for("overlap", compute_dtype=compute, weight_wire=wire, micro_batches=2),
                             optim=AdamWConfig(lr=1e-2), backend="cpu")
        losses[compute] = [tr.step(*batch(seed)).loss for seed in range(3)]
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert b == pytest.approx(a, rel=2e-2)
    assert losses["fp32"] != losses["bf16"]  # the bf16 path really ran in bf16


def test_bf16_gradients_update_in_chunks_through_one_scratch_buffer(monkeypatch):
    """The update converts bf16 gradients chunk by chunk; chunking changes nothing (AdamW is elementwise)."""
    import megatrain.ir.placement as placement

    knobs = knobs_for("overlap", grad_wire="bf16", compute_dtype="fp32")
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, TIED.vocab_size, (B, T + 1), generator=g) for _ in range(3)]

    def train(chunk):
        monkeypatch.setattr(placement, "GRAD_SCRATCH_ELEMENTS", chunk)
        trainer = StreamedTrainer(TIED, knobs, init_tiles(TIED), optim=AdamWConfig(lr=1e-2), backend="cpu")
        scratch = trainer.store.layout.grad_scratch_elements
        assert scratch == min(chunk, max(TIED.unit_params(u) for u in TIED.units()))
        assert trainer.store.bytes_by_component()["fp32 gradient scratch"] == 4 * scratch
        for tokens in batches:
            trainer.step(tokens[:, :-1], tokens[:, 1:])
        return trainer.tiles()

    whole, chunked = train(1 << 26), train(1000)  # 1000 elements: every unit takes several chunks
    for u in whole:
        assert torch.equal(whole[u], chunked[u]), u


def test_a_dropped_trainer_frees_its_store_and_stops_its_stream_threads():
    """The stream threads live across steps but must not keep a discarded trainer's host store alive."""
    import gc
    import threading
    import weakref

    before = set(threading.enumerate())
    trainer = StreamedTrainer(DEBUG, knobs_for("overlap", compute_dtype="fp32"), backend="cpu")
    tokens = torch.randint(0, DEBUG.vocab_size, (B, T + 1))
    trainer.step(tokens[:, :-1], tokens[:, 1:])
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith("megatrain-")]
    assert len(started) == 4  # one per stream
    store = weakref.ref(trainer.store)
    del trainer
    gc.collect()
    assert store() is None, "the host store outlived its trainer"
    for t in started:
        t.join(5)
        assert not t.is_alive(), f"{t.name} still runs after its trainer was dropped"


def test_compiled_layers_train_as_the_eager_layers_do():
    """compile_layers=true (torch.compile of the decoder layer, here on the CPU backend) trains the same numbers as
    the eager layer to fp32 rounding: same losses, same weights after three steps of every kind of task. That the
    layer was compiled is read from the compiler's own counters (an eager fallback would train the same numbers):
    Dynamo converted its frames without a graph break, and every frame it was handed became a graph."""
    ids, targets = batch()
    optim = AdamWConfig(lr=1e-2)
    torch._dynamo.reset()  # forget graphs compiled by earlier tests: this run must convert its own frames
    counters.clear()
    fused = StreamedTrainer(DEBUG, knobs_for("overlap", compile_layers=True, **FP32), optim=optim, backend="cpu")
    eager = StreamedTrainer(DEBUG, knobs_for("overlap", **FP32), optim=optim, backend="cpu")
    for _ in range(3):
        assert fused.step(ids, targets).loss == pytest.approx(eager.step(ids, targets).loss, rel=1e-5)
    frames, stats = dict(counters["frames"]), dict(counters["stats"])
    assert frames.get("total", 0) >= 1 and frames.get("ok") == frames["total"], frames  # converted, none fell back
    assert stats.get("unique_graphs", 0) >= 1, stats
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Adam divides by sqrt(v): where a gradient is ~0 a rounding difference moves the weight by a fraction of a
    # step (lr = 1e-2), hence the tolerance of 1% of one step; the weights of a wrong layer differ by whole steps.
    for u in DEBUG.units():
        torch.testing.assert_close(fused.tiles()[u], eager.tiles()[u], rtol=0, atol=1e-4)


def test_resident_units_reach_the_host_store_on_flush_and_survive_a_new_batch_shape():
    """Resident units are updated on the device; the host store sees them after flush(), and a new batch shape
    (a new Program, new buffers) continues from where the old buffers were, as a streamed-only run does."""
    optim = AdamWConfig(lr=1e-2)
    plain = StreamedTrainer(DEBUG, knobs_for("arrival", **FP32), optim=optim, backend="cpu")
    resident = StreamedTrainer(DEBUG, knobs_for("arrival", resident_embeddings=True, resident_layers=2, **FP32),
                               optim=optim, backend="cpu")
    ids, targets = batch()
    for tr in (plain, resident):
        tr.step(ids, targets)
    stale = resident.store.master(EMBED).clone()
    assert torch.equal(stale, resident.store.master(EMBED))
    resident.flush()
    assert not torch.equal(stale, resident.store.master(EMBED))  # the device's update reached the host
    for tr in (plain, resident):
        tr.step(ids[:2], targets[:2])  # a new Program: the resident buffers are written back, then reloaded
        tr.step(ids, targets)
    for u in DEBUG.units():
        torch.testing.assert_close(resident.tiles()[u], plain.tiles()[u], rtol=1e-5, atol=1e-6)
    assert resident.store.steps == plain.store.steps
