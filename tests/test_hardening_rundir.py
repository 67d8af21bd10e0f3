"""Issue 22, "two runs in one directory" and "late or misleading refusals" (and issue 23's "a failed pre-run check
writes nothing and says so"): a run claims its directory atomically before any check, so two runs started together
with one name get two directories; a resume is refused before the store is allocated, naming the setting, and a
refused run leaves every file as it was (a fresh one leaves nothing at all)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatrain.train import loop
from megatrain.train.config import ConfigError, load_config
from megatrain.train.loop import run_training
from megatrain.train.rundir import RunLock, claim_run_dir
from runconfigs import small_run

REPO = Path(__file__).resolve().parents[1]


def tiny(tmp_path: Path, *extra: str, name: str = "t"):
    return small_run(tmp_path, "run.steps=2", "run.checkpoint_every=2", "optimizer.warmup_steps=1", *extra, name=name)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# A run of the name "same"; with "wait", its pre-run check (preflight) lasts until the file `go` exists (as a slow
# check of a 20 MB JSONL would), with "signal" it creates `go` when it is done. Prints its run directory.
_DRIVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from megatrain.train import loop
    from megatrain.train.config import load_config
    mode, out_dir, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    checks = loop.preflight
    def slow_preflight(*a, **k):
        for _ in range(1200):
            if go.exists():
                break
            time.sleep(0.05)
        return checks(*a, **k)
    if mode == "wait":
        loop.preflight = slow_preflight
    cfg = load_config(None, [f"run.out_dir={out_dir}", "run.name=same", "run.steps=2", "run.eval_every=0",
                             "run.checkpoint_every=2", "run.progress=false", "run.simulate=false",
                             "data.batch_size=2", "data.seq_len=32", "schedule.compute_dtype=fp32"])
    try:
        print("run_dir", loop.run_training(cfg, log=lambda line: print(line, flush=True)).run_dir, flush=True)
    finally:
        go.touch()
""")


