"""A schedule switch to another host layout (issue 24 item 5: `auto` measures candidates of every layout): the
store is taken over in place (`HostStore.relayout`), the training numbers go on as if the run had had the new
layout from the start, a layout that would not fit the host is refused before anything changes, and a Program
that cannot start puts the old layout back. CPU backend, debug model."""
import pytest
import torch

from megatrain.compile.knobs import knobs_for
from megatrain.compile.resolve import resolve_host_layout
from megatrain.data.batches import synthetic_batches
from megatrain.engine import trainer as trainer_module
from megatrain.engine.trainer import HostMemoryShort, StreamedTrainer
from megatrain.exec.store import HostStore
from megatrain.compile.advice import plan_memory
from megatrain.model.presets import PRESETS
from megatrain.plan.machine import MemoryLimit

DEBUG = PRESETS["debug"]
# bf16 compute: the weight wire moves the same values in another dtype (not a numerics knob), so a run may change
# wires mid-way and compute the same numbers. arrival streams bf16 weights into per-unit landing tiles; lean
# streams the fp32 master through a gradient ring; arrival-resident keeps units' state on the GPU placement.
ARRIVAL = knobs_for("arrival", compute_dtype="bf16", clip=0.0)
LEAN = knobs_for("lean", compute_dtype="bf16", clip=0.0)


def _run(switch_at: int | None, steps: int = 4):
    trainer = StreamedTrainer(DEBUG, ARRIVAL, backend="cpu", seed=3)
    batches = synthetic_batches(DEBUG, 2, 16, 0)
    losses = []
    for i in range(steps):
        if i == switch_at:
            trainer.switch_schedule(LEAN, 2, 16, "lean")
        losses.append(trainer.step(*next(batches)).loss)
    return trainer, losses


def test_the_store_is_taken_over_with_its_state_and_sized_as_the_planner_says():
    a, b = resolve_host_layout(DEBUG, ARRIVAL), resolve_host_layout(DEBUG, LEAN)
    assert (a.weight_wire, a.grad_ring) != (b.weight_wire, b.grad_ring)
    store = HostStore(DEBUG, a)
    g = torch.Generator().manual_seed(0)
    for u in DEBUG.units():
        store.master(u).copy_(torch.randn(store.master(u).shape, generator=g))
        store.exp_avg(u).fill_(0.25)
        store.exp_avg_sq(u).fill_(0.5)
        store.steps[u] = 7
        store.refresh_stream(u)
    before = {u: store.master(u).clone() for u in DEBUG.units()}
    before_bytes = store.store_bytes()
    moved = store.relayout(b)
    assert moved.layout == b and moved.steps == {u: 7 for u in DEBUG.units()}
    for u in DEBUG.units():
        assert torch.equal(moved.master(u), before[u])
        assert bool((moved.exp_avg(u) == 0.25).all()) and bool((moved.exp_avg_sq(u) == 0.5).all())
    # the planner's figures (its runtime overhead is not the store's)
    planned = plan_memory(DEBUG, 2, 16, LEAN, backend="cpu").host
    assert moved.bytes_by_component() == {k: v for k, v in planned.components.items()
                                          if k in moved.bytes_by_component()}
    # what switch_schedule checks against the host: the planned store less the running one (the state is equal)
    assert moved.store_bytes() == planned.store_bytes < before_bytes  # a ring and no streaming copy: smaller
    back = moved.relayout(a)  # the streaming copy is rebuilt from the master
    for u in DEBUG.units():
        assert torch.equal(back.stream_tile(u).float(), before[u].bfloat16().float())
    with pytest.raises(ValueError, match="keeps the optimizer state"):
        back.relayout(resolve_host_layout(DEBUG, knobs_for("lean", state_dtype="bf16")))


