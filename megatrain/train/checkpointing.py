"""The checkpoints of a running session: saving, and the errors that end a run.

A checkpoint that cannot be written (a disk that is full or turned read-only, permissions) ends the run with one
line (a TrainingError) naming the newest complete (verified) checkpoint and how to resume. A failed save deletes
nothing: not to make room (a file system that is full now may hold the user's only good copy), and retention runs
only after a new checkpoint was saved and verified (`CheckpointManager.save`, atomic). An old checkpoint that
cannot be pruned is kept, with a warning; the run goes on.

One process writes the one-process format (`io/checkpoint.py`); the ranks of a data-parallel run write one sharded
checkpoint together (`io/sharded_checkpoint.py`: each rank its slices, rank 0 the manifest and the state file, then
prunes); a failure on any rank is a failure on every rank.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megatrain.io.checkpoint import CheckpointManager, rng_state
from megatrain.io.checkpoint_format import newest_complete, unit_key
from megatrain.io.errors import CheckpointError
from megatrain.train.errors import DivergedError, TrainingError
from megatrain.io.sharded_checkpoint import save_sharded


class SessionCheckpoints:
    """The newest checkpoint of this session (`last`, at step `step`) and how to write the next one."""

    def __init__(self, manager: CheckpointManager, log: Callable[[str], None], world=None):
        self.manager, self.log = manager, log
        if manager.log is None:  # its notes (a damaged checkpoint skipped by resume "latest") go to the run's log
            manager.log = log
        self.world = world  # megatrain.parallel.world.World; None or one rank: the one-process format
        self.last: Path | None = None
        self.step: int | None = None

    def save_store(self, step: int, store, state: dict, done_steps: int) -> Path:
        """Write checkpoint `step` of a host store (every rank calls it); TrainingError when it cannot be written."""
        if self.world is None or not self.world.distributed:
            tiles = {"master": store.master, "adam_m": store.exp_avg, "adam_v": store.exp_avg_sq}
            return self.save(step, tiles, state, store.units, done_steps)

        try:
            path = save_sharded(self.manager.step_path(step), store, self.world, step, state)
        except CheckpointError as e:
            raise self.stopped(done_steps, f"checkpoint step {step} was not saved: {e}. Nothing was deleted") \
                from None
        if self.world.rank == 0:  # retention: only after the new checkpoint was written and verified
            try:
                self.manager.prune()
            except CheckpointError as e:
                self.log(f"warning: {e}")
        self.last, self.step = path, step
        return path

    def save(self, step: int, tiles: dict, state: dict, units: list[int], done_steps: int) -> Path:
        """Write checkpoint `step` (see the module docstring); TrainingError when it cannot be written."""
        try:
            path = self.manager.save(step, tiles, state, units=units)
        except CheckpointError as e:  # nothing deleted, nothing retried (the module docstring)
            raise self.stopped(done_steps, str(e)) from None
        self.last, self.step = path, step
        return path

    def stopped(self, done_steps: int, what: str) -> TrainingError:
        """The error that ends the run after a failure, one line: what happened, what was kept (the newest complete
        checkpoint), how to resume."""
        newest = newest_complete(self.manager.directory)
        if newest is None:
            where = "There is no complete checkpoint of this run; fix the cause and start it again from the beginning"
        else:
            where = (f"Every checkpoint was kept; the newest complete checkpoint is {newest}: fix the cause and continue "
                     "with --resume (steps after it run again)")
        return TrainingError(f"the run stopped after step {done_steps}: {what.rstrip('.')}. {where}")

    def diverged(self, step: int, consecutive: int, limit: int) -> DivergedError:
        """The error of a run whose last `consecutive` steps all skipped their update."""
        keep = (f"the last good checkpoint, {self.last} (step {self.step}), is kept; resume from it with a lower "
                f"learning rate (--resume {self.last} --lr ...)" if self.last else
                "there is no checkpoint of this run; start again with a lower optimizer.lr or with clipping "
                "(schedule.clip)")
        return DivergedError(f"the run diverged: the updates of the last {consecutive} steps (to step {step}) were "
                             f"skipped for non-finite gradients (run.max_skipped_steps={limit}); stopped without "
                             f"writing a checkpoint: {keep}")


def trainer_state(store, data, spec, cfg, tokens_seen: int) -> dict:
    """What a checkpoint holds besides the tiles: RNG states, data cursor, AdamW step counts, tokens seen, the model,
    the schedule and the config (JSON)."""
    return {"rng": rng_state(), "data": data.train.state_dict(),
            "optimizer_steps": {unit_key(u): n for u, n in store.steps.items()}, "tokens_seen": tokens_seen,
            "spec": spec.to_dict(), "schedule": cfg.schedule.name, "config": cfg.to_dict()}
