"""`megatrain profile` measures the collectives between ranks (profiling/collectives.py): under torchrun (2 gloo
ranks on the CPU backend here) it writes the profile's `collectives` table, which the simulator's `collective_s`
turns back into the measured times, at the bus bytes the IR gives a G / Z task of that message."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain.cli import main
from megatrain.compile.collectives import _collective_attrs
from megatrain.sim.collectives import collective_s
from megatrain.sim.profile import load_profile

ROOT = Path(__file__).parent.parent
RANKS = 2


def _profile_cli(tmp_path, *args, device: str = "cpu") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", "-m",
           "megatrain", "profile", "--device", device, *args]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    r = subprocess.run(cmd + ["--wait-timeout", "120"], env=env, capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    return r


def _check_table(p, rec: dict) -> None:
    """The table's shape, and `collective_s` at a task's bus bytes giving the measured time of its message."""
    assert set(p.collectives) == {"G", "Z", "A"} and rec["world"] == RANKS
    for kind, t in p.collectives.items():
        k = rec["kinds"][kind]
        assert t["latency_s"] > 0 and len(t["sizes"]) == len(t["bus_Bps"]) == len(k["message_bytes"]) >= 3
        assert all(a < b for a, b in zip(t["sizes"], t["sizes"][1:])) and all(r > 0 for r in t["bus_Bps"])
        item = {"bf16": 2, "fp32": 4}[k["dtype"]]
        for msg, secs, busbw in zip(k["message_bytes"], k["time_s"], k["busbw_Bps"]):
            assert msg % (RANKS * item) == 0
            # nccl-tests' bus bandwidth (doc/PERFORMANCE.md): S / t x (n-1)/n, all-reduce 2(n-1)/n
            assert busbw == pytest.approx(msg / secs * (2 if kind == "A" else 1) * (RANKS - 1) / RANKS, rel=1e-12)
            if kind == "A":  # no A task: its bus bytes as nccl-tests counts them
                assert collective_s(p, "A", msg * 2 * (RANKS - 1) / RANKS) == pytest.approx(secs, rel=1e-9)
                continue
            task_bytes = _collective_attrs(msg, msg // item, RANKS)["bytes"]  # what the IR gives the task
            norm = p.collectives["A"]["latency_s"] if kind == "Z" else 0.0  # the norm's all-reduce after a Z
            assert collective_s(p, kind, task_bytes) - norm == pytest.approx(secs, rel=1e-9), (kind, msg)


def test_collectives_only_under_torchrun_writes_a_table_the_simulator_reads(tmp_path):
    out = tmp_path / "coll.json"
    r = _profile_cli(tmp_path, "--collectives-only", "--out", str(out))
    assert r.stdout.count("profile written to") == 1 and "all-gather" in r.stdout  # rank 0 alone reports
    p, base = load_profile(out), load_profile("cpu")
    rec = json.loads(out.with_name("coll.measurements.json").read_text())["collectives"]
    assert rec["backend"] == "gloo"
    assert {k: v["dtype"] for k, v in rec["kinds"].items()} == {"G": "bf16", "Z": "fp32", "A": "fp32"}
    _check_table(p, rec)
    assert "2 ranks, gloo" in p.notes["collectives"] and "cpu's" in p.notes["measured"]
    assert p.h2d == base.h2d and p.cpu_adam_params_per_s == base.cpu_adam_params_per_s  # the rest: --base
    # the matmuls beside each scheduled collective: measured on both ranks, written as factors >= 1
    beside = rec["compute_beside"]
    assert set(beside["factor"]) == {"G", "Z"} and beside["alone_s"] > 0
    assert all(t > 0 for t in beside["with_s"].values())
    assert all(f > 0 for f in beside["factor"].values())
    assert p.compute_beside_collective == {op: max(1.0, f) for op, f in beside["factor"].items()}
    assert "beside each collective" in p.notes["compute_beside_collective"] and "matmul" in r.stdout


def test_a_full_profile_under_torchrun_adds_the_collectives(tmp_path):
    out = tmp_path / "full.json"
    r = _profile_cli(tmp_path, "--model", "debug", "--batch", "1", "--seq", "16", "--quick", "--dtype", "fp32",
                     "--set", "schedule.weight_wire=fp32", "--out", str(out))
    assert r.stdout.count("profile written to") == 1
    p = load_profile(out)
    rec = json.loads(out.with_name("full.measurements.json").read_text())["collectives"]
    assert rec["kinds"]["G"]["dtype"] == "fp32"  # the schedule's weight wire
    _check_table(p, rec)
    assert p.compute_tables and p.cpu_adam_params_per_s  # and the rest measured as without torchrun
    # rank 0 measured the rest on all the cores (its rank's pinning undone), as one process would
    assert p.machine["cores"] == len(os.sched_getaffinity(0))


def test_collectives_only_in_one_process_says_to_use_torchrun(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["profile", "--collectives-only", "--device", "cpu", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "one process" in err and "torchrun --standalone --nproc_per_node=2" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()
    assert main(["profile", "--base", "cpu", "--device", "cpu", "--out", str(tmp_path / "x.json")]) == 2
    assert "--base goes with --collectives-only" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_table_predicts_a_size_it_did_not_measure(tmp_path):
    """On 2 GPUs: the measured table, and a size left out of it predicted from its neighbours within 15%."""
    out = tmp_path / "nccl.json"
    _profile_cli(tmp_path, "--collectives-only", "--out", str(out), device="cuda")
    p = load_profile(out)
    rec = json.loads(out.with_name("nccl.measurements.json").read_text())["collectives"]
    assert rec["backend"] == "nccl"
    _check_table(p, rec)
    for kind in ("G", "Z"):
        t = p.collectives[kind]
        i = len(t["sizes"]) - 2  # 256 MiB, between 64 MiB and 1 GiB
        cut = {key: (v[:i] + v[i + 1:] if isinstance(v, list) else v) for key, v in t.items()}
        q = p.with_(collectives=dict(p.collectives, **{kind: cut}))
        norm = p.collectives["A"]["latency_s"] if kind == "Z" else 0.0
        assert collective_s(q, kind, t["sizes"][i]) - norm == pytest.approx(rec["kinds"][kind]["time_s"][i], rel=0.15)
