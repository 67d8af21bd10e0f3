"""Issue 22, "tracebacks instead of one line": bad input is refused where it enters, naming what is wrong.

Profiles: every numeric field, mapping and table of a profile JSON is checked when the profile loads (a negative,
zero, NaN or string rate reached simpy as "Negative delay", a ZeroDivisionError or a str/int comparison before).
"""
import copy
import json
import math
from dataclasses import fields

import pytest

from megatrain.sim.profile import ComputeTable, HardwareProfile, ProfileError, load_profile, model_signature

CPU = json.loads(load_profile("cpu").to_json().replace("Infinity", "1e30"))
BAD = (-1.0, 0, math.nan, "fast", True, None)


def _numeric_paths(d):
    """(path, value) of every number in a profile dict: top-level fields, their mappings and the copy curves."""
    for key, value in d.items():
        if key in ("machine", "notes", "format"):
            continue
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            yield (key,), value
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    yield (key, k), v
                elif isinstance(v, list) and v:
                    yield (key, k, 0), v[0]


def _with(path, value):
    d = copy.deepcopy(CPU)
    at = d
    for p in path[:-1]:
        at = at[p]
    at[path[-1]] = value
    return d


PATHS = [p for p, _ in _numeric_paths(CPU)]


def test_the_walk_covers_the_profile():
    # a field added to the profile with a number in it shows up here, and the parametrized test below checks it
    tops = {p[0] for p in PATHS}
    assert {"duplex_Bps", "cpu_threads", "h2d", "matmul_flops_per_s", "task_overhead_s", "efficiency",
            "cpu_adam_params_per_s", "inter_host_latency_s", "host_memory_Bps"} <= tops


@pytest.mark.parametrize("path", PATHS, ids=[".".join(map(str, p)) for p in PATHS])
def test_every_numeric_field_is_refused_by_name_when_the_profile_loads(path):
    for bad in BAD:
        if bad == 0 and path[-1] in ("latency_s", "inter_host_latency_s", "copy_host_bytes_per_byte",
                                     "cpu_convert_bytes_per_param") \
                or path[0] == "task_overhead_s" and bad == 0:
            continue  # zero is a valid time (or byte count: a conversion pass that costs no bandwidth)
        if bad is None and path == ("host_memory_Bps",):
            continue  # None: derived from the legacy fields
        text = json.dumps(_with(path, bad)).replace("NaN", "NaN")
        with pytest.raises(ProfileError) as e:
            HardwareProfile.from_json(text, where="p.json")
        msg = str(e.value)
        assert "p.json" in msg and "\n" not in msg, msg
        named = str(path[1]) if path[0] in ("matmul_flops_per_s", "efficiency", "cpu_adam_params_per_s",
                                            "cpu_optimizer_slowdown", "task_overhead_s") else str(path[-1])
        if path[0] in ("h2d", "d2h"):
            assert path[0] in msg, msg
        assert named in msg, (path, bad, msg)


@pytest.mark.parametrize("text", ["[1, 2]", '"h200"', "3", json.dumps(dict(CPU, h2d=[1])),
                                  json.dumps(dict(CPU, compute_tables={"a": 1})),
                                  json.dumps(dict(CPU, collectives={"G": {"latency_s": 0, "sizes": [], "bus_Bps": []}})),
                                  json.dumps(dict(CPU, collectives={"G": {"latency_s": -1, "sizes": [1],
                                                                          "bus_Bps": [1e9]}})),
                                  json.dumps(dict(CPU, collectives={"Q": {}})),
                                  json.dumps(dict(CPU, cpu_adam_params_per_s={"many": 1e9})),
                                  json.dumps(dict(CPU, name=5)), json.dumps(dict(CPU, machine=[]))])
def test_wrong_shapes_are_refused_when_the_profile_loads(text):
    with pytest.raises(ProfileError) as e:
        HardwareProfile.from_json(text, where="p.json")
    assert "p.json" in str(e.value)


def test_compute_table_values_are_checked():
    d = copy.deepcopy(CPU)
    d["compute_tables"] = [{"model": "m", "kind": "F", "unit": "layer", "seq": 16, "tokens": [32, 64],
                            "dur_s": [1e-3, math.nan]}]
    with pytest.raises(ProfileError, match=r"dur_s\[1\]"):
        HardwareProfile.from_json(json.dumps(d), where="p.json")
    d["compute_tables"][0].update(dur_s=[1e-3, 2e-3], seq="16")
    with pytest.raises(ProfileError, match="seq"):
        HardwareProfile.from_json(json.dumps(d), where="p.json")


