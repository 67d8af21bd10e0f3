"""Speculative exact clipping: updates as gradients land (arrival timing), undone and redone with the clip
coefficient (CLIP_REDO) in the steps whose global norm exceeds the max.

Equality with a plain loop (HF model + torch.optim.AdamW + clip_grad_norm_) is in test_exec_training.py (the
`*-clip` variants, the bf16-gradient and the non-finite-step tests); here: the undo itself, that the redo path
really runs and that the speculation is exact when it does not, the DAG's rules, and the simulator's price.
"""
from __future__ import annotations

import pytest
import torch

from megatrain.exec.optim import AdamWConfig, adamw_undo, adamw_update
from megatrain.compile.builders import build_schedule
from megatrain.ir.dag import ScheduleError, validate
from megatrain.ir.facts import StepFacts
from megatrain.compile.knobs import knobs_for
from megatrain.compile.lower import lower
from megatrain.ir.tasks import Task
from megatrain.model.presets import PRESETS
from megatrain.model.spec import EMBED, HEAD
from megatrain.sim import simulate
from megatrain.engine.trainer import StreamedTrainer

from test_exec_training import FP32, LR, MAX_NORM, SPECS, WD, batches, initial_tiles, speculate_always


@pytest.mark.parametrize("step", [1, 2, 50])
def test_adamw_undo_inverts_one_update_to_fp32_rounding(step):
    g = torch.Generator().manual_seed(step)
    n, decay = 5000, 3000
    p0 = torch.randn(n, generator=g)
    m0 = 0.01 * torch.randn(n, generator=g) if step > 1 else torch.zeros(n)  # moments of earlier steps
    v0 = m0.square() + 1e-4 * torch.rand(n, generator=g) if step > 1 else torch.zeros(n)
    grad = 0.01 * torch.randn(n, generator=g)
    cfg = AdamWConfig(weight_decay=0.1)
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    adamw_update(p, grad, m, v, step, decay, 1e-3, cfg)
    moved = (p - p0).abs()
    assert moved.max() > 0
    adamw_undo(p, grad, m, v, step, decay, 1e-3, cfg)
    # a few fp32 roundings of p and of the step (which moves it ~1e-3)
    assert ((p - p0).abs() <= 2.5e-7 * (p0.abs() + moved)).all()
    torch.testing.assert_close(m, m0, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(v, v0, rtol=1e-4, atol=1e-11)


def test_adamw_undo_does_not_depend_on_its_chunk():
    """A GPU undoes in larger chunks than the host (exec/optim.UNDO_CHUNK_DEVICE): bitwise the same result, the
    weight decay's boundary falling inside a chunk or on its edge."""
    g = torch.Generator().manual_seed(7)
    n = 10_000
    p0, m0, grad = torch.randn(n, generator=g), 0.01 * torch.randn(n, generator=g), 0.01 * torch.randn(n, generator=g)
    v0 = m0.square() + 1e-4 * torch.rand(n, generator=g)
    cfg = AdamWConfig(weight_decay=0.1)
    out = []
    for chunk in (1 << 20, 4096, 1000, 999):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        adamw_undo(p, grad, m, v, 3, 6000, 1e-3, cfg, chunk=chunk)
        out.append((p, m, v))
    for p, m, v in out[1:]:
        assert torch.equal(p, out[0][0]) and torch.equal(m, out[0][1]) and torch.equal(v, out[0][2])


def run(knobs, steps: int):
    spec = SPECS["llama"]
    trainer = StreamedTrainer(spec, knobs, initial_tiles(spec), optim=AdamWConfig(lr=LR, weight_decay=WD),
                              backend="cpu", timeout_s=30)
    results = [trainer.step(ids, targets) for ids, targets in batches(spec, steps)]
    return results, trainer.state_dict()


def test_the_redo_runs_in_clipping_steps_and_speculation_is_exact_without_them(monkeypatch):
    """Counted, not assumed. The debug model's norm (~3) exceeds MAX_NORM in every step. In the first, units
    updated on the GPU as their gradients land (resident) are undone and redone, and the host units landing after
    the partial norm crossed the max wait for it (deferred); after a step that clipped every update waits for the
    norm, the GPU's too (clip_redo unset; "step-end" redoes the GPU's in every step). With the speculation forced
    every unit is redone. With a max norm nothing reaches, nothing is redone or deferred and the speculative run is
    bitwise the unclipped arrival run."""
    n_units = len(SPECS["llama"].units())
    gpu, host = {EMBED, HEAD, 0, 1}, {2, 3}  # embedding, head and layers 0-1 on the GPU; layers 2-3 on the host
    results, _ = run(knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True, resident_layers=2, **FP32), 4)
    assert all(r.grad_norm > MAX_NORM for r in results), [r.grad_norm for r in results]
    first, later = results[0].update, [r.update for r in results[1:]]
    assert set(first.redone_units) == gpu and set(first.deferred_units) == host, first
    assert all(not u.redone_units and set(u.deferred_units) == gpu | host for u in later), later
    results, _ = run(knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True, resident_layers=2,
                               clip_redo="step-end", **FP32), 4)
    assert all(set(r.update.redone_units) == gpu and set(r.update.deferred_units) == host for r in results)
    with monkeypatch.context() as m:
        speculate_always(m)
        forced, _ = run(knobs_for("arrival", clip=MAX_NORM, **FP32), 4)
    assert all(sorted(r.update.redone_units) == sorted(r.update.applied_units) and len(r.update.redone_units)
               == n_units and not r.update.deferred_units for r in forced), [r.update for r in forced]
    never_results, never = run(knobs_for("arrival", clip=1e9, **FP32), steps=6)
    assert all(r.grad_norm < 1e9 and not r.update.redone_units and not r.update.deferred_units
               for r in never_results)
    _, plain = run(knobs_for("arrival", clip=0, **FP32), steps=6)
    assert all(torch.equal(never[k], plain[k]) for k in plain)


