"""Issue 22, "data destroyed": an export never deletes what a user owns. An export target may not equal, contain or
sit above a run or checkpoint directory (any run, not only the one exported), may not sit inside a checkpoint, and
`--overwrite` replaces only an earlier Hugging Face export (recognised by its megatrain_export.json); every refusal
is one line and leaves every file as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.cli import main
from megatrain.io.checkpoint_format import STATE_FILE
from megatrain.io.errors import CheckpointError
from megatrain.io.hf_checkpoint import PROVENANCE_FILE, export_hf
from megatrain.model.init import init_tiles
from megatrain.model.presets import PRESETS

DEBUG = PRESETS["debug"]


def _toml(tmp_path: Path, name: str, **run) -> Path:
    keys = {"name": name, "out_dir": str(tmp_path / "runs"), "steps": 2, "checkpoint_every": 2, "eval_every": 0,
            "simulate": False, "progress": False, **run}
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
    path = tmp_path / f"{name}.toml"
    path.write_text("[data]\nbatch_size = 2\nseq_len = 32\n[schedule]\ncompute_dtype = \"fp32\"\n"
                    f"[optimizer]\nwarmup_steps = 1\n[run]\n{body}\n")
    return path


def _snapshot(root: Path) -> dict[str, int]:
    """Every file under `root` with its size: what must survive a refused export."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """runs/a and runs/b, each trained 2 steps with a checkpoint (module-scoped: the CLI cases only read them)."""
    tmp = tmp_path_factory.mktemp("export")
    for name in ("a", "b"):
        assert main(["train", "--config", str(_toml(tmp, name))]) == 0
    return tmp


@pytest.mark.parametrize("target", [
    "runs/a",                       # the run itself
    "runs",                         # above it: its sibling runs too
    ".",                            # further above
    "runs/b",                       # another run
    "runs/a/checkpoints",           # the run's checkpoints
    "runs/a/checkpoints/step_00000002",  # the checkpoint exported
    "runs/b/checkpoints/step_00000002",  # another run's checkpoint
])
@pytest.mark.parametrize("overwrite", [True, False])
def test_an_export_onto_or_above_a_run_is_refused_and_deletes_nothing(two_runs, capsys, monkeypatch, target,
                                                                      overwrite):
    monkeypatch.chdir(two_runs)
    before = _snapshot(two_runs / "runs")
    rc = main(["export", "runs/a", target] + (["--overwrite"] if overwrite else []))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert _snapshot(two_runs / "runs") == before  # not one file lost or changed
    if overwrite:
        assert "not a megatrain export" in err or "holds a megatrain run or checkpoint" in err, err


def test_an_export_inside_a_checkpoint_is_refused(two_runs, capsys, monkeypatch):
    """A new directory inside a checkpoint would be deleted with it when the checkpoint is pruned."""
    monkeypatch.chdir(two_runs)
    assert main(["export", "runs/a", "runs/a/checkpoints/step_00000002/hf"]) == 2
    assert "inside checkpoint" in capsys.readouterr().err
    assert not (two_runs / "runs/a/checkpoints/step_00000002/hf").exists()


def test_overwrite_replaces_an_earlier_export_and_nothing_else(two_runs, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(two_runs)
    out = tmp_path / "hf"
    assert main(["export", "runs/a", str(out)]) == 0
    assert main(["export", "runs/b", str(out), "--overwrite"]) == 0  # an earlier export: replaced
    assert json.loads((out / PROVENANCE_FILE).read_text())["run_dir"].endswith("b")
    capsys.readouterr()
    mine = tmp_path / "mine"  # a user's directory, no provenance file: never replaced
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["export", "runs/a", str(mine), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "not a megatrain export" in err and err.count("\n") == 1
    assert (mine / "notes.txt").read_text() == "keep me"
    file = tmp_path / "file.bin"  # a file is not an export either
    file.write_bytes(b"x")
    assert main(["export", "runs/a", str(file), "--overwrite"]) == 2
    assert file.read_bytes() == b"x"
    capsys.readouterr()


def test_an_export_that_holds_a_run_is_not_replaced(two_runs, tmp_path):
    """A provenance file is not enough: an earlier export a run was later written into is not replaced (Python API
    too, not only the CLI)."""
    out = tmp_path / "hf"
    export_hf(out, DEBUG, init_tiles(DEBUG), provenance={"run_dir": "x", "checkpoint": "x", "step": 1})
    (out / "run" / "checkpoints" / "step_00000001").mkdir(parents=True)
    (out / "run" / "checkpoints" / "step_00000001" / STATE_FILE).write_text("{}")
    with pytest.raises(CheckpointError, match="holds a megatrain run or checkpoint"):
        export_hf(out, DEBUG, init_tiles(DEBUG), overwrite=True)
    assert (out / "run" / "checkpoints" / "step_00000001" / STATE_FILE).is_file()


def test_the_end_of_run_export_may_not_be_the_run_directory_or_above(tmp_path, capsys):
    """run.export_hf onto the run's own directory or its parent is refused before the run starts."""
    for target in (tmp_path / "runs" / "c", tmp_path / "runs"):
        assert main(["train", "--config", str(_toml(tmp_path, "c", export_hf=str(target)))]) == 2
        err = capsys.readouterr().err
        assert "run.export_hf" in err and err.count("\n") == 1, err
        assert not any((tmp_path / "runs").glob("c*/checkpoints/step_*"))
