"""profiling/rounds.py: many schedules measured in one process on shared host stores (issue 24 item 1), on the CPU
backend with the debug model. What the timings are is the machine's business; what is tested is the bookkeeping:
which schedules share a store, the order of the rows, the clipping share, and that a switch frees the old Program."""
import weakref

import pytest

from megatrain.compile.knobs import knobs_for
from megatrain.data.batches import synthetic_batches
from megatrain.engine.trainer import StreamedTrainer
from megatrain.model.presets import PRESETS
from megatrain.profiling.rounds import layout_groups, measure_rounds, median_table

DEBUG = PRESETS["debug"]
EVERY_STEP_CLIPS = 1e-6  # a max norm below any gradient's norm


def test_layout_groups_share_a_store_only_where_the_host_layout_is_the_same():
    # overlap and arrival stream bf16 weights from one fp32 store; lean streams fp32 weights through a gradient
    # ring (compile.resolve.resolve_host_layout), so it needs a store of its own
    names = ["overlap", "lean", "arrival"]
    groups = layout_groups(DEBUG, {n: knobs_for(n) for n in names})
    assert [list(g) for g in groups] == [["overlap", "arrival"], ["lean"]]


def test_switching_back_and_forth_frees_the_old_program_at_once():
    """The old StepWork (the Program's GPU buffers) and Runtime are gone right after switch_schedule, without a
    gc.collect here: StreamedTrainer.use_program collects (a StepWork holds reference cycles), else two Programs'
    buffers would live at once on a GPU the first fills."""
    trainer = StreamedTrainer(DEBUG, knobs_for("overlap", compute_dtype="fp32"), backend="cpu")
    batches = synthetic_batches(DEBUG, 2, 16, 0)
    trainer.step(*next(batches))
    for name in ("arrival", "overlap", "arrival"):
        work, runtime = weakref.ref(trainer._work), weakref.ref(trainer._runtime)
        trainer.switch_schedule(knobs_for(name, compute_dtype="fp32"), 2, 16, name)
        assert work() is None and runtime() is None, name
        assert trainer.program(2, 16).name == name
        trainer.step(*next(batches))


def test_rows_interleave_rounds_and_measure_the_clipping_share():
    schedules = {
        "overlap, every step clips": knobs_for("overlap", compute_dtype="fp32", clip=EVERY_STEP_CLIPS),
        "overlap, no clipping": knobs_for("overlap", compute_dtype="fp32", clip=0.0),
        "arrival, every step clips": knobs_for("arrival", compute_dtype="fp32", clip=EVERY_STEP_CLIPS),
        "lean": knobs_for("lean", compute_dtype="fp32"),
    }
    seen = []
    rows = measure_rounds(DEBUG, schedules, 2, 16, rounds=2, warmup=1, steps=2, device="cpu",
                          predict={"cpu": "cpu"}, on_row=lambda r: seen.append((r.config, r.round)))
    names = list(schedules)
    # every schedule is measured once per round, in order, whatever its host layout (lean's store is taken over
    # in place: HostStore.relayout); each row says its layout
    assert seen == [(n, r) for r in (0, 1) for n in names]
    assert [r.layout_group for r in rows] == [0, 0, 0, 1] * 2
    share = {(r.config, r.round): r.clip_share for r in rows}
    for r in (0, 1):
        assert share["overlap, every step clips", r] == 1.0 and share["arrival, every step clips", r] == 1.0
        assert share["overlap, no clipping", r] == 0.0 and share["lean", r] == 0.0
    for row in rows:
        assert len(row.step_s) == len(row.timelines) == 2 and row.program.name == row.config
        assert row.predicted_step_s["cpu"] > 0 and row.to_dict()["program_hash"] == row.program.fingerprint()
    table = median_table(rows).set_index("config")
    assert list(table.index) == names and (table["rounds"] == 2).all()
    assert table.at["lean", "min_s"] <= table.at["lean", "step_s"] <= table.at["lean", "max_s"]


def test_bad_rounds_are_refused_in_one_line():
    with pytest.raises(ValueError, match="rounds=0"):
        measure_rounds(DEBUG, {"overlap": knobs_for("overlap")}, 2, 16, rounds=0, device="cpu")