def test_updates_run_before_the_norm_and_each_has_a_redo_after_it_and_the_norm():
    """A resident unit's redo runs on the GPU at the end of the step, after its update and the norm; a host unit's
    runs on the host threads at the start of the next step (step_offset -1: the step boundary orders it after the
    last step's norm and update), before the copy of its weights and the offload that overwrites its gradients."""
    sched = build_schedule(PRESETS["debug"], 4, 32, knobs_for("arrival-resident", clip=1.0, resident_layers=1))
    g, norm = sched.graph, Task.parse("N")
    updates = [t for t in g.nodes if t.kind.value == "U"]
    assert updates and not any(g.has_edge(norm, u) for u in updates)
    resident = {EMBED, HEAD, 0}
    for u in updates:
        redo = Task.parse("V" + u.id[1:])
        if u.unit in resident:
            assert g.has_edge(u, redo) and g.has_edge(norm, redo) and g.nodes[redo].get("step_offset", 0) == 0
        else:
            assert g.nodes[redo]["step_offset"] == -1 and not g.has_edge(norm, redo)
            assert g.has_edge(redo, Task.parse(f"O{u.unit}")) and g.has_edge(redo, Task.parse(f"P{u.unit}"))
    program = lower(sched)
    streams = {program.tasks[t].unit: program.tasks[t].stream for t in program.tasks if t.startswith("V")}
    assert streams == {u: "compute" if u in resident else "cpu" for u in streams}  # where the state is
    cpu = [program.tasks[t] for t in program.streams["cpu"]]
    redos = [t.unit for t in cpu if t.kind == "V"]
    assert redos == [1, 2, 3] and cpu[:3] == [t for t in cpu if t.kind == "V"]  # first, in forward order
    g.remove_edge(norm, Task.parse("V0"))
    with pytest.raises(ScheduleError, match="no CLIP_REDO after both"):
        validate(sched)
    g.add_edge(norm, Task.parse("V0"))
    validate(sched)
    g.remove_edge(Task.parse("V3"), Task.parse("P3"))
    with pytest.raises(ScheduleError, match="V3 redoes the last step's update of unit 3 in this step, but P3 may"):
        validate(sched)


def test_kept_gradients_cannot_be_redone_on_the_host():
    with pytest.raises(ScheduleError, match="retain_grads=1 keeps them on the GPU"):
        build_schedule(PRESETS["debug"], 4, 32, knobs_for("arrival-split", clip=1.0, retain_grads=1))


def test_the_simulator_prices_speculation_at_nothing_and_a_clipping_step_at_two_updates():
    spec = PRESETS["bench-3b"]
    plain = simulate(lower(build_schedule(spec, 8, 2048, knobs_for("arrival", clip=0))), "h200-measured")
    spec_prog = lower(build_schedule(spec, 8, 2048, knobs_for("arrival", clip=1.0)))
    quiet = simulate(spec_prog, "h200-measured")
    clipping = simulate(spec_prog, "h200-measured", StepFacts(clip_share=1.0))
    assert quiet.summary.step_s == pytest.approx(plain.summary.step_s, rel=0.01)
    # every parameter undone and redone on the host threads after the backward
    assert clipping.summary.step_s - quiet.summary.step_s > 1.5 * spec.num_params / 20e9


