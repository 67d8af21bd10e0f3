"""Ranks that cannot train together refuse before anything is allocated or written, each with one line (issue 22):
ranks given different configs, a stale WORLD_SIZE without torchrun, ranks that never arrive, more ranks than cores,
a tied-embedding model; and the memory check of a data-parallel run sums the ranks of the node.

The two-rank runs start `python -m megatrain train` twice with torchrun's variables (as tests/test_dist_cpu.py's
`launch` does), on the debug model, and are stopped by the refusal before the first step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.model.presets import PRESETS
from megatrain.parallel.world import LaunchError, World, launch_shape
from megatrain.train.config import ConfigError, load_config
from megatrain.train.distributed import config_fields, config_for_rank, differing_keys
from megatrain.train.fit import MemoryFitError, check_memory, node_ranks
from launchenv import child_env, free_port

GiB = 2**30


def _train(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "megatrain", "train", "--steps", "2", "--device", "cpu", "--batch", "1", "--seq",
            "16", "--out-dir", str(out), "--name", "r", "--no-progress", "--set", "run.simulate=false", "--set",
            "run.eval_every=0", "--set", "run.wait_timeout_s=30", *args]


def _launch_two(out: Path, rank_args: list[list[str]], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Two ranks of `megatrain train` as torchrun would start them; rank r gets `rank_args[r]` on top."""
    common = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [subprocess.Popen(_train(out, *rank_args[r]), env=child_env(**common, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    done = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


def _last_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[-1] if lines else ""


# ---- ranks given different configs ------------------------------------------------------------------------------
@pytest.mark.parametrize("key,values", [
    ("optimizer.lr", ("1e-3", "2e-3")),
    ("data.path", ("a.txt", "b.txt")),
    ("run.steps", ("2", "3")),
])
def test_ranks_given_different_configs_all_refuse_before_writing(tmp_path, key, values):
    """Before: a different lr or data file trained silently (exit 0); a different step count ended in a barrier
    traceback after the checkpoints were lost. Now both ranks refuse with one line naming the key and each rank's
    value, exit non-zero, and the run directory is never created."""
    for name in ("a.txt", "b.txt"):  # two valid corpora: only their names differ in the configs
        (tmp_path / name).write_text("the quick brown fox jumps over the lazy dog. " * 40)
    vals = [str(tmp_path / v) if key == "data.path" else v for v in values]
    out = tmp_path / "runs"
    runs = _launch_two(out, [["--set", f"{key}={v}"] for v in vals])
    for r in runs:
        line = _last_line(r)
        assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
        assert line.startswith("megatrain train: error: the 2 ranks were given different run configurations"), line
        assert key in line and "rank 0" in line and "rank 1" in line, line
        assert all(json.dumps(v if key == "data.path" else float(v) if key == "optimizer.lr" else int(v)) in line
                   for v in vals), line
        assert "run.progress" not in line
    assert not out.exists(), sorted(p.relative_to(tmp_path) for p in out.rglob("*"))


def test_the_compared_fields_are_every_key_but_the_rank_local_ones():
    a, b = load_config(None, []), load_config(None, ["optimizer.lr=2e-3", "run.progress=false", "schedule.buffers=4"])
    fa, fb = config_fields(a), config_fields(b)
    # resolved: the schedule's default knob set explicitly is no difference
    assert config_fields(load_config(None, [f"schedule.buffers={a.schedule.buffers}"])) == fa
    assert "run.progress" not in fa and {"optimizer.lr", "data.path", "run.steps", "model.name"} <= fa.keys()
    assert differing_keys([fa, fb, fa]) == {
        "optimizer.lr": {json.dumps(1e-3): [0, 2], json.dumps(2e-3): [1]},
        "schedule.buffers": {fa["schedule.buffers"]: [0, 2], fb["schedule.buffers"]: [1]}}
    assert differing_keys([fa, config_fields(a)]) == {}


# ---- a launch that is not one ------------------------------------------------------------------------------------
def test_a_stale_world_size_without_torchrun_is_one_line_at_once(tmp_path):
    """Before: KeyError 'RANK' traceback. WORLD_SIZE alone (left in the shell) is refused before anything else."""
    out = tmp_path / "runs"
    r = subprocess.run(_train(out), env=child_env(WORLD_SIZE="2"), capture_output=True, text=True, timeout=120)
    line = _last_line(r)
    assert r.returncode == 2 and "WORLD_SIZE=2 is set but RANK" in line and "torchrun" in line, r.stderr[-2000:]
    assert "unset WORLD_SIZE" in line and not out.exists()


def test_a_local_world_size_of_zero_is_one_line_not_a_division_by_zero(monkeypatch):
    """Before: LOCAL_WORLD_SIZE=0 passed the checks and launch_shape divided by it (ZeroDivisionError)."""
    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="0", MASTER_ADDR="x",
                     MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LaunchError, match=r"^LOCAL_WORLD_SIZE=0 in the environment is not a number of ranks: unset "
                                          r"WORLD_SIZE"):
        launch_shape()


def test_a_rank_whose_peers_never_arrive_is_told_so_within_the_rendezvous_wait(tmp_path):
    """Before: 300 s of silence (the run's wait timeout) and a traceback. With every torchrun variable stale and no
    peer, rank 0 gives up after the rendezvous wait (here run.wait_timeout_s=3) with one line."""
    out = tmp_path / "runs"
    env = child_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run(_train(out, "--set", "run.wait_timeout_s=3"), env=env, capture_output=True, text=True,
                       timeout=90)
    line = _last_line(r)
    assert r.returncode == 2 and "waited 3 s" in line and "did not all arrive" in line, r.stderr[-2000:]
    assert not out.exists()


def test_more_ranks_than_cores_is_one_line_before_the_rendezvous(tmp_path):
    """Before: an ExecError traceback after the process group was up. Every rank sees the same cores, so each
    refuses at once (no peer is needed)."""
    n = len(os.sched_getaffinity(0)) + 1
    env = child_env(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()))
    r = subprocess.run(_train(tmp_path / "runs"), env=env, capture_output=True, text=True, timeout=120)
    line = _last_line(r)
    assert r.returncode == 2 and f"{n} ranks on {n - 1} CPU core(s)" in line and "--nproc_per_node" in line, line


def test_a_tied_embedding_model_on_two_ranks_is_refused_before_the_store(tmp_path):
    """Before: the resolver's refusal came from the sharded store, after the run directory was written. Now the
    rank's config is refused as a ConfigError before anything is allocated."""
    tied = tmp_path / "tied"
    tied.mkdir()
    spec = PRESETS["debug"]
    hf = {**spec.to_hf_config(), "tie_word_embeddings": True}
    (tied / "config.json").write_text(json.dumps(hf))
    cfg = load_config(None, [f"model.name={tied}", "model.init=random", f"run.out_dir={tmp_path / 'runs'}"])
    assert cfg.model.spec().tie_word_embeddings
    with pytest.raises(ConfigError, match="ties its embeddings"):
        config_for_rank(cfg, World(rank=0, size=2))
    assert config_for_rank(cfg, World()) is cfg  # one process trains it
    assert not (tmp_path / "runs").exists()


# ---- memory: the ranks of a node together ------------------------------------------------------------------------
def test_the_memory_check_sums_the_ranks_of_the_node(monkeypatch):
    """Before: each rank checked the one-process plan against the whole machine, so N ranks each "fit" in memory
    that holds one. Now the node's need is the sum of the rank plans, and the message says so."""
    cfg = load_config(None, [])
    spec, knobs, (batch, seq) = cfg.model.spec(), cfg.step_knobs(), cfg.step_shape()
    one, _ = check_memory(spec, batch, seq, knobs, "cpu", host_bytes=100 * GiB, ranks=1)
    rank, lines = check_memory(spec, batch, seq, knobs, "cpu", host_bytes=100 * GiB, ranks=4)
    assert rank.host.store_bytes < one.host.store_bytes  # a rank holds its slices
    need = rank.host.total_bytes + rank.gpu.peak_bytes  # CPU backend: device buffers are host memory
    assert "the sum of 4 ranks" in lines[0]
    check_memory(spec, batch, seq, knobs, "cpu", host_bytes=4 * need, ranks=4)  # exactly fits
    with pytest.raises(MemoryFitError, match=r"does not fit this node \(4 ranks\)[\s\S]*the sum of 4 ranks"):
        check_memory(spec, batch, seq, knobs, "cpu", host_bytes=4 * need - 1, ranks=4)
    # the one-process figure of one rank would have said it fits
    assert one.host.total_bytes + one.gpu.peak_bytes < 4 * need - 1
    # under torchrun the default is the node's ranks (LOCAL_WORLD_SIZE)
    for k, v in dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", RANK="0", MASTER_ADDR="x", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    assert node_ranks() == 4
    with pytest.raises(MemoryFitError, match="the sum of 4 ranks"):
        check_memory(spec, batch, seq, knobs, "cpu", host_bytes=4 * need - 1)


def test_each_ranks_ulimit_bounds_its_share_and_the_container_the_sum(monkeypatch):
    """The node's figure: the container (shared) once, a per-process ulimit once per rank."""
    import resource
    from types import SimpleNamespace

    from megatrain.plan import machine

    monkeypatch.setattr(machine.psutil, "virtual_memory", lambda: SimpleNamespace(total=512 * GiB,
                                                                                 available=400 * GiB))
    monkeypatch.setattr(machine, "container_headroom", lambda: (8 * GiB, 6 * GiB))
    monkeypatch.setattr(machine.resource, "getrlimit", lambda which: (
        (2 * GiB, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else (resource.RLIM_INFINITY,) * 2))
    assert machine.host_memory(processes=2).usable_bytes == 4 * GiB  # 2 x the 2 GiB ulimit
    m = machine.host_memory(processes=4)
    assert (m.usable_bytes, m.bound_by) == (6 * GiB, "container")  # the shared container is tighter than 4 x 2
    assert "2 x the process's address-space limit" in machine.host_memory(processes=2).describe()
