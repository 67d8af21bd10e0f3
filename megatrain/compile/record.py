"""ProgramRecord: what a measured result ran, in machine-readable form, and the Program rebuilt from it.

Every measured result (scripts/bench.py rows, scripts/bench_megatrain.py, scripts/bench_multigpu.py,
`megatrain compare`, `megatrain train`'s run directory) writes one record: the model, the rank's batch and the
sequence length, the schedule knobs (every one, `ScheduleKnobs.to_dict()`), the ranks, hosts and collective
strategy, and the fingerprint of the Program that ran (`Program.fingerprint()`). Anything that rebuilds a Program
from a result calls `program_of(record)`, never parses a display label; it refuses a record whose rebuilt Program
has another fingerprint (other code, or knobs the record does not hold).

A record of several ranks rebuilds through the collective strategy's passes: import megatrain.parallel first.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.compile.lower import lower
from megatrain.compile.resolve import resolve
from megatrain.ir.dag import ScheduleError
from megatrain.ir.placement import DEFAULT_STRATEGY, Parallelism
from megatrain.ir.program import Program
from megatrain.model.spec import ModelSpec

FORMAT = "megatrain.program-record/1"
FILE = "program_record.json"  # the record's name in a run or result directory


class RecordError(ValueError):
    """A record that cannot give back its Program: malformed, or the rebuilt Program is another one."""


@dataclass(frozen=True)
class ProgramRecord:
    """The Program a result ran, as knobs and shape (module docstring)."""

    model: str  # the model's name (display only)
    batch: int  # one rank's sequences per step
    seq: int
    knobs: dict = field(default_factory=dict)  # ScheduleKnobs.to_dict(): every knob, defaults included
    model_spec: dict = field(default_factory=dict)  # ModelSpec.to_dict(): the shape the Program was built for
    world: int = 1
    hosts: int = 1
    strategy: str = DEFAULT_STRATEGY
    schedule: str = ""  # the schedule's display name (display only: never parsed)
    program_hash: str = ""  # Program.fingerprint() of the Program that ran

    @classmethod
    def of(cls, program: Program) -> ProgramRecord:
        """The record of `program` (one built by build_schedule, whose knobs it keeps)."""
        if program.knobs is None:
            raise RecordError(f"Program {program.name!r} was built from a hand-made placement and has no knobs to "
                              "record; record a Program built by build_schedule")
        p = program.placement
        return cls(model=p.model.name, batch=p.batch, seq=p.seq, knobs=dict(program.knobs),
                   model_spec=p.model.to_dict(), world=p.world, hosts=p.hosts, strategy=p.strategy,
                   schedule=program.name, program_hash=program.fingerprint())

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    def save(self, directory: str | Path) -> Path:
        """Write the record as `directory/program_record.json`; returns its path."""
        path = Path(directory) / FILE
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict) -> ProgramRecord:
        d = dict(d)
        if d.pop("format", FORMAT) != FORMAT:
            raise RecordError(f"not a {FORMAT} record: format {d.get('format')!r}")
        known = {f.name for f in fields(cls)}
        missing = {"model", "batch", "seq", "knobs", "model_spec"} - set(d)
        if missing or set(d) - known:
            raise RecordError(f"a program record needs {sorted(missing)} and knows only {sorted(known)}; got "
                              f"{sorted(d)}")
        return cls(**d)


def program_of(record: ProgramRecord | dict) -> Program:
    """The Program a record ran, rebuilt from its knobs and shape; RecordError when its fingerprint differs."""
    r = record if isinstance(record, ProgramRecord) else ProgramRecord.from_dict(record)
    spec = ModelSpec.from_dict(r.model_spec)
    parallel = Parallelism(r.world, r.hosts, r.strategy)
    knobs = ScheduleKnobs.from_dict(r.knobs)
    if "clip_redo" not in r.knobs and knobs.clip > 0:
        # recorded before the knob existed, when a host unit's redo ran at the end of its step: rebuild that
        # (where the placement has such redos; elsewhere the knob stays unset, as it must)
        legacy = replace(knobs, clip_redo="step-end")
        try:
            resolve(spec, r.batch, r.seq, legacy, parallel)
            knobs = legacy
        except ScheduleError:
            pass
    program = lower(build_schedule(spec, r.batch, r.seq, knobs, world=parallel))
    if r.schedule:
        program.name = r.schedule
    if r.program_hash and program.fingerprint() != r.program_hash:
        raise RecordError(f"the record of {r.schedule or 'a run'} ({r.model}, batch {r.batch} x seq {r.seq}, "
                          f"{r.world} rank(s)) rebuilds a Program of fingerprint {program.fingerprint()[:12]}, not "
                          f"the {r.program_hash[:12]} that ran: the code changed since (rerun the measurement)")
    return program
