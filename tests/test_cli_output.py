"""What a run prints, where it goes, and what a tracker receives: readable in a terminal and in a pipe."""
from __future__ import annotations

import subprocess
import sys

from megatrain.compile.knobs import knobs_for
from megatrain.train.config import load_config
from megatrain.train.log import RunLog, compile_note
from megatrain.train.loop import run_training
from megatrain.train.metrics import METRIC_KEYS


def test_piped_train_output_has_no_bar_and_a_line_every_n_steps(tmp_path):
    # A real pipe (what `| tee` and CI logs see): no carriage returns, no progress-bar frames, short lines.
    cmd = [sys.executable, "-m", "megatrain", "train", "--steps", "4", "--batch", "2", "--seq", "32",
           "--out-dir", str(tmp_path / "runs"), "--set", "run.log_every=2", "--set", "run.simulate=false",
           "--set", "run.eval_every=0", "--set", "schedule.compute_dtype=fp32"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stdout + p.stderr and "it/s" not in p.stderr and "step/s" not in p.stderr
    lines = p.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["2/4", "4/4"]
    assert max(len(line) for line in lines) < 250
    assert lines[0].startswith("config: model debug") and lines[0].endswith("runs/debug/config.toml)")
    log = (tmp_path / "runs" / "debug" / "train.log").read_text()
    assert log == p.stdout  # train.log holds what the console showed


def test_run_log_keeps_lines_until_the_run_directory_exists(tmp_path):
    seen: list[str] = []
    log = RunLog(seen.append)
    log("before")
    assert not (tmp_path / "train.log").exists()
    log.open(tmp_path)
    log("after")
    bar = log.progress_bar(total=3, initial=0, enabled=True, desc="x")  # a sink, not a terminal: no bar
    bar.update(1)
    log.close()
    assert (tmp_path / "train.log").read_text() == "before\nafter\n" and seen == ["before", "after"]
    resumed = RunLog(seen.append)  # a resumed run appends to its log
    resumed.open(tmp_path)
    resumed("again")
    resumed.close()
    assert (tmp_path / "train.log").read_text() == "before\nafter\nagain\n"


def test_a_compiled_schedule_says_so_before_its_silent_first_step():
    assert compile_note(knobs_for("overlap"), "cpu") is None
    note = compile_note(knobs_for("overlap", compile_layers=True), "cpu")
    assert note.startswith("the first step compiles the decoder layer") and "minute" in note


def test_trackers_get_every_steps_record(tmp_path):
    records: list[dict] = []
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.steps=3", "run.eval_every=0", "run.simulate=false",
                             "run.progress=false", "run.checkpoint_every=0", "data.batch_size=2", "data.seq_len=32",
                             "schedule.compute_dtype=fp32"])
    lines: list[str] = []
    s = run_training(cfg, log=lines.append, trackers=[records.append])
    assert [r["step"] for r in records] == [1, 2, 3] and all(tuple(r) == METRIC_KEYS for r in records)
    assert [r["loss"] for r in records] == s.losses
    # log_every (default 10) > steps: only the last step's line, and train.log has every line.
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["3/3"]
    assert (tmp_path / "debug" / "train.log").read_text() == "".join(line + "\n" for line in lines)


# ---- TensorBoard event files, written without the tensorboard package ---------------------------------------------
def _records(path):
    """The TFRecord payloads of an event file, each frame's two masked CRCs checked."""
    import struct

    from megatrain.train.tensorboard import masked_crc32c

    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        assert struct.unpack_from("<I", data, i + 8)[0] == masked_crc32c(data[i:i + 8])
        payload = data[i + 12:i + 12 + n]
        assert struct.unpack_from("<I", data, i + 12 + n)[0] == masked_crc32c(payload)
        out.append(payload)
        i += 16 + n
    return out


def _varint(buf, i):
    value, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf):
    """(field number, value) pairs of a protobuf message: varints, 8/4-byte scalars and length-delimited bytes."""
    import struct

    i, out = 0, []
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = struct.unpack_from("<d", buf, i)[0], i + 8
        elif wire == 5:
            value, i = struct.unpack_from("<f", buf, i)[0], i + 4
        else:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        out.append((number, value))
    return out


def test_run_tensorboard_writes_event_files_tensorboard_reads(tmp_path):
    from megatrain.train.tensorboard import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.steps=2", "run.eval_every=2", "run.eval_batches=1",
                             "run.simulate=false", "run.progress=false", "run.checkpoint_every=0",
                             "run.tensorboard=true", "data.batch_size=2", "data.seq_len=32",
                             "schedule.compute_dtype=fp32"])
    s = run_training(cfg, log=lambda _: None)
    (events,) = (tmp_path / "debug" / "tensorboard").glob("events.out.tfevents.*")
    records = [dict(_fields(r)) for r in _records(events)]
    assert records[0][3] == b"brain.Event:2"  # file_version first
    assert [r[2] for r in records[1:]] == [1, 2]  # one event per step
    scalars = [{dict(_fields(v))[1].decode(): dict(_fields(v))[2] for n, v in _fields(r[5]) if n == 1}
               for r in records[1:]]
    assert [round(x["train/loss"], 4) for x in scalars] == [round(v, 4) for v in s.losses]
    assert "eval/eval_loss" in scalars[1] and "eval/eval_loss" not in scalars[0] and "train/skipped" not in scalars[0]
    try:  # and TensorBoard itself, where it is installed
        from tensorboard.backend.event_processing.event_accumulator import (
            EventAccumulator,
        )
    except ImportError:
        return
    ea = EventAccumulator(str(events.parent))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 2]
