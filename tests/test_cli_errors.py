"""Issue 22, item 3: every user-facing mistake ends `megatrain` with one line saying what is wrong, never a Python
traceback. A table of (command line, bad input) run as `python -m megatrain ...` subprocesses: each must exit non-zero
with no "Traceback" on stderr and one line that names the problem.

The table covers each error class the CLI turns into one line (cli/__init__.py `_is_user_error`, TrainingError,
argparse) and the inputs of issue 22 that printed tracebacks. Torch-free commands (plan, simulate) where they can
show the class; `train` on the debug model, refused before its first step, otherwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatrain.sim.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent


def _profile(tmp: Path, name: str, **changes) -> str:
    d = json.loads(load_profile("cpu").to_json())
    d.update(changes)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)


def _files(tmp: Path) -> dict[str, str]:
    """The bad inputs the table refers to as {name}."""
    f = {}
    f["neg_profile"] = _profile(tmp, "neg", duplex_Bps=-1)
    f["zero_profile"] = _profile(tmp, "zero", matmul_flops_per_s={"bf16": 0, "fp32": 0})
    f["nan_profile"] = _profile(tmp, "nan", h2d={"sizes_bytes": [1], "Bps": [1e9], "latency_s": float("nan")})
    f["str_profile"] = _profile(tmp, "str", gpu_memory_Bps="fast")
    f["overhead_profile"] = _profile(tmp, "overhead", task_overhead_s={"compute": -1})
    (tmp / "list.json").write_text("[1, 2]")
    f["list_profile"] = str(tmp / "list.json")
    (tmp / "trunc.json").write_text(load_profile("cpu").to_json()[:200])
    f["trunc_profile"] = str(tmp / "trunc.json")
    (tmp / "bad.toml").write_text("[run\nsteps = 3\n")
    f["bad_toml"] = str(tmp / "bad.toml")
    (tmp / "sched.toml").write_text('[schedule]\nname = "overlap"\nbuffers = "many"\n')
    f["bad_schedule_toml"] = str(tmp / "sched.toml")
    np.arange(11, dtype=np.uint8).tofile(tmp / "odd.bin")
    f["odd_bin"] = str(tmp / "odd.bin")
    np.full(5000, 60000, dtype=np.uint16).tofile(tmp / "big.bin")
    f["big_ids_bin"] = str(tmp / "big.bin")
    (tmp / "s.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "lone \\ud800"}\n')
    f["surrogate_jsonl"] = str(tmp / "s.jsonl")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "fine": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp / "tokenizer.json"))
    f["tokenizer"] = str(tmp / "tokenizer.json")
    (tmp / "runs" / "logdir" / "train.log").mkdir(parents=True)
    f["runs"] = str(tmp / "runs")
    f["long_name"] = "n" * 300
    f["tmp"] = str(tmp)
    return f


TRAIN = "train --no-progress --steps 2 --batch 2 --seq 32 --set run.simulate=false --out-dir {runs}"
# (id, command line after `megatrain`, a word the one line must hold)
CASES = [
    # argparse: numbers that are no memory size or count
    ("host-gib-nan", "plan --model debug --host-gib nan", "--host-gib"),
    ("host-gib-inf", "plan --model debug --host-gib inf", "--host-gib"),
    ("host-gib-negative", "plan --model debug --host-gib=-4", "--host-gib"),
    ("gpu-gib-nan", "plan --model debug --gpu-gib nan", "--gpu-gib"),
    ("gpus-zero", "plan --model debug --gpus 0", "--gpus"),
    ("budget-nan", "simulate --model debug --schedule auto --gpu-budget-gib nan", "--gpu-budget-gib"),
    ("batch-text", "plan --model debug --batch x", "--batch"),
    ("unknown-option", "plan --model debug --nope", "--nope"),
    ("unknown-command", "nope", "nope"),
    # SpecError / ConfigError / ScheduleError / UserError, torch-free
    ("unknown-model", "plan --model no-such-model", "no-such-model"),
    ("batch-zero", "plan --model debug --batch 0", "batch"),
    ("unknown-schedule", "simulate --model debug --schedule no-such", "no-such"),
    ("unknown-knob", "simulate --model debug --set bogus=1", "bogus"),
    ("knob-type", "simulate --model debug --set buffers=many", "buffers"),
    ("schedule-toml-type", "simulate --model debug --schedule {bad_schedule_toml}", "buffers"),
    # ProfileError: every bad field when the profile loads
    ("profile-negative", "simulate --model debug --profile {neg_profile}", "duplex_Bps"),
    ("profile-zero", "simulate --model debug --profile {zero_profile}", "matmul_flops_per_s"),
    ("profile-nan", "simulate --model debug --profile {nan_profile}", "latency_s"),
    ("profile-string", "simulate --model debug --profile {str_profile}", "gpu_memory_Bps"),
    ("profile-negative-overhead", "simulate --model debug --profile {overhead_profile}", "task_overhead_s"),
    ("profile-list", "simulate --model debug --profile {list_profile}", "list.json"),
    ("profile-truncated", "simulate --model debug --profile {trunc_profile}", "trunc.json"),
    ("profile-missing", "simulate --model debug --profile {tmp}/none.json", "none.json"),
    # train: config, data, run directory (refused before the first step)
    ("config-missing", TRAIN + " --config {tmp}/none.toml", "none.toml"),
    ("config-bad-toml", TRAIN + " --config {bad_toml}", "bad.toml"),
    ("lr-nan", TRAIN + " --set optimizer.lr=nan", "optimizer.lr"),
    ("steps-zero", TRAIN + " --set run.steps=0", "run.steps"),
    ("unknown-key", TRAIN + " --set run.nope=1", "run.nope"),
    ("long-run-name", TRAIN + " --name {long_name}", "run.name"),
    ("train-log-is-a-directory", TRAIN + " --name logdir", "train.log"),
    ("data-missing", TRAIN + " --set data.path={tmp}/none.bin", "none.bin"),
    ("data-odd-size", TRAIN + " --set data.path={odd_bin}", "odd.bin"),
    ("data-ids-beyond-vocab", TRAIN + " --set data.path={big_ids_bin}", "big.bin"),
    ("jsonl-lone-surrogate", TRAIN + " --set data.path={surrogate_jsonl} --set data.tokenizer={tokenizer}",
     "line 2"),
    ("export-missing-run", "export {tmp}/no-run {tmp}/out", "no-run"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _files(tmp_path_factory.mktemp("bad"))


def _megatrain(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "megatrain", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=kw.get("cwd", ROOT))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_user_mistake_is_one_line_never_a_traceback(case, files):
    _, line, word = case
    args = [a.format(**files) for a in line.split()]
    r = _megatrain(args)
    err = r.stderr.strip()
    assert r.returncode != 0, f"{line}: exit 0\n{r.stdout[-2000:]}"
    assert "Traceback" not in err, f"{line}:\n{err}"
    lines = err.splitlines()
    assert len(lines) == 1, f"{line}: {len(lines)} lines on stderr:\n{err}"
    assert word.format(**files) in lines[0], f"{line}: {lines[0]!r} does not name {word!r}"
    assert "error" in lines[0] or "stopped" in lines[0], lines[0]


def test_a_closed_stdout_is_one_line(files):
    """`megatrain plan ... | head -0`: the reader is gone before the first line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "megatrain", "plan", "--model", "debug"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read().strip()
    assert proc.wait(timeout=120) != 0 and "Traceback" not in err and "Exception ignored" not in err, err
    assert len(err.splitlines()) == 1 and "stdout was closed" in err, err
