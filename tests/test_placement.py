"""The resolver: one place for the rules between knobs, no knob silently without effect, placements as data."""
import dataclasses
import json
import random
from pathlib import Path

import pytest

from megatrain.compile.builders import build_schedule
from megatrain.ir.dag import ScheduleError
from megatrain.compile.knobs import NAMED_SCHEDULES, ScheduleKnobs, knobs_for
from megatrain.ir.placement import BufferKind, GradLanding, Timing, UpdateSite
from megatrain.compile.lower import lower
from megatrain.compile.resolve import DEFAULT_GPU_FRACTION, OPTIMIZER_PRESETS, resolve
from megatrain.ir.tasks import Task
from megatrain.model.presets import PRESETS

DEBUG = PRESETS["debug"]  # 4 layers
GOLDEN = Path(__file__).parent / "golden"

# Values each knob takes in the walk (the first is the base's unless the base sets another).
KNOB_VALUES = {
    "buffers": [1, 2, 3],
    "recompute_block": [1, 2],
    "micro_batches": [1, 2],
    "optimizer": list(OPTIMIZER_PRESETS),
    "gpu_optimizer_fraction": [None, 0.25, 0.5, 1.0],
    "weight_wire": ["bf16", "fp32"],
    "grad_wire": ["fp32", "bf16"],
    "clip": [1.0, 0.0, 0.5],
    "offload_checkpoints": [False, True],
    "gpu_checkpoints": [0, 1],
    "compute_dtype": ["bf16", "fp32"],
    "loss_chunk_tokens": [2048, 64],
    "mlp_tile_tokens": [None, 0, 64, 4096],
    "state_buffers": [None, 1, 2],
    "state_lookahead": [None, 0, 2],
    "retain_grads": [0, 1],
    "compile_layers": [False, True],
    "resident_embeddings": [False, True],
    "resident_layers": [0, 1],
    "keep_activations": [0, 1],
    "grad_ring": [0, 1, 2],
    "state_dtype": ["fp32", "bf16"],
    "state_tier": ["host", "nvme-moments", "nvme-all"],
    "clip_redo": [None, "next-step", "step-end"],
}


def same_setting(knobs: ScheduleKnobs, name: str, value) -> bool:
    """Unset (None) and the value the resolver takes for it are one setting, not a change."""
    here = getattr(knobs, name)
    if (here is None) == (value is None):
        return here == value
    explicit = here if value is None else value
    p = resolve(DEBUG, 4, 64, dataclasses.replace(knobs, **{name: None}))
    default = {"gpu_optimizer_fraction": DEFAULT_GPU_FRACTION, "state_buffers": p.state_buffers,
               "state_lookahead": p.state_lookahead, "mlp_tile_tokens": p.mlp_tile_tokens,
               "clip_redo": "next-step"}[name]
    return explicit == default


def fingerprint(knobs: ScheduleKnobs) -> tuple[str, tuple[str, ...]] | None:
    """What a schedule does (its Program without the knobs that named it, and the resolver's notes), or None when
    the resolver refuses the knobs."""
    try:
        program = lower(build_schedule(DEBUG, 4, 64, knobs))
    except ScheduleError:
        return None
    d = program.to_dict()
    placement = d.pop("placement")
    # What the interpreters read from the placement; the rest of it (ring size, recompute block, micro-batches,
    # state buffers and lookahead) only shapes the tasks and queues, which are compared whole.
    runs = {k: placement[k] for k in ("units", "buffers", "checkpoint_layers", "offloaded_checkpoints", "weight_wire",
                                      "grad_wire", "compute_dtype", "layer_kernel", "clip_max_norm",
                                      "mlp_tile_tokens", "ring_tiles", "state_dtype", "state_tier")}
    runs["loss_chunk"] = min(placement["loss_chunk_tokens"], program.placement.tokens_per_micro)
    fields = {k: d[k] for k in ("tasks", "streams", "memory")}
    return json.dumps([fields, runs], sort_keys=True), program.placement.notes