def test_two_runs_started_together_with_one_name_get_two_directories(tmp_path):
    """The first run is inside its slow pre-run check for the whole of the second run."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _DRIVER]
    args = [str(tmp_path / "runs"), str(tmp_path / "go")]
    slow = subprocess.Popen(cmd + ["wait"] + args, stdout=subprocess.PIPE, text=True, env=env)
    first = slow.stdout.readline()  # its config line: printed once it chose its directory, before the slow check
    assert first.startswith("config:"), first
    fast = subprocess.run(cmd + ["signal"] + args, capture_output=True, text=True, env=env, timeout=300)
    rest, _ = slow.communicate(timeout=300)
    assert slow.returncode == 0 and fast.returncode == 0, fast.stderr
    dirs = [line.split(" ", 1)[1] for line in (rest + fast.stdout).splitlines() if line.startswith("run_dir ")]
    assert len(dirs) == 2 and len(set(dirs)) == 2, dirs  # two directories, one run each
    for d in map(Path, dirs):
        steps = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]  # one history each
        assert json.loads((d / "config.json").read_text())["run"]["name"] == d.name


def test_a_fresh_run_skips_a_directory_another_process_holds(tmp_path):
    held = RunLock(tmp_path / "t")  # another process's claim, before it wrote anything
    try:
        claim = claim_run_dir(tmp_path / "t", fresh=True)
        assert claim.run_dir == tmp_path / "t-1"
        claim.release()
        with pytest.raises(ConfigError, match="in use by another megatrain process"):
            claim_run_dir(tmp_path / "t", fresh=False)  # a resume of a held directory: refused
    finally:
        held.release()


@pytest.mark.parametrize("bad", [
    "data.path={tmp}/bad.jsonl",         # a pre-run check (data: not JSON lines)
    "schedule.state_tier=nvme-moments",   # refused when the store is built
])
def test_a_fresh_run_refused_before_it_starts_leaves_nothing_and_says_so(tmp_path, bad):
    (tmp_path / "bad.jsonl").write_text("this is not JSON\n")
    lines = []
    with pytest.raises(Exception):
        run_training(tiny(tmp_path, bad.format(tmp=tmp_path)), log=lines.append)
    assert not (tmp_path / "runs").exists(), _snapshot(tmp_path / "runs").keys()  # not even run.out_dir
    assert "nothing was written" in lines[-1], lines


def _trained(tmp_path: Path, *extra: str) -> Path:
    run_training(tiny(tmp_path, *extra), log=lambda line: None)
    return tmp_path / "runs" / "t"


@pytest.mark.parametrize("first, then", [
    ("schedule.state_dtype=fp32", "schedule.state_dtype=bf16"),
    ("schedule.state_dtype=bf16", "schedule.state_dtype=fp32"),
])
def test_a_resume_with_another_state_dtype_is_refused_before_allocation_naming_it(tmp_path, monkeypatch, first,
                                                                                  then):
    run = _trained(tmp_path, first)
    before = _snapshot(run)

    def no_store(self):
        raise AssertionError("the store was allocated before the resume was checked")

    monkeypatch.setattr(loop._Training, "_build_trainer", no_store)
    lines = []
    with pytest.raises(ConfigError, match=r"schedule\.state_dtype=.*--set schedule\.state_dtype="
                                          f"{first.split('=')[1]}") as e:
        run_training(tiny(tmp_path, then, "run.resume=latest", "run.steps=4"), log=lines.append)
    assert "another model" not in str(e.value)
    assert _snapshot(run) == before  # config.json, train.log, metrics, checkpoints: unchanged
    assert "nothing was written" in lines[-1]


@pytest.mark.parametrize("then", [
    "model.num_layers=2",  # another model
    "run.steps=2",         # nothing left to train
])
def test_every_refused_resume_leaves_the_run_as_it_was(tmp_path, then):
    run = _trained(tmp_path)
    before = _snapshot(run)
    with pytest.raises(Exception):
        run_training(tiny(tmp_path, "run.resume=latest", "run.steps=4", then), log=lambda line: None)
    assert _snapshot(run) == before


def test_a_resume_still_works_after_a_refused_one(tmp_path):
    run = _trained(tmp_path)
    with pytest.raises(ConfigError):
        run_training(tiny(tmp_path, "run.resume=latest", "run.steps=4", "schedule.state_dtype=bf16"),
                     log=lambda line: None)
    s = run_training(tiny(tmp_path, "run.resume=latest", "run.steps=4"), log=lambda line: None)
    assert s.start_step == 2 and s.steps == 4 and s.run_dir == run


def test_a_sharded_checkpoint_resumes_a_bf16_state_run(tmp_path):
    """Sharded checkpoints hold every rank's Adam moments in fp32 whatever the store's dtype (converted on write and
    on load), so the resume check of the moments' dtype must not refuse a data-parallel run with state_dtype=bf16,
    while a one-process checkpoint written with fp32 moments is refused for it."""
    import torch
    from safetensors.torch import save_file

    from megatrain.compile.knobs import knobs_for
    from megatrain.io.sharded_checkpoint import MANIFEST
    from megatrain.train.config import ConfigError
    from megatrain.train.resume import check_tiles

    bf16 = knobs_for("arrival", clip=0.0, state_dtype="bf16")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / MANIFEST).write_text("{}")
    save_file({f"{k}/0": torch.zeros(4) for k in ("master", "adam_m", "adam_v")}, str(sharded / "rank0.safetensors"))
    check_tiles(sharded, bf16)  # no refusal

    single = tmp_path / "single"
    single.mkdir()
    for k in ("master", "adam_m", "adam_v"):
        save_file({"0": torch.zeros(4)}, str(single / f"{k}.safetensors"))
    with pytest.raises(ConfigError, match="state_dtype"):
        check_tiles(single, bf16)
