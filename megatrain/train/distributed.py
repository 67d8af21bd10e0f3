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

from megatrain.compile.resolve import check_run_for_ranks
from megatrain.ir.dag import ScheduleError
from megatrain.train.config import ConfigError, RunConfig
from megatrain.parallel.world import World


def config_for_rank(cfg: RunConfig, world: World) -> RunConfig:
    """`cfg` as rank `world.rank` runs it; refuses what data-parallel runs do not support yet."""
    if not world.distributed:
        return cfg
    run = cfg.run
    try:  # what a run of world.size ranks supports is decided by the resolver's module
        check_run_for_ranks(world.size, export_hf=run.export_hf, checkpoint_at_end=run.checkpoint_at_end)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
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