def test_every_knob_has_an_effect_or_is_refused_or_reported():
    """Over a random walk of the knob space: changing any one knob of a valid combination changes the Program, or
    the resolver refuses the new combination, or it reports the setting as clamped (its notes change)."""
    fields = [f.name for f in dataclasses.fields(ScheduleKnobs)]
    assert set(KNOB_VALUES) == set(fields), "a knob was added: give it values to walk"
    rng = random.Random(0)
    checked, inert = 0, []
    bases = 0
    while bases < 120:
        knobs = ScheduleKnobs(**{k: rng.choice(v) for k, v in KNOB_VALUES.items()})
        base = fingerprint(knobs)
        if base is None:
            continue
        bases += 1
        for name, values in KNOB_VALUES.items():
            for value in values:
                if same_setting(knobs, name, value):
                    continue
                other = fingerprint(dataclasses.replace(knobs, **{name: value}))
                checked += 1
                if other is not None and other == base:
                    inert.append(f"{name}={value!r} in {knobs}")
    assert checked > 500
    assert not inert, "knobs without effect:\n" + "\n".join(inert[:5])


def test_invalid_combinations_are_refused_in_the_resolver_naming_the_knobs():
    cases = [
        (dict(optimizer="arrival-split", clip=1.0, gpu_optimizer_fraction=0.5, retain_grads=1),
         "retain_grads=1 keeps them on the GPU"),
        (dict(optimizer="overlap", gpu_optimizer_fraction=0.5), "gpu_optimizer_fraction=0.5 has no effect"),
        (dict(optimizer="gpu", gpu_optimizer_fraction=0.5), "updates every layer on the GPU"),
        (dict(optimizer="after", state_buffers=2), "state_buffers=2 sizes the GPU buffers"),
        (dict(optimizer="split", gpu_optimizer_fraction=0.5, state_buffers=3), "only 2 layer"),
        (dict(optimizer="split", state_lookahead=1), "state_lookahead=1 has no effect"),
        (dict(optimizer="arrival-split", clip=0, state_lookahead=1), "retain_grads >= 1"),
        (dict(optimizer="overlap", retain_grads=1), "updates every layer on the host"),
        (dict(optimizer="overlap", resident_layers=1), "needs an arrival placement"),
        (dict(optimizer="arrival", clip=0, resident_layers=5), "the model has 4 layers"),
        (dict(gpu_checkpoints=1), "offload_checkpoints is false"),
        (dict(offload_checkpoints=True, gpu_checkpoints=4), "keeps every one of the 4"),
        (dict(buffers=1, recompute_block=2), "cannot hold the 2 layers"),
        (dict(micro_batches=3), "does not split into micro_batches=3"),
        (dict(optimizer="arrival-split", clip=0, gpu_optimizer_fraction=0.5, resident_layers=4), "both resident"),
    ]
    for overrides, message in cases:
        with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
            resolve(DEBUG, 4, 64, dataclasses.replace(ScheduleKnobs(), **overrides))


def test_shape_dependent_clamps_are_reported_not_ignored():
    p = resolve(DEBUG.with_layers(2), 4, 64, knobs_for("overlap"))  # buffers=3 on a 2-layer cut
    assert p.ring_buffers == 2 and any("buffers=3" in n for n in p.notes)
    p = resolve(DEBUG, 1, 16, ScheduleKnobs(loss_chunk_tokens=2048))
    assert any("loss_chunk_tokens" in n for n in p.notes)


def test_optimizer_placements_are_presets_of_a_timing_and_gpu_layers():
    """"after" is "split" at fraction 0, "gpu" is "split" at fraction 1, "overlap" is "overlap-split" at 0 and
    "arrival" is "arrival-split" at 0: the same Programs."""
    def same(a: ScheduleKnobs, b: ScheduleKnobs):
        pa, pb = lower(build_schedule(DEBUG, 4, 64, a)), lower(build_schedule(DEBUG, 4, 64, b))
        return (pa.streams, pa.tasks, pa.placement.units) == (pb.streams, pb.tasks, pb.placement.units)

    assert same(ScheduleKnobs(optimizer="after"), ScheduleKnobs(optimizer="split", gpu_optimizer_fraction=0.0))
    assert same(ScheduleKnobs(optimizer="gpu"), ScheduleKnobs(optimizer="split", gpu_optimizer_fraction=1.0))
    assert same(ScheduleKnobs(optimizer="overlap"), ScheduleKnobs(optimizer="overlap-split",
                                                                  gpu_optimizer_fraction=0.0))
    assert same(ScheduleKnobs(optimizer="arrival", clip=0), ScheduleKnobs(optimizer="arrival-split", clip=0,
                                                                         gpu_optimizer_fraction=0.0))


