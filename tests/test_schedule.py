"""Schedule DAGs: task ids, golden listings, each knob's effect, and the validator catching broken DAGs."""
import os
from pathlib import Path

import pytest

from megatrain.compile.builders import build_schedule
from megatrain.ir.dag import ScheduleError
from megatrain.compile.knobs import NAMED_SCHEDULES, ScheduleKnobs, knobs_for
from megatrain.compile.resolve import resolve
from megatrain.ir.tasks import NORM, B, F, O, P, S, Task, TaskKind, U, V, W
from megatrain.model.presets import PRESETS
from megatrain.model.spec import EMBED, HEAD

GOLDEN = Path(__file__).parent / "golden"
DEBUG = PRESETS["debug"]  # 4 layers


def small(knobs, layers=3, batch=2, seq=8):
    return build_schedule(DEBUG.with_layers(layers), batch, seq, knobs)


@pytest.mark.parametrize("text", ["P3", "P3b", "F3.1", "R0.2", "BH.0", "BE.3", "O3", "OE", "N", "U12", "S2", "W2",
                                  "X4.0", "Y4.1", "PE", "PH", "G3", "G3b", "Z3"])
def test_task_ids_round_trip(text):
    assert Task.parse(text).id == text
    assert Task.parse(text) == Task.parse(Task.parse(text).id)


@pytest.mark.parametrize("bad", ["", "Q3", "Z3b", "F3", "P3.1", "N3", "U3b", "3F", "F-1.0"])
def test_bad_task_ids_are_refused(bad):
    with pytest.raises(ValueError):
        Task.parse(bad)