def test_a_run_that_changes_layout_trains_as_one_that_had_it_from_the_start():
    """4 steps of arrival vs 2 of arrival then 2 of lean (another layout): the same losses and final weights as
    a run that never switched (the schedules compute the same numbers; only where they live changed)."""
    plain, plain_losses = _run(None)
    switched, switched_losses = _run(2)
    assert switched.store.layout == resolve_host_layout(DEBUG, LEAN) and switched.knobs == LEAN
    assert switched_losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    for u in DEBUG.units():
        torch.testing.assert_close(switched.store.master(u), plain.store.master(u), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(switched.store.exp_avg_sq(u), plain.store.exp_avg_sq(u), rtol=1e-6, atol=1e-12)


def test_a_layout_that_would_not_fit_the_host_is_refused_before_anything_changes(monkeypatch):
    trainer = StreamedTrainer(DEBUG, knobs_for("lean", compute_dtype="bf16", clip=0.0), backend="cpu")
    batches = synthetic_batches(DEBUG, 2, 16, 0)
    trainer.step(*next(batches))
    store, program = trainer.store, trainer._program
    monkeypatch.setattr(trainer_module, "host_memory", lambda: MemoryLimit(1000, "available", 2**30))
    with pytest.raises(HostMemoryShort, match="needs .* GiB more host memory for its layout"):
        trainer.switch_schedule(ARRIVAL, 2, 16, "arrival")
    assert trainer.store is store and trainer._program is program  # nothing changed: the run goes on
    trainer.step(*next(batches))


def test_another_optimizer_state_is_refused_before_anything_is_released():
    trainer = StreamedTrainer(DEBUG, LEAN, backend="cpu")
    batches = synthetic_batches(DEBUG, 2, 16, 0)
    trainer.step(*next(batches))
    store, program = trainer.store, trainer._program
    with pytest.raises(ValueError, match="keeps the optimizer state"):
        trainer.switch_schedule(knobs_for("lean", compute_dtype="bf16", clip=0.0, state_dtype="bf16"), 2, 16, "bf16")
    assert trainer.store is store and trainer._program is program and trainer._runtime is not None
    trainer.step(*next(batches))


def test_a_program_that_cannot_start_after_a_relayout_puts_the_old_layout_back(monkeypatch):
    trainer = StreamedTrainer(DEBUG, ARRIVAL, backend="cpu")
    batches = synthetic_batches(DEBUG, 2, 16, 0)
    trainer.step(*next(batches))
    trainer.flush()  # the switch's own flush then applies nothing: the state below is the one to keep
    old_layout, old_program = trainer.store.layout, trainer._program
    kept = {u: (trainer.store.master(u).clone(), trainer.store.exp_avg(u).clone(),
                trainer.store.exp_avg_sq(u).clone()) for u in DEBUG.units()}
    real = StreamedTrainer.use_program

    def use_program(self, program):
        if program.name == "lean":
            raise torch.OutOfMemoryError("CUDA out of memory (made by the test)")
        return real(self, program)

    monkeypatch.setattr(StreamedTrainer, "use_program", use_program)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.switch_schedule(LEAN, 2, 16, "lean")
    assert trainer.store.layout == old_layout
    for u in DEBUG.units():  # there and back: the master and moments are the ones before the switch, bit for bit
        master, m, v = kept[u]
        assert torch.equal(trainer.store.master(u), master)
        assert torch.equal(trainer.store.exp_avg(u), m) and torch.equal(trainer.store.exp_avg_sq(u), v)
    trainer.use_program(old_program)  # what auto does after a failed switch (autoswitch._restore)
    trainer.step(*next(batches))  # the run goes on


# Resident layers (knob resident_layers) keep their gradients in their GPU buffer and are never streamed: the store
# gives them master and moments (what checkpoints and switches read) but no landing tile and no streaming copy.
def _resident(k: int, wire: str = "bf16"):
    return knobs_for("arrival-resident", resident_layers=k, weight_wire=wire, compute_dtype="bf16", clip=0.0)


def test_resident_layers_have_no_landing_tile_or_streaming_copy_and_the_planner_agrees():
    tight, full = resolve_host_layout(DEBUG, _resident(2)), resolve_host_layout(DEBUG, _resident(0))
    resident = set(tight.resident_layers)
    assert len(resident) == 2 and not full.resident_layers
    store, wide = HostStore(DEBUG, tight), HostStore(DEBUG, full)
    for u in DEBUG.units():
        assert store.master(u).numel() == wide.master(u).numel()  # the state stays for every unit
        if u in resident:
            with pytest.raises(KeyError, match="resident on the GPU"):
                store.grad(u)
            assert store.stream_tile(u) is None
        else:
            assert store.grad(u).numel() == wide.grad(u).numel() and store.stream_tile(u) is not None
    # 4 B (fp32 landing) + 2 B (bf16 streaming copy) less a resident parameter, by the store's own allocation
    saved = sum(DEBUG.unit_params(u) for u in resident) * (4 + 2)
    assert wide.store_bytes() - store.store_bytes() == saved
    planned = plan_memory(DEBUG, 2, 16, _resident(2), backend="cpu").host
    assert store.bytes_by_component() == {k: v for k, v in planned.components.items()
                                          if k in store.bytes_by_component()}
    # a store with the landing tiles runs a Program with more resident layers, not the other way round
    assert full.serves(tight) and not tight.serves(full) and tight.serves(tight)
    assert not full.serves(resolve_host_layout(DEBUG, _resident(2, wire="fp32")))  # another wire: never


def test_a_switch_to_more_resident_layers_keeps_the_store_and_to_fewer_relays_it():
    """arrival-resident with 1, then 2 (served: the same store), then 0 resident layers (a relayout), against a
    run that kept 1 throughout: the same losses and weights (where the state lives changes no number)."""
    def run(switches):
        trainer = StreamedTrainer(DEBUG, _resident(1), backend="cpu", seed=3)
        batches = synthetic_batches(DEBUG, 2, 16, 0)
        losses, stores = [], []
        for i in range(5):
            if i in switches:
                trainer.switch_schedule(_resident(switches[i]), 2, 16, f"r{switches[i]}")
            stores.append(trainer.store)
            losses.append(trainer.step(*next(batches)).loss)
        trainer.flush()
        trainer._work.sync_resident_to_host()
        return trainer, losses, stores

    plain, plain_losses, _ = run({})
    switched, losses, stores = run({2: 2, 4: 0})
    assert stores[2] is stores[0]  # 1 -> 2 resident layers: served, no relayout
    assert stores[4] is not stores[2] and stores[4].layout == resolve_host_layout(DEBUG, _resident(0))
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    for u in DEBUG.units():
        torch.testing.assert_close(switched.store.master(u), plain.store.master(u), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(switched.store.exp_avg_sq(u), plain.store.exp_avg_sq(u), rtol=1e-6, atol=1e-12)