def test_placement_describes_every_unit_and_buffer():
    knobs = knobs_for("arrival-split", gpu_optimizer_fraction=0.5, retain_grads=1, weight_wire="bf16",
                      resident_embeddings=True, resident_layers=1)
    p = resolve(DEBUG, 4, 64, knobs)
    assert p.timing is Timing.ARRIVAL and p.clip_max_norm is None and p.layer_kernel == "eager"
    assert p.resident_units == [-1, 0, -2] and p.gpu_streamed_layers == [1, 3]  # from the top, spread
    assert p.unit(1).grads is GradLanding.GPU_KEPT and p.unit(3).grads is GradLanding.HOST
    assert p.unit(2).update is UpdateSite.HOST and p.state_order == (3, 1)
    kinds = {b.name: b.kind for b in p.buffers}
    assert kinds == {"w0": BufferKind.WEIGHTS, "w1": BufferKind.WEIGHTS, "w2": BufferKind.WEIGHTS,
                     "embed": BufferKind.RESIDENT, "head": BufferKind.RESIDENT, "s0": BufferKind.STATE,
                     "s1": BufferKind.STATE, "g1": BufferKind.KEPT_GRADS, "r0": BufferKind.RESIDENT}
    program = lower(build_schedule(DEBUG, 4, 64, knobs))
    used = {n for t in program.tasks.values() for n in (t.slot, t.fills) if n}
    assert used == set(kinds)  # every buffer in the table is used, and every used buffer is in the table
    assert program.memory.buffers_bytes == sum(b.nbytes for b in p.buffers)


def test_programs_of_named_schedules_are_unchanged_on_three_model_shapes():
    """Hashes of the Programs (queues, tasks, waits, GPU memory) of every named schedule on three presets, as the
    code made them when tests/golden/program_hashes.json was last written (its "_about" says when and what changed
    them since): a pin against unintended change, not a proof of correctness. MEGATRAIN_REGOLD=1 rewrites them; a
    deliberate change says in its commit which Programs changed and why."""
    import os

    path = GOLDEN / "program_hashes.json"
    have = {}
    for model in ("debug", "bench-3b", "llama3-8b"):
        for name, knobs in NAMED_SCHEDULES.items():
            for micro in (1, 2):
                p = lower(build_schedule(PRESETS[model], 4, 256, dataclasses.replace(knobs, micro_batches=micro)))
                have[f"{model}/{name}/m{micro}"] = p.fingerprint()  # tasks, streams, memory (ir/program.py)
    golden = json.loads(path.read_text())
    about = golden.pop("_about")  # what the hashes pin, and since when
    if os.environ.get("MEGATRAIN_REGOLD"):
        path.write_text(json.dumps({"_about": about, **have}, indent=1, sort_keys=True) + "\n")
        golden = have
    assert have == golden


PROGRAM_GOLDEN_CASES = {
    # layers 3 and 1 updated on the GPU as their gradients land (S/U/W among the backward); layer 1 keeps its
    # gradients on the GPU
    "arrival_split": knobs_for("arrival-split", gpu_optimizer_fraction=0.5, retain_grads=1, state_lookahead=0),
    # embedding, head and layers 0-1 live on the GPU: no copies for them, their updates on the compute stream
    "resident": knobs_for("arrival", resident_embeddings=True, resident_layers=2),
    # checkpoints offloaded except the top block's, which stays on the GPU
    "gpu_checkpoints": knobs_for("long-context", recompute_block=2, gpu_checkpoints=1),
    # the same queues as "overlap", with the compiled layer kernel in the placement
    "compile_layers": knobs_for("overlap", compile_layers=True),
}


