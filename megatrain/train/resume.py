"""Resuming a run: the checkpoint checked against this run before anything is allocated, then read into the store.

Checked first (no allocation, nothing written): the state file's and every tensor file's checksum, the model (the
shapes that matter, not the model's name or directory, so a renamed Hugging Face directory still resumes), the
unit list against the model's units, the tiles' dtypes against the store this run allocates (schedule.state_dtype,
named when it differs), the step against run.steps, and the data cursor against the data. The run's files are
written only after the checkpoint was read into the store (train/loop.py), so a refused resume changes nothing.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatrain.exec.store import TORCH_DTYPES
from megatrain.io import safetensors_io as stio
from megatrain.io.checkpoint import CheckpointManager, set_rng_state
from megatrain.io.checkpoint_format import STATE_FILE, key_unit, verify_checkpoint
from megatrain.io.errors import CheckpointError
from megatrain.train.config import ConfigError, RunConfig
from megatrain.data.batches import DataError
from megatrain.train.lr import lr_change_note
from megatrain.io.sharded_checkpoint import is_sharded, load_store
from megatrain.train.rundir import set_aside_newer

# Spec fields that name a model rather than shape it: a run may resume after its HF directory was renamed.
_NAMING_FIELDS = ("name",)
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def resume_state(cfg: RunConfig, spec, manager: CheckpointManager, data, knobs) -> dict:
    """The checkpoint `cfg.run.resume` names, verified and checked against this run (`knobs`: its step knobs, for
    the store it will allocate): {path, step, state}. Reads headers and the state file only, writes nothing."""
    path = manager.resolve(cfg.run.resume)
    meta = verify_checkpoint(path)
    state, step = meta["state"], meta["step"]
    saved_spec = state.get("spec", {})
    mine = json.loads(json.dumps(spec.to_dict()))
    if not isinstance(saved_spec, dict):
        raise CheckpointError(f"{path / STATE_FILE} is damaged: 'spec' is not an object")
    diff = sorted(k for k in set(saved_spec) | set(mine)
                  if k not in _NAMING_FIELDS and saved_spec.get(k) != mine.get(k))
    if diff:
        raise CheckpointError(f"checkpoint {path} was written for another model ({', '.join(diff)} differ: "
                              f"{ {k: saved_spec.get(k) for k in diff} } vs { {k: mine.get(k) for k in diff} }); "
                              "resume with the model config it was written with")
    if sorted(meta["units"]) != sorted(spec.units()):
        raise CheckpointError(f"checkpoint {path} holds units {meta['units']}, but {spec.name} has {spec.units()}; "
                              "the checkpoint is incomplete or damaged: resume from another one")
    check_tiles(path, knobs)
    if step >= cfg.run.steps:
        raise ConfigError(f"checkpoint {path} is at step {step} and run.steps={cfg.run.steps}: nothing left "
                          "to train; raise run.steps to continue")
    for key in ("data", "optimizer_steps", "rng"):
        if not isinstance(state.get(key), dict):
            raise CheckpointError(f"{path / STATE_FILE} has no valid {key!r}; it was not written by "
                                  "`megatrain train`, or it is damaged")
    try:
        data.train.load_state_dict(state["data"])  # same data and packing? (DataError if not)
    except DataError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / STATE_FILE}: the data cursor is damaged ({type(e).__name__}: {e})") from None
    return {"path": path, "step": step, "state": state}


def check_tiles(path: Path, knobs) -> None:
    """The dtypes of the checkpoint's tiles (headers only) against the store this run allocates: fp32 master, Adam
    moments in schedule.state_dtype. A difference is refused here, naming the setting, not at the load after the
    store was allocated (the weights and wires are streamed from the fp32 master, so they may change)."""
    moments = TORCH_DTYPES[knobs.state_dtype]
    want = {"master": torch.float32, "adam_m": moments, "adam_v": moments}
    if is_sharded(path):  # every rank file holds "<kind>/<unit>" tensors
        headers = [stio.read_header(f)[0] for f in sorted(path.glob("rank*.safetensors"))]
        dtypes = {name.split("/", 1)[0]: info.dtype for h in headers for name, info in h.items()}
    else:
        dtypes = {}
        for kind in want:
            infos = stio.read_header(path / f"{kind}.safetensors")[0]
            dtypes[kind] = next(iter(infos.values())).dtype if infos else want[kind]
    if dtypes.get("master", torch.float32) != torch.float32:
        raise CheckpointError(f"checkpoint {path} holds its master weights in {dtypes['master']}, not fp32; it was "
                              "not written by `megatrain train`, or it is damaged: resume from another checkpoint")
    if is_sharded(path):  # a sharded checkpoint stores every rank's moments in fp32 whatever the store's dtype
        return            # (io/sharded_checkpoint.py converts on write and on load), so it resumes either way
    for kind in ("adam_m", "adam_v"):
        if dtypes.get(kind, moments) != moments:
            saved = _DTYPE_NAMES.get(dtypes[kind], str(dtypes[kind]))
            raise ConfigError(f"checkpoint {path} holds the Adam moments in {saved}; this run has "
                              f"schedule.state_dtype={knobs.state_dtype!r}, and a resume cannot change the moments' "
                              f"dtype: resume with --set schedule.state_dtype={saved}")


def restore(trainer, resume: dict, cfg,
            log: Callable[[str], None]) -> tuple[Path, int, int]:
    """Read the checkpoint `resume_state` checked into the trainer's store; (path, step, tokens seen). A learning
    rate that differs from the checkpoint's run at this step is stated (`lr.lr_change_note`)."""

    store, t0 = trainer.store, time.perf_counter()
    # Either format into a one-process store or this rank's slices (verified already by resume_state).
    path, state = resume["path"], resume["state"]
    step = load_store(path, store, trainer.world)
    try:
        store.steps = {key_unit(k): int(n) for k, n in state["optimizer_steps"].items()}
        set_rng_state(state["rng"])
        tokens = int(state.get("tokens_seen", 0))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / STATE_FILE} is damaged ({type(e).__name__}: {e})") from None
    trainer.step_count = step
    log(f"resumed from {path} at step {step} ({time.perf_counter() - t0:.2f} s)")
    note = lr_change_note(state.get("config"), cfg, step)
    if note:
        log(note)
    return path, step, tokens


def branch_off(manager: CheckpointManager, resume: dict, cfg, run_dir: Path, log: Callable[[str], None]) -> None:
    """After a restore, in the run directory's owner: say when the schedule changed, and move the checkpoints and
    metrics newer than the resumed step aside (a resume from an older checkpoint starts a new branch)."""

    if resume["state"].get("schedule") != cfg.schedule.name:
        log(f"note: resuming a run of schedule {resume['state'].get('schedule')!r} with {cfg.schedule.name!r} (the "
            "schedule changes speed, not results)")
    aside = set_aside_newer(manager.checkpoints(), resume["step"], run_dir / "metrics.jsonl")
    if aside is not None:
        log(f"note: resuming from step {resume['step']} starts a new branch: the newer checkpoints of the "
            f"abandoned one (and their metrics) were moved to {aside}")
