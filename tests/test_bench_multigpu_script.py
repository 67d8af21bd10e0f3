"""scripts/bench_multigpu.py (issues 15 and 17's scaling command) on the CPU backend: one process and two gloo
ranks under torchrun at the same per-rank batch, then the table (tok/s, ratio to one rank, summed PSS against the
plan, predictions)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_on_one_and_two_ranks_then_the_table(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    script = [sys.executable, str(ROOT / "scripts" / "bench_multigpu.py")]
    common = ["--device", "cpu", "--model", "debug", "--batch", "2", "--seq", "32", "--runs", "1", "--steps", "2",
              "--profile", "cpu", "--timeout", "120"]
    for gpus in (1, 2):
        r = subprocess.run([*script, "throughput", "--gpus", str(gpus), *common], env=env, capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
    results = {json.loads(p.read_text())["gpus"]: json.loads(p.read_text()) for p in tmp_path.glob("tp-*.json")}
    assert sorted(results) == [1, 2]
    assert len(list(tmp_path.glob("tp-*g2*.rank*.timeline.csv"))) == 2  # one per rank
    one, two = results[1], results[2]
    assert two["tokens_per_s"] == 2 * 2 * 32 / two["step_s"]  # global tokens: 2 ranks x batch 2 x seq 32
    assert len(two["pss_bytes"]) == 2 and all(b > 0 for b in two["pss_bytes"])
    assert two["planned_host_bytes"] > one["planned_host_bytes"] > 0 and two["predicted_step_s"] > 0
    r = subprocess.run([*script, "table", *common], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("debug")]
    assert r.returncode == 0 and [row[2] for row in rows] == ["1", "2"], r.stdout + r.stderr
    ratio = two["tokens_per_s"] / one["tokens_per_s"]
    assert rows[1][6] == f"{ratio:.2f}"  # the x 1 GPU column