def test_valid_profiles_still_round_trip():
    for name in ("cpu", "h200", "h200-measured"):
        p = load_profile(name)
        assert HardwareProfile.from_json(p.to_json()) == p
    assert {f.name for f in fields(HardwareProfile)} >= set(HardwareProfile._BOUNDS)


def test_a_cached_profile_that_does_not_load_is_measured_again(tmp_path, monkeypatch):
    """A truncated profile in the cache broke every later `--schedule auto` with a traceback; now it is named in one
    line and measured again (the cache is rewritten)."""
    from megatrain.compile.knobs import knobs_for
    from megatrain.model.presets import PRESETS
    from megatrain.profiling.calibrate import Calibration
    from megatrain.profiling.machine import this_machine
    from megatrain.profiling.store import cache_path
    from megatrain.train import autoprofile

    spec = PRESETS["debug"]
    path = cache_path(this_machine("cpu"))  # tests/conftest.py points the cache at a tmp dir
    path.parent.mkdir(parents=True)
    path.write_text(load_profile("cpu").to_json()[:300])  # truncated mid-write
    measured = []

    def fake_measure(request, log):
        measured.append(request)
        # a profile of this machine that covers the debug model at seq 16 (what auto checks before measuring)
        table = ComputeTable(model_signature(spec), "F", "layer", 16, (32,), (1e-3,), dtype=request.knobs.compute_dtype)
        return Calibration(load_profile("cpu").with_(machine=this_machine("cpu"), compute_tables=(table,)), {})

    monkeypatch.setattr(autoprofile, "measure_profile", fake_measure)
    lines = []
    got = autoprofile.machine_profile(spec, 2, 16, knobs_for("overlap"), "cpu", log=lines.append)
    assert measured and got.profile == str(path)
    assert any("does not load" in line and str(path) in line for line in lines), lines
    assert load_profile(path).name == "cpu"  # the cache holds a profile again
    lines.clear()
    autoprofile.machine_profile(spec, 2, 16, knobs_for("overlap"), "cpu", log=lines.append)
    assert len(measured) == 1 and "using this machine's profile" in lines[0]


# ---- data ------------------------------------------------------------------------------------------------------
def _tiny_run(tmp_path, *extra, name="t"):
    from megatrain.train.config import load_config

    return load_config(None, [
        f"run.out_dir={tmp_path / 'runs'}", f"run.name={name}", "run.steps=8", "run.eval_every=0",
        "run.checkpoint_every=2", "run.progress=false", "run.simulate=false", "data.batch_size=2",
        "data.seq_len=32", "run.log_every=1", "schedule.compute_dtype=fp32", *extra])


def _bin(path, n=4000):
    import numpy as np

    np.random.default_rng(0).integers(0, 256, n).astype(np.uint16).tofile(path)
    return path


