"""A result's program record gives back the Program that ran (same fingerprint), for one rank and several; the
resolver decides what ranks and hosts support, in one place; the clip share is a typed fact of the run."""
from __future__ import annotations

import dataclasses
import json

import pytest

import megatrain.parallel  # noqa: F401  (registers the sharded strategy)
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.compile.lower import lower
from megatrain.compile.record import ProgramRecord, RecordError, program_of
from megatrain.compile.resolve import check_run_for_ranks, resolve
from megatrain.compile.strategies import register_strategy, strategy_of
from megatrain.ir.dag import ScheduleError
from megatrain.ir.facts import StepFacts
from megatrain.ir.placement import Parallelism
from megatrain.ir.program import Program
from megatrain.model.presets import PRESETS
from megatrain.sim import simulate

SPEC = PRESETS["debug"]


@pytest.mark.parametrize("parallel", [Parallelism(), Parallelism(2), Parallelism(4, hosts=2)],
                         ids=["one", "two", "two-hosts"])
def test_a_record_round_trips_to_the_same_program(parallel, tmp_path):
    program = lower(build_schedule(SPEC.with_layers(3), 2, 16, knobs_for("overlap", buffers=3), world=parallel))
    record = ProgramRecord.of(program)
    text = json.loads(json.dumps(record.to_dict()))  # as a results file holds it
    rebuilt = program_of(text)
    assert rebuilt.fingerprint() == program.fingerprint() == record.program_hash
    assert rebuilt.placement.parallelism == parallel
    saved = json.loads(record.save(tmp_path).read_text())
    assert ProgramRecord.from_dict(saved) == record


def test_a_record_of_other_knobs_than_its_hash_is_refused():
    program = lower(build_schedule(SPEC, 2, 16, "overlap"))
    d = ProgramRecord.of(program).to_dict()
    d["knobs"] = dict(d["knobs"], micro_batches=2)
    with pytest.raises(RecordError, match="rebuilds a Program of fingerprint"):
        program_of(d)


def test_the_fingerprint_is_the_golden_definition_and_ignores_the_json_round_trip():
    program = lower(build_schedule(SPEC, 2, 16, "arrival"))
    assert Program.from_json(program.to_json()).fingerprint() == program.fingerprint()
    assert lower(build_schedule(SPEC, 2, 16, "overlap")).fingerprint() != program.fingerprint()


def test_the_placement_carries_ranks_hosts_and_strategy_through_json():
    program = lower(build_schedule(SPEC, 2, 16, "overlap", world=Parallelism(4, hosts=2)))
    back = Program.from_json(program.to_json()).placement
    assert (back.world, back.hosts, back.strategy) == (4, 2, "sharded")
    assert "data parallel over 4 ranks on 2 hosts (2 each)" in program.listing()
    one = lower(build_schedule(SPEC, 2, 16, "overlap"))
    assert "world" not in one.to_dict()["placement"]  # one-GPU Programs keep their JSON


@pytest.mark.parametrize("parallel, knobs, match", [
    (Parallelism(0), knobs_for("overlap"), "there must be at least one rank"),
    (Parallelism(4, hosts=3), knobs_for("overlap"), "cannot be spread evenly over 3 host"),
    (Parallelism(2), knobs_for("gpu-adam"), "updates on the host only"),
    (Parallelism(2), knobs_for("arrival", clip=0.0, resident_layers=1), "updates on the host only"),
])
def test_the_resolver_refuses_what_ranks_do_not_support(parallel, knobs, match):
    with pytest.raises(ScheduleError, match=match):
        resolve(SPEC, 2, 16, knobs, parallel)


def test_tied_embeddings_and_run_choices_are_refused_by_the_resolver_module():
    tied = dataclasses.replace(SPEC, name="debug-tied", tie_word_embeddings=True)
    with pytest.raises(ScheduleError, match="ties its embeddings"):
        resolve(tied, 2, 16, knobs_for("overlap"), Parallelism(2))
    resolve(tied, 2, 16, knobs_for("overlap"))  # one GPU: fine
    with pytest.raises(ScheduleError, match="--schedule auto is not supported under torchrun"):
        check_run_for_ranks(2, auto=True)
    with pytest.raises(ScheduleError, match="run.export_hf with 2 ranks"):
        check_run_for_ranks(2, export_hf=True, checkpoint_at_end=False)
    check_run_for_ranks(1, auto=True, export_hf=True, checkpoint_at_end=False)


def test_an_unregistered_strategy_says_to_import_megatrain_parallel():
    p = resolve(SPEC, 2, 16, knobs_for("overlap"), Parallelism(2, strategy="replicated"))
    with pytest.raises(ScheduleError, match="import megatrain.parallel"):
        strategy_of(p)
    sharded = strategy_of(resolve(SPEC, 2, 16, knobs_for("overlap"), Parallelism(2)))
    register_strategy(sharded)  # registering again replaces, harmlessly


def test_the_clip_share_weighs_the_steps_that_clip():
    program = lower(build_schedule(SPEC, 2, 16, knobs_for("arrival", clip=1.0)))
    assert program.placement.speculative_clip
    never, always = simulate(program, "h200"), simulate(program, "h200", StepFacts(clip_share=1.0))
    assert always.step_s != never.step_s  # the redo tasks cost something in a step that clips
    mixed = simulate(program, "h200", StepFacts(clip_share=0.25))
    assert mixed.step_s == never.step_s  # the Timeline is of a step that does not clip
    assert mixed.mean_step_s == pytest.approx(0.75 * never.step_s + 0.25 * always.step_s)
    with pytest.raises(ValueError, match="between 0 and 1"):
        StepFacts(clip_share=1.5)
