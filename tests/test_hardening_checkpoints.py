"""Issue 22, "Checkpoint metadata trusted", "A run that dies without a word" (checkpoint side) and the fp16 export:
every file of a checkpoint (one-process and sharded, the manifest included) is checksummed and verified before it is
used; a damaged checkpoint is never deleted and the error names the newest complete one; a filesystem turning
read-only or full never deletes a checkpoint; outputs written after training never fail a finished run; an export
whose values overflow its dtype is refused before anything is written.

Tests run as root on the CI machines, where chmod does not stop writes: a read-only or full filesystem is simulated
by making the writes raise the OS's own error (EROFS, ENOSPC).
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from megatrain.engine.trainer import StreamedTrainer
from megatrain.io import checkpoint as ckpt_mod
from megatrain.io import safetensors_io as stio
from megatrain.io.checkpoint import CheckpointManager
from megatrain.io.checkpoint_format import KINDS, STATE_FILE, verify_checkpoint
from megatrain.io.errors import CheckpointError
from megatrain.io.hf_checkpoint import export_hf, load_hf_tiles
from megatrain.io.sharded_checkpoint import MANIFEST, load_store, save_sharded, tile_reader
from megatrain.model.init import init_tiles
from megatrain.model.presets import PRESETS
from megatrain.model.spec import EMBED, HEAD
from megatrain.parallel.world import World
from megatrain.train import outputs
from megatrain.train.errors import TrainingError
from megatrain.train.loop import run_training
from megatrain.train.metrics import read_metrics
from runconfigs import small_run

DEBUG = PRESETS["debug"]
SPEC = DEBUG.with_layers(2)


def tiles_of(seed: int) -> dict[str, dict[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = {EMBED: 300, 0: 1000, 1: 1000, HEAD: 333}
    return {k: {u: torch.randn(n, generator=g) for u, n in sizes.items()} for k in KINDS}


def edit_json(path: Path, **changes) -> None:
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta, indent=1))


def flip_byte(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10  # still a finite float: only a checksum can tell
    path.write_bytes(bytes(data))


# ---- the sharded checkpoint: manifest and slices checksummed ---------------------------------------------------
def sharded(tmp_path: Path, step: int = 30, state: dict | None = None) -> tuple[Path, StreamedTrainer]:
    tr = StreamedTrainer(SPEC, "overlap", backend="cpu")
    tr.step_count = step
    path = save_sharded(tmp_path / "ckpt" / f"step_{step:08d}", tr.store, World(), step,
                        {"optimizer_steps": {}, "x": 1} if state is None else state)
    return path, tr


def fresh_store() -> StreamedTrainer:
    return StreamedTrainer(SPEC, "overlap", backend="cpu", init=False)


def test_an_edited_manifest_step_is_refused_before_anything_is_loaded(tmp_path):
    """The issue's case: manifest.json's step edited from 30 to 25 resumed "at step 25" with step-30 weights."""
    path, _ = sharded(tmp_path, 30)
    edit_json(path / MANIFEST, trainer_step=25)
    for check in (lambda: verify_checkpoint(path), lambda: load_store(path, fresh_store().store, World()),
                  lambda: tile_reader(path)):
        with pytest.raises(CheckpointError, match=r"manifest\.json does not match"):
            check()


def test_an_edited_manifest_slice_and_a_flipped_rank_file_byte_are_refused(tmp_path):
    path, tr = sharded(tmp_path, 30)
    manifest = json.loads((path / MANIFEST).read_text())
    key = next(iter(manifest["slice"]))
    edit_json(path / MANIFEST, slice={**manifest["slice"], key: manifest["slice"][key] - 8})
    with pytest.raises(CheckpointError, match=r"manifest\.json does not match"):
        load_store(path, fresh_store().store, World())
    path, tr = sharded(tmp_path / "b", 30)
    flip_byte(path / "rank0.safetensors")
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors does not match"):
        load_store(path, fresh_store().store, World())


def test_a_manifest_without_a_state_file_checks_itself(tmp_path):
    """A sharded checkpoint written without the run's state (the manifest alone) is checksummed all the same."""
    tr = StreamedTrainer(SPEC, "overlap", backend="cpu")
    path = save_sharded(tmp_path / "alone", tr.store, World(), 7)
    assert load_store(path, fresh_store().store, World()) == 7
    edit_json(path / MANIFEST, trainer_step=5)
    with pytest.raises(CheckpointError, match=r"manifest\.json does not match"):
        load_store(path, fresh_store().store, World())