@pytest.mark.parametrize("case", sorted(PROGRAM_GOLDEN_CASES))
def test_golden_program_listing(case):
    """Program listings (placement + stream queues + waits) of the debug model; MEGATRAIN_REGOLD=1 rewrites."""
    import os

    listing = lower(build_schedule(DEBUG, 4, 64, PROGRAM_GOLDEN_CASES[case])).listing() + "\n"
    path = GOLDEN / f"program_{case}.txt"
    if os.environ.get("MEGATRAIN_REGOLD"):
        path.write_text(listing)
    assert listing == path.read_text()


def test_interpreters_read_only_the_program():
    """exec/ and sim/ import neither the knobs, nor the builders, nor the memory planner: what they need is in the
    Program (walks every import statement of their modules)."""
    import ast

    root = Path(__file__).parent.parent / "megatrain"
    forbidden = {"knobs", "builders", "memory", "tune", "training", "cli", "profiling"}
    offending = []
    for package in ("exec", "sim"):
        for path in sorted((root / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                hits = {part for name in names for part in name.split(".")} & forbidden
                if hits:
                    offending.append(f"{path.relative_to(root)}:{node.lineno} imports {sorted(hits)}")
    assert not offending, "\n".join(offending)


# ---- a DAG you can edit ---------------------------------------------------------------------------------------------
def test_an_edited_schedule_lowers_simulates_runs_and_round_trips(tmp_path):
    import torch

    from megatrain.exec.optim import AdamWConfig
    from megatrain.compile.edit import (
        add_dependency,
        load_schedule,
        move_to_stream,
        save_schedule,
        with_ring_buffers,
    )
    from megatrain.sim import simulate
    from megatrain.engine.trainer import StreamedTrainer

    knobs = knobs_for("long-context", compute_dtype="fp32", weight_wire="fp32")
    sched = build_schedule(DEBUG, 4, 32, knobs)
    base = simulate(lower(sched), "h200").step_s
    # The host update of layer 3 may start only once layer 2's forward is done: the forward waits for it.
    add_dependency(sched, "F2.0", "U3")
    move_to_stream(sched, "X1.0", "h2d")  # an activation offload queued on the other copy stream
    sched.validate()
    program = lower(sched)
    assert "F2.0" in program.tasks["U3"].waits and "X1.0" in program.streams["h2d"]
    assert simulate(program, "h200").step_s > base  # the edit shows in the prediction
    with pytest.raises(ScheduleError, match="close a cycle"):
        add_dependency(sched, "U3", "F2.0")
    with pytest.raises(ScheduleError, match="only copies move"):
        move_to_stream(sched, "F1.0", "h2d")
        lower(sched)
    sched.graph.nodes[Task.parse("F1.0")].pop("stream")
    # Saved and loaded: the same Program.
    again = load_schedule(save_schedule(sched, tmp_path / "edited.json"))
    assert lower(again).to_dict() == program.to_dict()
    # And it runs: the same numbers as the schedule before the edit (edits change speed, not results).
    ids = torch.randint(0, DEBUG.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    plain = StreamedTrainer(DEBUG, knobs, optim=AdamWConfig(lr=1e-2), backend="cpu")
    edited = StreamedTrainer(DEBUG, knobs, optim=AdamWConfig(lr=1e-2), backend="cpu")
    edited.use_program(lower(again))
    for _ in range(2):
        a, b = plain.step(ids[:, :-1], ids[:, 1:]), edited.step(ids[:, :-1], ids[:, 1:])
        assert a.loss == b.loss
    # A deeper ring is a placement change: rebuilt, one more weight slot.
    deeper = with_ring_buffers(sched, 4)
    assert deeper.placement.ring_buffers == 4 and "w3" in {b.name for b in deeper.placement.buffers}
    assert lower(deeper).memory.buffers_bytes > program.memory.buffers_bytes