@pytest.mark.parametrize("change", ["truncate", "rewrite", "replace", "delete"])
def test_a_data_file_changed_under_the_run_is_named_with_the_newest_checkpoint(tmp_path, change):
    """A .bin file truncated while a run read it killed the process with SIGBUS (np.memmap); every change of the file
    now ends the run with one message naming it and the newest complete checkpoint."""
    import os

    import numpy as np

    from megatrain.train.errors import TrainingError
    from megatrain.train.loop import run_training

    path = _bin(tmp_path / "train.bin")

    def log(line):
        if line.startswith("step 3/"):
            if change == "truncate":
                os.truncate(path, 100)
            elif change == "rewrite":  # same size, new bytes
                st = os.stat(path)
                np.zeros(2000, np.uint16).tofile(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            elif change == "replace":
                _bin(tmp_path / "new.bin")
                os.replace(tmp_path / "new.bin", path)
            else:
                os.unlink(path)

    with pytest.raises(TrainingError) as e:
        run_training(_tiny_run(tmp_path, f"data.path={path}", "data.shuffle=false", "data.eval_fraction=0"), log=log)
    msg = str(e.value)
    assert str(path) in msg and "changed while the run read it" in msg and "\n" not in msg, msg
    assert "step_00000002" in msg and "--resume" in msg, msg


def test_the_held_out_split_of_a_bin_file_reads_its_own_range(tmp_path):
    import numpy as np

    from megatrain.data.batches import read_bin

    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    train, held = read_bin(path).split(900)
    assert len(train) == 900 and len(held) == 100
    assert held.tokens[0] == 900 and held.tokens[-1] == 999 and list(held.tokens[98:]) == [998, 999]
    assert held.tokens.part(10, 12).tolist() == [910, 911] and int(train.tokens.max()) == 899


@pytest.mark.parametrize("line, what", [
    (b'{"text": "a lone \\ud800 surrogate"}', "lone surrogate"),
    (b'{"text": "bad \xff byte"}', "not UTF-8"),
    (b'{"text": 5}', "no string field"),
    (b'{"text": "unterminated', "not valid JSON"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path, line, what):
    from megatrain.data.batches import DataError, read_jsonl
    from megatrain.data.tokenization import load_tokenizer  # noqa: F401  (the tokenizers package is needed)

    tok = _word_tokenizer(tmp_path)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\n' + line + b"\n")
    with pytest.raises(DataError) as e:
        read_jsonl(path, tok)
    assert f"{path}, line 3" in str(e.value) and what in str(e.value), e.value


def _word_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "fine": 1, "a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


# ---- skips -----------------------------------------------------------------------------------------------------
def test_a_plan_settled_once_is_never_counted_again():
    """An "overlap" run's last step skipped as a whole was counted twice: settled when the step ended, and again
    when the final checkpoint's flush() handed the same plan back."""
    from megatrain.exec.optim import UpdatePlan
    from megatrain.train.skips import SkipTracker

    t = SkipTracker(n_units=4)
    whole = UpdatePlan(step=7, lr=1e-3, skip=True)
    assert len(t.settle(whole)) == 1
    assert t.settle(whole) == [] and t.settle(None, whole) == []
    partly = UpdatePlan(step=8, lr=1e-3, skipped_units=[1], applied_units=[0])
    assert t.settle(partly) == []  # two units still to come: pending
    partly.applied_units += [2, 3]
    assert len(t.settle(partly)) == 1 and t.settle(partly) == []
    assert t.skipped_steps == [8, 9] and t.skipped_unit_updates == 5 and t.consecutive == 2


def test_an_overlap_run_counts_its_last_skipped_step_once(tmp_path):
    from megatrain.train.loop import run_training

    s = run_training(_tiny_run(tmp_path, "schedule.name=overlap", "optimizer.lr=1e6", "optimizer.warmup_steps=0",
                               "run.max_skipped_steps=0", "run.steps=4", "run.checkpoint_every=0"),
                     log=lambda line: None)
    assert len(s.skipped_steps) == len(set(s.skipped_steps)), s.skipped_steps


# ---- the run's log ---------------------------------------------------------------------------------------------
def _train_cmd(tmp_path, *extra):
    import sys

    return [sys.executable, "-m", "megatrain", "train", "--out-dir", str(tmp_path / "runs"), "--name", "p",
            "--steps", "400", "--no-progress", "--batch", "2", "--seq", "32", "--set", "run.simulate=false",
            "--set", "run.log_every=1", "--set", "run.eval_every=0", "--set", "run.checkpoint_every=0", *extra]


def test_a_closed_stdout_stops_the_run_at_a_step_boundary_with_a_checkpoint(tmp_path):
    """`megatrain train ... | head` ended the run with a BrokenPipeError traceback, no checkpoint, no resume hint."""
    import signal
    import subprocess

    proc = subprocess.Popen(_train_cmd(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # once the run is going, the reader goes away
        if line.split("/")[0].split() == ["step", "2"]:
            break
    else:
        pytest.fail(f"the run ended before step 2: {proc.stderr.read()}")
    proc.stdout.close()
    err = proc.stderr.read()
    rc = proc.wait(timeout=300)
    assert rc == 128 + signal.SIGPIPE, (rc, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "stdout was closed" in err, err
    run = tmp_path / "runs" / "p"
    log = (run / "train.log").read_text()
    stop = [line for line in log.splitlines() if line.startswith("stopped after step")]
    assert stop and "SIGPIPE" in stop[0] and "--resume" in stop[0], log[-2000:]
    step = int(stop[0].split()[3])
    assert step < 400 and (run / "checkpoints" / f"step_{step:08d}").is_dir()


def test_a_train_log_that_is_a_directory_is_one_line(tmp_path):
    import subprocess

    (tmp_path / "runs" / "p" / "train.log").mkdir(parents=True)
    r = subprocess.run(_train_cmd(tmp_path, "--steps", "2"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "train.log" in r.stderr, r.stderr