def test_deferred_and_redone_updates_both_train_like_the_plain_loop(monkeypatch):
    """At max norm 2 the debug model's norm (~3) exceeds the max in every step. In the first, the first unit norms
    to land stay below it, so those units are updated, undone and redone, and the units landing after the partial
    norm crossed the max wait for the norm (deferred); after a step that clipped, every host update waits. Both
    paths equal clip_grad_norm_."""
    import test_exec_training as te

    monkeypatch.setattr(te, "MAX_NORM", 2.0)
    ref = te.reference.__wrapped__("llama", clip=True)
    results, state = run(knobs_for("arrival", clip=2.0, **FP32), te.STEPS)
    first, later = results[0].update, [r.update for r in results[1:]]
    assert first.deferred_units and first.redone_units, (first.deferred_units, first.redone_units)
    n_units = len(SPECS["llama"].units())
    assert all(len(u.deferred_units) == n_units and not u.redone_units for u in later)
    te.assert_same_training(results, state, ref, "llama", "arrival-clip-2")


def test_the_last_steps_host_redos_run_in_a_flush_as_they_would_in_the_next_step():
    """A host unit's redo runs at the start of the next step; `flush()` (a checkpoint, `state_dict`) runs the last
    step's instead, and the next step then has none to run. Bitwise the same training as a run that never flushed
    before its end; the debug model's norm exceeds MAX_NORM in every step, so its host updates are deferred."""
    knobs = knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True, resident_layers=2, **FP32)
    spec = SPECS["llama"]
    straight, flushed = (StreamedTrainer(spec, knobs, initial_tiles(spec), optim=AdamWConfig(lr=LR, weight_decay=WD),
                                         backend="cpu", timeout_s=30) for _ in range(2))
    for i, (ids, targets) in enumerate(batches(spec, 4)):
        a, b = straight.step(ids, targets), flushed.step(ids, targets)
        assert a.loss == b.loss and a.grad_norm == b.grad_norm
        if i == 1:  # only `flushed` flushes, here
            host = {2, 3}
            assert host <= set(b.update.deferred_units) and not host & set(b.update.applied_units)  # their redo waits
            flushed.state_dict()
            assert host <= set(b.update.applied_units)  # the flush applied them, clipped
    end_a, end_b = straight.state_dict(), flushed.state_dict()
    assert end_a.keys() == end_b.keys() and all(torch.equal(end_a[k], end_b[k]) for k in end_a)


def test_clip_redo_step_end_keeps_the_redo_in_its_step_and_is_refused_where_it_changes_nothing():
    """clip_redo="step-end": a host unit's V after the norm and its update, at the end of its own step, as before
    the knob existed; a record made then (no clip_redo key) rebuilds that Program. Where no host redo exists the
    knob is refused with the reason."""
    from megatrain.compile.knobs import ScheduleKnobs
    from megatrain.compile.record import ProgramRecord, program_of

    knobs = knobs_for("arrival-resident", clip=1.0, resident_layers=1, clip_redo="step-end")
    g, norm = build_schedule(PRESETS["debug"], 4, 32, knobs).graph, Task.parse("N")
    v3 = Task.parse("V3")
    assert g.has_edge(norm, v3) and g.has_edge(Task.parse("U3"), v3) and g.nodes[v3].get("step_offset", 0) == 0
    old = lower(build_schedule(PRESETS["debug"], 4, 32, knobs))
    record = ProgramRecord.of(old).to_dict()
    del record["knobs"]["clip_redo"]  # as a record written before the knob
    assert program_of(record).fingerprint() == old.fingerprint()
    new = lower(build_schedule(PRESETS["debug"], 4, 32, ScheduleKnobs.from_dict(record["knobs"])))
    assert new.fingerprint() != old.fingerprint()  # unset today: the next step's
    for bad in (dict(clip=0), dict(clip=1.0, optimizer="overlap")):
        with pytest.raises(ScheduleError, match="clip_redo='step-end' has no effect"):
            build_schedule(PRESETS["debug"], 4, 32, knobs_for("arrival", clip_redo="step-end", **bad))


def test_a_switched_schedule_defers_after_a_clipping_step_as_the_one_before_it_would():
    """Whether the last step clipped belongs to the run, not its Program: after `switch_schedule` (auto's trials, a
    re-choice) the first step of the new Program defers its updates, as the old Program's next step would have,
    instead of speculating and undoing and redoing every update (on the H200 a 1.4 s step in place of 0.8 s,
    which auto's trials measured as the candidate's). The debug model's norm exceeds MAX_NORM in every step."""
    spec = SPECS["llama"]
    knobs = knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True, resident_layers=2, **FP32)
    other = knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True, resident_layers=2, buffers=3, **FP32)
    trainer = StreamedTrainer(spec, knobs, initial_tiles(spec), optim=AdamWConfig(lr=LR, weight_decay=WD),
                              backend="cpu", timeout_s=30)
    data = batches(spec, 3)
    first = trainer.step(*data[0])
    assert first.clipped and first.update.redone_units  # the run's first step speculates: nothing has clipped yet
    trainer.switch_schedule(other, *data[1][0].shape)
    after = trainer.step(*data[1]).update
    n_units = len(spec.units())
    assert not after.redone_units and len(after.deferred_units) == n_units, after
