"""One vocabulary: every task kind, stream, collective operation and host-store component is defined once (ir/), and
what the interpreters and the reports need of each is registered or derived, never retyped."""
import ast
from pathlib import Path

import pytest

import megatrain.parallel  # noqa: F401  (registers the data-parallel strategy's bodies)
from megatrain.analysis.summary import CAUSE_OF_KIND
from megatrain.analysis.viz import KIND_COLORS, KIND_NAMES
from megatrain.compile.builders import build_schedule
from megatrain.compile.lower import lower
from megatrain.exec.strategies import PARALLEL_KINDS
from megatrain.exec.work import BODIES
from megatrain.ir.hostlayout import HOST_COMPONENTS
from megatrain.ir.streams import STREAMS
from megatrain.ir.tasks import BY_DEVICE, WAIT_CAUSES, Collective, TaskKind
from megatrain.model.presets import PRESETS
from megatrain.sim import load_profile, simulate
from megatrain.sim.collectives import DEFAULTS
from megatrain.sim.costs import COSTS
from megatrain.sim.profile import HardwareProfile

ROOT = Path(__file__).parent.parent


def test_every_task_kind_has_a_body_a_cost_a_stream_a_wait_cause_a_label_and_a_colour():
    parallel = {TaskKind(k) for kinds in PARALLEL_KINDS.values() for k in kinds}
    assert set(BODIES) | parallel == set(TaskKind), "task kinds without an exec body"
    assert set(COSTS) == set(TaskKind), "task kinds without a sim cost"
    for k in TaskKind:
        assert k.stream in STREAMS or k.stream == BY_DEVICE, k
        assert k.cause in WAIT_CAUSES and k.label and k.colour.startswith("#"), k
        assert k.copy is None or k.stream == k.copy, k  # a copy's home queue is its direction's
        assert (k.collective is not None) == (k.stream == "comm"), k
    # the derived tables cover every kind
    assert set(CAUSE_OF_KIND) == set(KIND_COLORS) == set(KIND_NAMES) == {k.value for k in TaskKind}
    assert len(set(KIND_COLORS.values())) == len(TaskKind)  # every kind can be told apart in a chart


def test_one_gpu_bodies_cover_every_kind_off_the_comm_stream():
    assert set(BODIES) == {k for k in TaskKind if k.stream != "comm"}


def test_every_collective_operation_has_a_default_table_and_every_collective_kind_names_one():
    assert set(DEFAULTS) == {c.value for c in Collective}
    assert {k.collective for k in TaskKind if k.collective} <= set(Collective)


def test_a_bad_word_in_the_kind_table_is_refused(monkeypatch):
    """The import-time check of ir/tasks.py fails on a stream, copy direction or wait cause that is not a word of
    its vocabulary (breaking one kind's stream on purpose)."""
    from megatrain.ir import tasks

    monkeypatch.setattr(TaskKind.FORWARD, "stream", "gpu", raising=False)
    with pytest.raises(ValueError, match="FORWARD: stream 'gpu'"):
        tasks._check_kinds()
    monkeypatch.setattr(TaskKind.FORWARD, "stream", "compute", raising=False)
    monkeypatch.setattr(TaskKind.FORWARD, "cause", "waiting", raising=False)
    with pytest.raises(ValueError, match="FORWARD: wait cause 'waiting'"):
        tasks._check_kinds()


def _string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def test_no_module_outside_ir_retypes_the_stream_list():
    """A tuple or list of stream names written out (a copy of ir/streams.py) anywhere in megatrain/ fails here."""
    names = set(STREAMS)
    bad = []
    for path in (ROOT / "megatrain").rglob("*.py"):
        if path.name == "streams.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 3:
                words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(words) == len(node.elts) and set(words) <= names:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"stream lists retyped (derive them from megatrain.ir.streams): {bad}"


def test_every_stream_a_program_or_a_timeline_names_is_a_defined_stream():
    prog = lower(build_schedule(PRESETS["debug"], 4, 64, "arrival", world=2))
    tl = simulate(prog, load_profile("cpu")).timeline
    assert set(prog.streams) <= set(STREAMS) and set(tl["stream"]) <= set(STREAMS)
    assert {t.stream for t in prog.tasks.values()} <= set(STREAMS)


def test_a_profile_accepts_an_overhead_for_every_stream_and_kind():
    """B2's cause: the profile's validator kept its own stale list of streams (no comm) and kinds (no G, Z)."""
    p = load_profile("cpu")
    keys = {**{s: 1e-5 for s in STREAMS}, **{k.value: 1e-5 for k in TaskKind}}
    assert HardwareProfile.from_dict({**p.to_dict(), "task_overhead_s": keys}).task_overhead_s == keys


def test_live_calibration_of_a_data_parallel_program():
    """B2, small form (review section 10): calibrating a two-rank Program's Timelines, whose gaps include the comm
    stream's, gives a usable profile (it raised ProfileError: unknown keys ['comm'])."""
    from megatrain.profiling.live import calibrate_run

    prog = lower(build_schedule(PRESETS["debug"], 4, 64, "arrival", world=2))
    prof = load_profile("cpu")
    tl = simulate(prog, prof).timeline
    cal = calibrate_run(prog, prof, [tl, tl], warmup=1)
    assert "comm" in cal.profile.task_overhead_s
    simulate(prog, cal.profile)


def test_collective_waits_are_charged_to_collectives():
    from megatrain.analysis.summary import summarize

    prog = lower(build_schedule(PRESETS["debug"], 4, 64, "arrival", world=2))
    s = summarize(simulate(prog, load_profile("h200")).timeline, prog)
    assert set(s.wait_s) == set(WAIT_CAUSES)


def test_host_components_are_defined_once_with_their_slicing():
    keys = [c.key for c in HOST_COMPONENTS]
    assert len(keys) == len(set(keys))
    assert {c.key for c in HOST_COMPONENTS if c.sliced} == {"master", "m", "v", "stream", "grads"}
    collectives = (ROOT / "megatrain" / "compile" / "collectives.py").read_text()
    assert "adam m (" not in collectives and "fp32 master" not in collectives  # no names retyped
