"""`megatrain train` under torchrun: what each rank of a data-parallel run does differently.

Every rank runs the same loop (same data stream, same steps, same checks), so the collectives inside the steps
line up. Rank 0 logs and writes the run's outputs (run directory, metrics, timelines); the other ranks log nothing
and write their run directory into a temporary directory removed at exit. `data.batch_size` is per GPU: a step
trains on `world` x batch_size x grad_accum sequences, each rank on its contiguous rows.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import replace

from megatrain.train.config import ConfigError, RunConfig
from megatrain.parallel.world import World


def config_for_rank(cfg: RunConfig, world: World) -> RunConfig:
    """`cfg` as rank `world.rank` runs it; refuses what data-parallel runs do not support yet."""
    if not world.distributed:
        return cfg
    run = cfg.run
    if run.export_hf and not run.checkpoint_at_end:
        raise ConfigError(f"run.export_hf with {world.size} ranks exports the final checkpoint (rank 0 reads every "
                          "rank's slices): set run.checkpoint_at_end=true, or export later with `megatrain export`")
    if world.rank == 0:
        return cfg
    scratch = tempfile.mkdtemp(prefix=f"megatrain-rank{world.rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return replace(cfg, run=replace(run, out_dir=scratch, progress=False))


def join(cfg: RunConfig, backend: str, log, trackers: tuple) -> tuple[World, RunConfig, object, tuple]:
    """This process's place in a torchrun launch (WORLD_SIZE > 1; else a world of one): the process group joined
    and the rank pinned to its own cores (before the trainer sizes its threads), `cfg` for this rank, and its log
    sink and trackers (rank 0's are the caller's; the other ranks are silent). Returns (world, cfg, log, trackers)."""
    world = World.from_env(backend, cfg.run.wait_timeout_s)
    cfg = config_for_rank(cfg, world)
    if world.rank != 0:
        log, trackers = silent, ()
    return world, cfg, log, trackers


def silent(line: str) -> None:
    """The log sink of ranks other than 0."""