def test_a_sharded_checkpoint_still_round_trips(tmp_path):
    path, tr = sharded(tmp_path, 30)
    one = fresh_store()
    assert load_store(path, one.store, World()) == 30
    for u in tr.store.units:
        assert torch.equal(one.store.master(u), tr.store.master(u))


# ---- damaged checkpoints: named, never deleted, the newest complete one said ------------------------------------
def test_a_damaged_checkpoint_names_the_newest_complete_one_and_is_kept(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    for step in (2, 4, 6):
        mgr.save(step, tiles_of(step), {"step": step})
    flip_byte(tmp_path / "step_00000006" / "master.safetensors")
    with pytest.raises(CheckpointError, match=r"master\.safetensors does not match.*newest complete checkpoint .*"
                                              r"step_00000004"):
        mgr.load(tmp_path / "step_00000006")
    flip_byte(tmp_path / "step_00000004" / STATE_FILE, at=30)
    with pytest.raises(CheckpointError, match=r"step_00000004.*trainer_state\.json.*newest complete checkpoint .*"
                                              r"step_00000002"):
        verify_checkpoint(tmp_path / "step_00000004")
    assert [s for s, _ in mgr.checkpoints()] == [2, 4, 6]  # nothing deleted: the damaged ones are the user's


def test_resume_latest_takes_the_newest_verified_and_says_so(tmp_path):
    said = []
    mgr = CheckpointManager(tmp_path, keep_last=0, log=said.append)
    for step in (2, 4):
        mgr.save(step, tiles_of(step), {"step": step})
    flip_byte(tmp_path / "step_00000004" / "adam_v.safetensors")
    assert mgr.resolve("latest") == tmp_path / "step_00000002"
    assert len(said) == 1 and "step_00000004" in said[0] and "adam_v.safetensors" in said[0] \
        and "step_00000002" in said[0], said
    with pytest.raises(CheckpointError, match=r"newest complete checkpoint .*step_00000002"):
        mgr.resolve(str(tmp_path / "step_00000004"))  # named explicitly: refused, not replaced
    assert (tmp_path / "step_00000004" / "adam_v.safetensors").is_file()
    for step in (2, 4):
        flip_byte(tmp_path / f"step_{step:08d}" / "adam_m.safetensors")
    with pytest.raises(CheckpointError, match=r"no checkpoint .* passes verification"):
        mgr.resolve("latest")


def test_the_next_save_deletes_no_checkpoint_that_fails_verification(tmp_path):
    """A step directory without its state file (moved away, half copied back) is the user's: no save removes it."""
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(2, tiles_of(2), {})
    (tmp_path / "step_00000002" / STATE_FILE).rename(tmp_path / "state-aside.json")
    mgr.save(4, tiles_of(4), {})
    assert (tmp_path / "step_00000002" / "master.safetensors").is_file()


def test_every_kind_of_damage_to_a_one_process_checkpoint_is_caught(tmp_path):
    mgr = CheckpointManager(tmp_path / "c", keep_last=0)
    path = mgr.save(3, tiles_of(3), {"a": 1})
    for name in [f"{k}.safetensors" for k in KINDS]:
        flip_byte(path / name)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            verify_checkpoint(path)
        flip_byte(path / name)  # undo
    verify_checkpoint(path)
    edit_json(path / STATE_FILE, step=2)
    with pytest.raises(CheckpointError, match="trainer_state.json does not match its checksum"):
        verify_checkpoint(path)


# ---- read-only or full: nothing deleted, one line ---------------------------------------------------------------
def tiny(tmp_path: Path, *extra: str, name: str = "t"):
    return small_run(tmp_path, "run.checkpoint_every=2", "run.keep_last=2", "optimizer.lr=3e-3", *extra, name=name)


def steps_of(run: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_filesystem_turning_read_only_or_full_mid_run_deletes_no_checkpoint(tmp_path, monkeypatch, code):
    broken = {"on": False}
    real_write, real_open = stio._write, open

    def write(f, data):
        if broken["on"]:
            raise OSError(code, os.strerror(code))
        real_write(f, data)

    def probe_open(path, *a, **kw):  # check_writable's probe file
        if broken["on"] and ckpt_mod._TMP_PREFIX in str(path) and "probe" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(stio, "_write", write)
    monkeypatch.setattr("builtins.open", probe_open)

    def breaks_after_step_4(record):  # the record of step 5: after step 4's checkpoint, before step 6's
        if record.get("step") == 5:
            broken["on"] = True

    lines = []
    with pytest.raises(TrainingError) as e:
        run_training(tiny(tmp_path), log=lines.append, trackers=(breaks_after_step_4,))
    run = tmp_path / "runs" / "t"
    assert steps_of(run) == [2, 4]  # nothing deleted to make room
    msg = str(e.value)
    assert "\n" not in msg and "step_00000004" in msg and "--resume" in msg, msg
    assert e.value.__cause__ is None or e.value.__suppress_context__, "one line, no chained traceback"
    broken["on"] = False
    s = run_training(tiny(tmp_path, "run.resume=latest"), log=lines.append)
    assert s.start_step == 4 and s.steps == 6


def test_retention_deletes_only_after_the_new_checkpoint_is_verified(tmp_path, monkeypatch):
    """A new checkpoint that was written but reads back wrong (a silently failing disk) prunes nothing."""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, tiles_of(1), {})
    real = stio.write_safetensors

    def corrupting(path, *a, **kw):
        n = real(path, *a, **kw)
        if "master" in str(path):
            flip_byte(Path(path))  # after the digest was taken: what the disk gives back differs
        return n

    monkeypatch.setattr(stio, "write_safetensors", corrupting)
    with pytest.raises(CheckpointError, match=r"step 2 .*master\.safetensors does not match"):
        mgr.save(2, tiles_of(2), {})
    assert (tmp_path / "step_00000001").is_dir()  # the older one is kept


# ---- outputs after training -------------------------------------------------------------------------------------
def test_a_full_disk_after_the_final_checkpoint_does_not_fail_the_run(tmp_path, monkeypatch):
    def full(path, *a, **kw):
        Path(path).write_bytes(b"")  # what a full disk leaves: the file created, nothing in it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs, "gantt", lambda pair, path, **kw: full(path))
    monkeypatch.setattr(outputs, "write_chrome_trace", lambda path, *a, **kw: full(path))
    lines = []
    s = run_training(tiny(tmp_path), log=lines.append)
    run = tmp_path / "runs" / "t"
    assert s.steps == 6 and steps_of(run) == [4, 6] and list(read_metrics(run / "metrics.jsonl").step) == list(
        range(1, 7))
    assert not (run / "gantt.png").exists() and not (run / "trace.json").exists()
    assert not [p for p in run.iterdir() if p.is_file() and p.stat().st_size == 0], "no 0-byte files"
    warned = [line for line in lines if "gantt.png" in line]
    assert len(warned) == 1 and "disk is full" in warned[0] and "trace.json" in warned[0], warned
    assert "training finished" in warned[0]
    assert (run / "timeline_measured.csv").stat().st_size > 0  # what could be written was


# ---- export: values the dtype cannot hold ------------------------------------------------------------------------
def test_fp16_export_of_weights_above_65504_is_refused_before_writing(tmp_path):
    tiles = init_tiles(DEBUG)
    tiles[0][5] = 7.0e4  # a layer-0 weight beyond fp16's largest value
    tiles[1][9] = -9.5e4  # the largest, in layer 1
    out = tmp_path / "hf16"
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\..*-9\.5e\+04.*65504.*bf16") as e:
        export_hf(out, DEBUG, tiles, dtype=torch.float16)
    assert "\n" not in str(e.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written, no temporary left
    export_hf(out, DEBUG, tiles, dtype=torch.bfloat16)  # what the message suggests works
    back = load_hf_tiles(out, DEBUG)
    assert torch.isfinite(back[1]).all() and back[1][9].item() == pytest.approx(-9.5e4, rel=1e-2)
    ok = init_tiles(DEBUG)
    export_hf(tmp_path / "fine16", DEBUG, ok, dtype=torch.float16)  # in range: fp16 works as before
