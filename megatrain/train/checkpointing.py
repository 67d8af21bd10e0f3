"""The checkpoints of a running session: saving with one retry, and the errors that end a run.

A checkpoint that cannot be written (disk full, permissions) is retried once after deleting all but the newest
complete checkpoint (making room without ever losing the newest one); if that fails too, the run ends with a
TrainingError naming the newest complete checkpoint and how to resume. The previous checkpoints are never
touched by a failed save (`CheckpointManager.save` is atomic).

One process writes the one-process format (`checkpoint.py`); the ranks of a data-parallel run write one sharded
checkpoint together (`dist/checkpoint.py`: each rank its slices, rank 0 the manifest and the state file, then
prunes); a failed sharded save ends the run without the retry (the ranks would have to agree on it).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megatrain.io.checkpoint import CheckpointManager, rng_state, unit_key
from megatrain.io.errors import CheckpointError
from megatrain.train.errors import DivergedError, TrainingError
from megatrain.io.sharded_checkpoint import save_sharded


class SessionCheckpoints:
    """The newest checkpoint of this session (`last`, at step `step`) and how to write the next one."""

    def __init__(self, manager: CheckpointManager, log: Callable[[str], None], world=None):
        self.manager, self.log = manager, log
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
            if self.world.rank == 0:
                self.manager.prune()
        except (CheckpointError, OSError) as e:
            raise self.stopped(done_steps, f"checkpoint step {step} was not saved: {e}") from e
        self.last, self.step = path, step
        return path

    def save(self, step: int, tiles: dict, state: dict, units: list[int], done_steps: int) -> Path:
        """Write checkpoint `step` (see the module docstring); TrainingError when it cannot be written."""
        try:
            path = self.manager.save(step, tiles, state, units=units)
        except CheckpointError as first:
            if len(self.manager.checkpoints()) < 2:
                raise self.stopped(done_steps, str(first)) from first
            self.log(f"{first}; retrying after deleting all but the newest checkpoint")
            self.manager.prune(keep_last=1)
            try:
                path = self.manager.save(step, tiles, state, units=units)
            except CheckpointError as second:
                raise self.stopped(done_steps, str(second)) from second
        self.last, self.step = path, step
        return path

    def stopped(self, done_steps: int, what: str) -> TrainingError:
        """The error that ends the run after a failure: what happened, the newest checkpoint, how to resume."""
        newest = self.manager.latest()
        if newest is None:
            where = "There is no checkpoint of this run; fix the cause and start it again from the beginning"
        else:
            where = (f"The newest complete checkpoint is {newest}: fix the cause and continue "
                     "with --resume (steps after it run again)")
        return TrainingError(f"the run stopped after step {done_steps}: {what}. {where}")

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