GOLDEN_CASES = {
    "serial": ScheduleKnobs(buffers=1, optimizer="after"),
    "double_buffer": ScheduleKnobs(buffers=2, optimizer="after"),
    "overlap_mb2": ScheduleKnobs(buffers=3, optimizer="overlap", micro_batches=2),
    "recompute2": ScheduleKnobs(buffers=3, recompute_block=2, optimizer="after"),
    "gpu_adam": ScheduleKnobs(buffers=2, optimizer="gpu"),
    "arrival": ScheduleKnobs(buffers=2, optimizer="arrival", clip=0),
    "long_context": ScheduleKnobs(buffers=2, optimizer="overlap", offload_checkpoints=True),
    # layers 0 and 1 updated on the GPU (U fills w0 / w1), layer 0's gradients kept on the GPU (O0 -> g0)
    "overlap_split": ScheduleKnobs(buffers=2, optimizer="overlap-split", gpu_optimizer_fraction=0.67,
                                   retain_grads=1),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_listing(case):
    """Task listings of 3-layer schedules, reviewed by hand; MEGATRAIN_REGOLD=1 rewrites them."""
    listing = small(GOLDEN_CASES[case]).listing() + "\n"
    path = GOLDEN / f"schedule_{case}.txt"
    if os.environ.get("MEGATRAIN_REGOLD"):
        path.write_text(listing)
    assert listing == path.read_text()


def test_one_buffer_fetches_every_visit_and_serialises():
    s = small(ScheduleKnobs(buffers=1, optimizer="after"))
    g = s.graph
    # Layers are fetched again for the backward since the one slot is evicted in between; the last layer stays
    # resident through the head (which has its own buffer) and is reused.
    assert {t.id for t in g if t.kind is TaskKind.PREFETCH} == {"PE", "PH", "P0", "P1", "P2", "P0b", "P1b"}
    assert g.has_edge(F(0, 0), P(1)) and g.has_edge(F(1, 0), P(2))  # the next copy waits for the compute
    assert g.has_edge(O(2), P(1, back=True))  # and for the offload of the gradients in the slot


def test_more_buffers_let_backward_reuse_resident_layers():
    fetched = {}
    for k in (1, 2, 3, 4):
        s = small(ScheduleKnobs(buffers=k, optimizer="after"), layers=4)
        fetched[k] = sum(1 for t in s.graph if t.kind is TaskKind.PREFETCH and t.back)
    assert fetched == {1: 3, 2: 2, 3: 1, 4: 0}  # k buffers keep the last k layers resident
    s = small(ScheduleKnobs(buffers=2, optimizer="after"), layers=4)
    assert not s.graph.has_edge(F(0, 0), P(1))  # with 2 slots the copy of layer 1 does not wait for F0
    assert s.graph.has_edge(F(0, 0), P(2))


def test_micro_batches_multiply_compute_not_copies():
    one = small(ScheduleKnobs(micro_batches=1))
    four = build_schedule(DEBUG.with_layers(3), 4, 8, ScheduleKnobs(micro_batches=4))
    assert four.count(TaskKind.FORWARD) == 4 * one.count(TaskKind.FORWARD)
    assert four.count(TaskKind.PREFETCH) == one.count(TaskKind.PREFETCH)
    assert four.count(TaskKind.OFFLOAD) == one.count(TaskKind.OFFLOAD)
    assert four.graph.has_edge(B(1, 0), B(1, 1))  # accumulation into one gradient buffer
    assert four.attrs(F(0, 0))["tokens"] == 8  # batch 4 / 4 micro-batches x seq 8


def test_recompute_block_adds_recompute_tasks():
    s = small(ScheduleKnobs(buffers=3, recompute_block=2), layers=4)
    assert sorted(t.id for t in s.graph if t.kind is TaskKind.RECOMPUTE) == ["R0.0", "R2.0"]
    assert s.graph.has_edge(Task.parse("R2.0"), B(3, 0))
    assert s.graph.has_edge(F(1, 0), Task.parse("R2.0"))  # block [2,4) restarts from layer 2's checkpoint
    small(ScheduleKnobs(buffers=2, recompute_block=2), layers=4)  # r buffers suffice (no copy overlap)
    with pytest.raises(ScheduleError, match="buffers >= 3"):
        small(ScheduleKnobs(buffers=2, recompute_block=3), layers=6)


def test_optimizer_placements():
    after = small(ScheduleKnobs(optimizer="after"))
    assert after.graph.has_edge(NORM, U(0)) and after.graph.has_edge(O(0), U(0))
    over = small(ScheduleKnobs(optimizer="overlap"))
    assert over.graph.has_edge(U(0), P(0)) and over.attrs(U(0))["step_offset"] == -1
    assert not over.graph.has_edge(U(0), P(1))  # each prefetch waits only for its own layer's update
    arr = small(ScheduleKnobs(optimizer="arrival", clip=0))
    assert NORM not in arr.graph and arr.graph.has_edge(O(2), U(2))
    gpu = small(ScheduleKnobs(optimizer="gpu"))
    assert gpu.attrs(U(1))["device"] == "gpu" and gpu.attrs(U(EMBED))["device"] == "cpu"
    split = small(ScheduleKnobs(optimizer="split", gpu_optimizer_fraction=0.34), layers=3)
    assert [split.attrs(U(l))["device"] for l in range(3)] == ["gpu", "cpu", "cpu"]
    # speculative: U before N; a host unit's V in the next step, before the copy of its weights and its offload
    spec_clip = small(ScheduleKnobs(optimizer="arrival", clip=1.0))
    assert spec_clip.graph.has_edge(O(2), U(2)) and not spec_clip.graph.has_edge(NORM, U(2))
    assert spec_clip.attrs(V(2))["step_offset"] == -1 and not spec_clip.graph.has_edge(NORM, V(2))
    assert spec_clip.graph.has_edge(V(2), P(2)) and spec_clip.graph.has_edge(V(2), O(2))


def test_overlap_split_updates_spread_layers_on_the_gpu_and_fills_their_weight_slots():
    knobs = ScheduleKnobs(buffers=3, optimizer="overlap-split", gpu_optimizer_fraction=0.5)
    spec = DEBUG.with_layers(6)
    assert resolve(spec, 2, 8, knobs).gpu_streamed_layers == [0, 2, 4]  # every other layer, from layer 0
    s = build_schedule(spec, 2, 8, knobs)
    g, n = s.graph, spec.unit_params(0)
    for layer in range(6):
        on_gpu = layer % 2 == 0
        assert s.attrs(U(layer))["device"] == ("gpu" if on_gpu else "cpu")
        assert s.attrs(U(layer))["step_offset"] == -1  # the previous step's gradients, before this forward
        assert (P(layer) in g) != on_gpu  # a GPU-updated layer's forward needs no copy from the host
    assert s.attrs(F(2, 0))["weights"] == U(2) and g.has_edge(U(2), F(2, 0))
    assert s.attrs(U(2))["fills"] == s.attrs(F(2, 0))["slot"]
    assert g.has_edge(S(2), U(2)) and g.has_edge(U(2), W(2)) and g.has_edge(U(2), O(2))
    assert g.has_edge(W(2), P(2, back=True))  # the backward's copy streams the weights W brought back
    assert s.attrs(S(2))["bytes"] == 16 * n and s.attrs(W(2))["bytes"] == 14 * n  # + bf16 streaming copy
    assert g.has_edge(W(0), S(4))  # two state slots: S4 refills the slot W0 empties
    # state_lookahead=1: S2 is queued on h2d before the copy of layer 1
    h2d = [t for t in s.tasks() if t.kind in (TaskKind.PREFETCH, TaskKind.STATE_PREFETCH)]
    assert h2d.index(S(2)) < h2d.index(P(1)) and h2d.index(S(4)) < h2d.index(P(3))
    assert h2d.index(P(1)) < h2d.index(S(4))


def test_retained_gradients_stay_on_the_gpu_and_cut_the_copies():
    spec = DEBUG.with_layers(6)
    knobs = ScheduleKnobs(buffers=3, optimizer="overlap-split", gpu_optimizer_fraction=0.5, retain_grads=2)
    assert resolve(spec, 2, 8, knobs).kept_grad_layers == [0, 2]
    s = build_schedule(spec, 2, 8, knobs)
    n = spec.unit_params(0)
    assert s.attrs(O(0))["fills"] == "g0" and s.attrs(O(0))["bytes"] == 0
    assert s.attrs(S(0))["bytes"] == 12 * n and s.attrs(S(4))["bytes"] == 16 * n  # layer 4 streams its gradients
    assert s.attrs(O(4))["bytes"] == 4 * n and "fills" not in s.attrs(O(4))
    with pytest.raises(ScheduleError, match="only 3 layer"):
        build_schedule(spec, 2, 8, ScheduleKnobs(optimizer="overlap-split", gpu_optimizer_fraction=0.5,
                                                 retain_grads=4))
    with pytest.raises(ScheduleError, match="retain_grads"):
        build_schedule(spec, 2, 8, ScheduleKnobs(optimizer="overlap", retain_grads=1))


def test_wire_dtypes_change_copy_bytes():
    n = DEBUG.with_layers(3).unit_params(0)
    bf16 = small(ScheduleKnobs(weight_wire="bf16", grad_wire="fp32"))
    fp32 = small(ScheduleKnobs(weight_wire="fp32", grad_wire="bf16"))
    assert bf16.attrs(P(0))["bytes"] == 2 * n and fp32.attrs(P(0))["bytes"] == 4 * n
    assert bf16.attrs(O(0))["bytes"] == 4 * n and fp32.attrs(O(0))["bytes"] == 2 * n


def test_clip_none_removes_the_norm():
    assert NORM in small(ScheduleKnobs(clip=1.0)).graph
    assert NORM not in small(ScheduleKnobs(clip=0)).graph


def test_tied_embeddings_route_head_gradients_to_the_embedding_update():
    from dataclasses import replace
    tied = replace(DEBUG.with_layers(2), tie_word_embeddings=True)
    s = build_schedule(tied, 2, 8, ScheduleKnobs(optimizer="after"))
    assert s.graph.has_edge(O(HEAD), U(EMBED)) and s.graph.has_edge(U(EMBED), U(HEAD))


@pytest.mark.parametrize("name", sorted(NAMED_SCHEDULES))
def test_every_named_schedule_is_valid_on_every_preset_shape(name):
    for model in ("debug", "bench-3b"):
        build_schedule(PRESETS[model], 8, 64, knobs_for(name, micro_batches=2))


def test_bad_knobs_are_refused_with_the_knob_named():
    with pytest.raises(ScheduleError, match="buffers"):
        ScheduleKnobs(buffers=0)
    with pytest.raises(ScheduleError, match="optimizer"):
        ScheduleKnobs(optimizer="sometimes")
    with pytest.raises(ScheduleError, match="micro_batches=3"):
        build_schedule(DEBUG, 4, 8, ScheduleKnobs(micro_batches=3))


# ---- the validator catches broken DAGs ------------------------------------------------------------------------------
def broken(knobs=ScheduleKnobs(buffers=2, optimizer="after")):
    return small(knobs)


def test_validator_catches_a_slot_refilled_under_its_reader():
    s = broken()
    s.graph.remove_edge(F(0, 0), P(2))  # P2 refills w0, which F0.0 reads
    with pytest.raises(ScheduleError, match="refilled by P2 while F0.0") as e:
        s.validate()
    assert ">> F0.0" in str(e.value) and ">> P2" in str(e.value)  # the offending region, marked


def test_validator_catches_compute_before_its_prefetch():
    s = broken()
    s.graph.remove_edge(P(1), F(1, 0))
    with pytest.raises(ScheduleError, match="F1.0 may start before P1"):
        s.validate()


def test_validator_catches_update_before_offload():
    s = broken()
    s.graph.remove_edge(O(1), U(1))
    s.graph.remove_edge(NORM, U(1))
    with pytest.raises(ScheduleError, match="U1 may run before O1"):
        s.validate()


def test_validator_catches_update_before_the_norm():
    s = broken()
    s.graph.remove_edge(NORM, U(1))
    with pytest.raises(ScheduleError, match="global gradient norm"):
        s.validate()


def test_validator_catches_overlapped_update_after_the_new_gradients():
    s = broken(ScheduleKnobs(buffers=2, optimizer="overlap"))
    s.graph.remove_edge(U(1), O(1))
    s.graph.remove_edge(U(1), P(1))
    s.graph.add_edge(O(1), U(1))
    with pytest.raises(ScheduleError, match="previous step's gradients"):
        s.validate()


def test_validator_catches_cycles():
    s = broken()
    s.graph.add_edge(B(0, 0), F(0, 0))
    with pytest.raises(ScheduleError, match="cycle"):
        s.validate()


def test_validator_catches_offload_racing_the_refill():
    s = broken(ScheduleKnobs(buffers=1, optimizer="after"))
    s.graph.remove_edge(O(2), P(1, back=True))
    with pytest.raises(ScheduleError, match="O2"):
        s.validate()


def test_validator_catches_a_forward_before_the_gpu_update_that_fills_its_slot():
    s = broken(ScheduleKnobs(buffers=2, optimizer="overlap-split", gpu_optimizer_fraction=0.67))
    s.graph.remove_edge(U(1), F(1, 0))
    with pytest.raises(ScheduleError, match="F1.0 may start before U1"):
        s.validate()


def test_validator_catches_a_gpu_update_refilling_a_slot_under_its_reader():
    s = broken(ScheduleKnobs(buffers=1, optimizer="overlap-split", gpu_optimizer_fraction=0.67))
    s.graph.remove_edge(F(0, 0), U(1))  # U1 writes layer 1's weights into w0, which F0.0 reads
    with pytest.raises(ScheduleError, match="refilled by U1 while F0.0"):
        s.validate()


def test_validator_catches_a_refetch_before_the_updated_weights_are_back():
    s = broken(ScheduleKnobs(buffers=2, optimizer="overlap-split", gpu_optimizer_fraction=0.67))
    s.graph.remove_edge(W(0), P(0, back=True))
    with pytest.raises(ScheduleError, match="P0b streams layer 0 from the host after its GPU update U0"):
        s.validate()


def test_validator_catches_a_state_slot_refilled_before_its_write_back():
    s = broken(ScheduleKnobs(buffers=3, optimizer="overlap-split", gpu_optimizer_fraction=1.0, state_buffers=1))
    s.graph.remove_edge(W(0), S(1))
    with pytest.raises(ScheduleError, match="slot s0 may be refilled by S1 while U0"):
        s.validate()
