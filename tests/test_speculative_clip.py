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
    """Counted, not assumed. The debug model's norm (~3) exceeds MAX_NORM in every step: units updated on the GPU
    as their gradients land (resident) are undone and redone in each, the host units wait for the norm (deferred);
    with the speculation forced every unit is redone. With a max norm nothing reaches, nothing is redone or
    deferred and the speculative run is bitwise the unclipped arrival run."""
    n_units = len(SPECS["llama"].units())
    results, _ = run(knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True, resident_layers=2, **FP32), 4)
    assert all(r.grad_norm > MAX_NORM for r in results), [r.grad_norm for r in results]
    for r in results:  # embedding, head and layers 0-1 on the GPU; layers 2-3 on the host
        assert set(r.update.redone_units) == {EMBED, HEAD, 0, 1}, r.update
        assert set(r.update.deferred_units) == {2, 3}, r.update
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
    sched = build_schedule(PRESETS["debug"], 4, 32, knobs_for("arrival-resident", clip=1.0, resident_layers=1))
    g, norm = sched.graph, Task.parse("N")
    updates = [t for t in g.nodes if t.kind.value == "U"]
    assert updates and not any(g.has_edge(norm, u) for u in updates)
    for u in updates:
        redo = Task.parse("V" + u.id[1:])
        assert g.has_edge(u, redo) and g.has_edge(norm, redo)
    program = lower(sched)
    streams = {program.tasks[t].stream for t in program.tasks if t.startswith("V")}
    assert streams == {"cpu", "compute"}  # host units on the host threads, resident units on the GPU
    g.remove_edge(norm, Task.parse("V3"))
    with pytest.raises(ScheduleError, match="no CLIP_REDO after both"):
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
