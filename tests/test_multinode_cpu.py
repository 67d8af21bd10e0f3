"""More than one host through torchrun, on one machine: two torchrun agents (`--nnodes 2 --nproc_per_node 2`, each
its own "node") meet through a local c10d rendezvous and train the debug model with gloo on the CPU backend.

- the four ranks train like one process accumulating the same global batch (the tolerance of test_dist_cpu.py);
- each node holds only its ranks' share of the host store (the per-node line every run logs) and the launch line
  names each rank's node and cores;
- the checkpoint of the 2-node run resumes on one node of two ranks and trains on like the one process;
- a node that dies (its agent and workers killed) stops the other node within the run's wait timeout, with one line
  naming the ranks and the node that stopped answering.

Every subprocess is killed in a `finally` (agents and the workers they started in their own sessions), and every
wait has a timeout. On a 2-core CI machine the four ranks share two cores: tiny shapes and few steps.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megatrain.exec.backend import ExecError
from megatrain.parallel.liveness import PeerLost
from megatrain.parallel.world import World, rank_cores
from megatrain.train.distributed import core_ranges, launch_line
from launchenv import child_env, free_port

LOSS_TOL = 1e-6  # relative, per step: as tests/test_dist_cpu.py
WAIT_S = 120  # the longest any launch may take here


def _train_args(out: Path, name: str, steps: int, *extra: str) -> list[str]:
    return ["-m", "megatrain", "train", "--steps", str(steps), "--device", "cpu", "--batch", "1", "--seq", "16",
            "--out-dir", str(out), "--name", name, "--no-progress", "--lr", "1e-2",
            "--set", "optimizer.decay=constant", "--set", "optimizer.warmup_steps=0",  # resumable to more steps
            "--set", "run.eval_every=0", "--set", "run.checkpoint_every=0", "--set", "run.simulate=false",
            "--set", "schedule.compute_dtype=fp32", "--set", "schedule.weight_wire=fp32", *extra]


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill a torchrun agent and every worker it started (torchrun starts each in its own session)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    for p in [*kids]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _start_nodes(train: list[str], run_id: str) -> list[subprocess.Popen]:
    """Two torchrun agents, one per "node", meeting at a local c10d rendezvous."""
    endpoint = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                              "2", "--node_rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                              "--rdzv-id", run_id, "--max-restarts", "0", *train],
                             env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node in (0, 1)]


def _wait_all(procs: list[subprocess.Popen], timeout: float = WAIT_S) -> list[tuple[int, str, str]]:
    done, deadline = [], time.monotonic() + timeout
    for p in procs:
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        done.append((p.returncode, out, err))
    return done


def _run_one(cmd: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, *cmd], env=child_env(), capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    return r


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {rec["step"]: rec["loss"] for rec in records}


def _close(a: dict[int, float], b: dict[int, float], steps) -> None:
    errs = [abs(a[s] - b[s]) / abs(b[s]) for s in steps]
    assert max(errs) <= LOSS_TOL, (a, b)


def test_two_nodes_of_two_ranks_train_like_one_process_and_resume_on_one_node(tmp_path):
    runs = tmp_path / "runs"
    # the reference: one process, the same global batch (4 ranks x batch 1 = 4 accumulated), 5 steps
    one = _run_one(_train_args(runs, "one", 5, "--set", "run.grad_accum=4"))
    bpp_one = float(re.search(r"host store: [\d.]+ GiB, ([\d.]+) B/param", one.stdout).group(1))
    ref = _losses(runs / "one")

    nodes = _start_nodes(_train_args(runs, "mn", 3), "mn-train")
    try:
        done = _wait_all(nodes)
    finally:
        for p in nodes:
            _kill_tree(p)
    for rc, out, err in done:
        assert rc == 0, err[-3000:] + out[-2000:]
    out0 = done[0][1] + done[1][1]  # rank 0 (on whichever agent the rendezvous made node 0) logs
    assert out0.count("done: 3 steps") == 1, out0[-3000:]
    got = _losses(runs / "mn")
    _close(got, ref, [1, 2, 3])
    # the launch line names every rank's node and its own core(s); the per-node store line has each node's bytes
    launch = re.search(r"launch: 4 ranks on 2 nodes x 2; cores: (.*)", out0).group(1)
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):  # each node's ranks on disjoint cores (the machine has >= 2)
        got_cores = [re.search(rf"rank {r} ([\d,-]+)", launch).group(1) for r in ranks]
        assert f"node {node}: rank {ranks[0]}" in launch and len(set(got_cores)) == 2, launch
    # each rank holds 1/4 of every unit (rank 0's B/param), each node its two ranks' (the per-node line)
    bpp_rank0 = float(re.search(r"host store: [\d.]+ GiB, ([\d.]+) B/param", out0).group(1))
    assert 0.2 * bpp_one < bpp_rank0 < 0.3 * bpp_one, (bpp_rank0, bpp_one)
    per_node = re.search(r"host store per node: .*bytes by node: 0=(\d+), 1=(\d+)\)", out0)
    assert per_node, out0[-3000:]
    assert int(per_node.group(1)) == int(per_node.group(2)) > 0
    assert "memory: host: fits: this node needs" in out0 and "the sum of 2 ranks" in out0

    # resume the 2-node checkpoint on one node of two ranks (grad_accum 2 keeps the global batch) up to step 5
    resume = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              *_train_args(runs, "mn", 5, "--set", "run.grad_accum=2", "--set", "run.resume=latest")]
    r = subprocess.run(resume, env=child_env(), capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    assert "launch: 2 ranks on 1 node x 2" in r.stdout, r.stdout[-2000:]
    _close(_losses(runs / "mn"), ref, [1, 2, 3, 4, 5])


def test_a_node_that_dies_stops_the_other_within_the_timeout_naming_it(tmp_path):
    runs, timeout_s = tmp_path / "runs", 20
    nodes = _start_nodes(_train_args(runs, "die", 100000, "--set", f"run.wait_timeout_s={timeout_s}",
                                     "--set", "run.checkpoint_at_end=false"), "mn-die")
    try:
        metrics = runs / "die" / "metrics.jsonl"
        deadline = time.monotonic() + WAIT_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both nodes are stepping
            assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), \
                [p.poll() for p in nodes]
            time.sleep(0.2)
        # the rendezvous numbers the nodes in its own order: kill the agent whose workers are node 1 (node 0's
        # agent hosts the launch's store, which a real cluster keeps on its first node)
        victim = next(p for p in nodes if _node_of(p) == 1)
        survivor = next(p for p in nodes if p is not victim)
        killed_at = time.monotonic()
        _kill_tree(victim)
        rc, out, err = _wait_all([survivor], timeout=timeout_s + 60)[0]
        took = time.monotonic() - killed_at
    finally:
        for p in nodes:
            _kill_tree(p)
    assert rc != 0 and took < timeout_s + 30, (rc, took)
    text = out + err
    lines = [line for line in text.splitlines() if "stopped answering" in line]
    assert lines, text[-4000:]
    named = re.search(r"ranks? ([\d,]+) \(nodes? ([\d,]+)\) of 4 stopped answering", lines[0])
    assert named, lines[0]
    assert set(named.group(1).split(",")) == {"2", "3"} and named.group(2) == "1", lines[0]
    assert all(line.startswith(("megatrain train: stopped:", "[rank0]:megatrain train: stopped:",
                                "[rank1]:megatrain train: stopped:")) for line in lines), lines  # no traceback


def _node_of(agent: subprocess.Popen) -> int:
    """The node (GROUP_RANK) torchrun's rendezvous gave `agent`, read from its workers' environment."""
    for kid in psutil.Process(agent.pid).children(recursive=True):
        try:
            env = kid.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "GROUP_RANK" in env:
            return int(env["GROUP_RANK"])
    raise AssertionError(f"torchrun agent {agent.pid} has no workers")


class _Watch:
    """A liveness watch that names no rank, with `note` (non-empty: the launch's store did not answer)."""

    def __init__(self, note: str):
        self.note = note

    def stopping(self) -> None:
        pass

    def silent_ranks(self) -> tuple[list[int], str]:
        return [], self.note


def test_node_0_gone_with_the_store_is_a_lost_peer_saying_how_to_resume():
    """Before: when node 0 (the store's host) died, no rank could be named and the error was a plain ExecError,
    which run_training does not catch (a traceback). Now it is PeerLost with the resume advice; a failure with the
    store answering and no rank gone stays a plain ExecError."""
    note = " (the launch's store at h:1 does not answer either: the node hosting it, node 0, is gone)"
    world = World(rank=2, size=4, local_size=2, watch=_Watch(note))
    e = world.peer_error("summing the loss", RuntimeError("Connection closed by peer"))
    assert isinstance(e, PeerLost), e
    assert str(e).startswith("rank 2 on node 1 failed while summing the loss: Connection closed by peer (the launch's "
                             "store at h:1 does not answer"), e
    assert str(e).endswith("resume from the last checkpoint (run.resume=latest) once every node is up"), e
    plain = World(rank=2, size=4, local_size=2, watch=_Watch("")).peer_error("x", RuntimeError())
    assert type(plain) is ExecError and str(plain) == "rank 2 failed while x: RuntimeError", plain


# ---- binding: each local rank its own cores -----------------------------------------------------------------------
def test_local_ranks_get_disjoint_cores_covering_the_node():
    # rank_cores is a function of the core list: a made-up node's (with a gap) and this machine's, whatever it has
    for cores in ([0, 1, 2, 3, 6, 7], sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []):
        for local in sorted({2, len(cores)}) if len(cores) >= 2 else []:
            shares = [set(rank_cores(r, local, cores)) for r in range(local)]
            assert all(shares) and set().union(*shares) == set(cores)
            assert sum(len(s) for s in shares) == len(cores)  # disjoint
    assert rank_cores(0, 3, list(range(8))) == [0, 1, 2] and rank_cores(2, 3, list(range(8))) == [6, 7]
    assert core_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    line = launch_line(World(rank=0, size=4, local_size=2), [(0, [0]), (0, [1]), (1, [0]), (1, [1])])
    assert "node 0: rank 0 0, rank 1 1; node 1: rank 2 0, rank 3 1" in line, line
