"""Knobs grouped by what they decide (placement, step shape, numerics): defined once on the ScheduleKnobs fields,
printed so by `plan`, listed so in docs/training.md, while `--set` keeps today's bare names."""
import re
from dataclasses import fields
from pathlib import Path

from megatrain.cli import main
from megatrain.compile.knobs import KNOB_GROUPS, NUMERICS_KNOBS, ScheduleKnobs, resolve_knobs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def test_every_knob_is_in_exactly_one_group():
    names = [f.name for f in fields(ScheduleKnobs)]
    grouped = [n for g in KNOB_GROUPS.values() for n in g]
    assert sorted(grouped) == sorted(names) and len(grouped) == len(set(grouped))
    assert set(KNOB_GROUPS) == {"placement", "step shape", "numerics"}
    assert {"optimizer", "retain_grads", "grad_ring", "state_tier"} <= set(KNOB_GROUPS["placement"])
    assert {"buffers", "recompute_block", "micro_batches"} <= set(KNOB_GROUPS["step shape"])
    assert {"weight_wire", "compute_dtype", "clip", "loss_chunk_tokens"} <= set(KNOB_GROUPS["numerics"])
    # `auto` keeps what changes the numbers computed: a different set from the numerics group (the weight wire
    # moves the same values in another dtype; micro-batches sum the gradients in another order)
    assert set(NUMERICS_KNOBS) == {"clip", "compute_dtype", "grad_wire", "compile_layers", "loss_chunk_tokens",
                                   "mlp_tile_tokens", "micro_batches", "state_dtype"}


def test_set_takes_the_bare_names_whatever_the_group():
    for group, names in KNOB_GROUPS.items():
        for name in names:
            value = getattr(ScheduleKnobs(), name)
            text = "none" if value is None else str(value).lower()
            assert getattr(resolve_knobs("overlap", [f"{name}={text}"])[1], name) == value, (group, name)


def test_plan_prints_the_knobs_by_group(capsys):
    assert main(["plan", "--model", "debug", "--batch", "2", "--seq", "16", "--schedule", "lean",
                 "--host-gib", "64"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("knobs:"):].splitlines()
    for group, names in KNOB_GROUPS.items():
        start = next(i for i, line in enumerate(lines) if line.startswith(f"  {group}:"))
        block = lines[start]
        for line in lines[start + 1:]:
            if not line.startswith("              "):
                break
            block += line
        assert all(f"{n}=" in block for n in names), (group, block)
    assert "grad_ring=2" in out


def test_the_config_docs_list_each_knob_under_its_group():
    text = DOCS.read_text()
    for group, names in KNOB_GROUPS.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {group} |"))
        assert set(re.findall(r"`(\w+)`", row)) == set(names), group
