"""`megatrain train` under torchrun: what each rank of a data-parallel run does differently.

Every rank runs the same loop (same data stream, same steps, same checks), so the collectives inside the steps
line up. Rank 0 logs and writes the run's outputs (run directory, metrics, timelines); the other ranks log nothing
and write their run directory into a temporary directory removed at exit. `data.batch_size` is per GPU: a step
trains on `world` x batch_size x grad_accum sequences, each rank on its contiguous rows.

Several nodes (`torchrun --nnodes N --rdzv-backend c10d ...`) run the same way: the World knows each rank's node
(parallel/world.py), the Program is built for `world` ranks over `nodes` hosts, the memory check is each node's
(train/fit.py), and `join` logs one line of the launch: the ranks of each node and the cores each is bound to.

Before anything is allocated or written (`join`), the ranks refuse together, each with the same one line:
- a launch that is not one (parallel/world.py LaunchError: a stale WORLD_SIZE, more ranks than cores, ranks that
  never arrive), as a ConfigError;
- ranks given different run configurations (`check_same_config`): every key of the resolved RunConfig but the
  rank-local ones (RANK_LOCAL_KEYS) must be equal on every rank, else a rank would train with another learning rate,
  file or step count than its peers (the Program hash, compared later, does not see those);
- what a run of N ranks does not support (the resolver's rules: a tied-embedding model, an export without the final
  checkpoint).
"""
from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from dataclasses import replace

from megatrain.compile.resolve import check_model_shards, check_run_for_ranks
from megatrain.ir.dag import ScheduleError
from megatrain.train.config import ConfigError, RunConfig
from megatrain.parallel.world import BIND_ENV, LaunchError, World
from megatrain.units import format_bytes

# Keys of the RunConfig a rank may hold on its own: they change what it shows, not what it trains. Every other key
# must be equal on every rank (the rank itself, its device and its scratch directory come from the environment,
# not from the config).
RANK_LOCAL_KEYS = frozenset({"run.progress"})
MAX_KEYS_SHOWN = 8  # differing keys named in the refusal; the rest are counted


def config_for_rank(cfg: RunConfig, world: World) -> RunConfig:
    """`cfg` as rank `world.rank` runs it; refuses what data-parallel runs do not support yet."""
    if not world.distributed:
        return cfg
    run = cfg.run
    try:  # what a run of world.size ranks supports is decided by the resolver's module
        check_run_for_ranks(world.size, export_hf=run.export_hf, checkpoint_at_end=run.checkpoint_at_end)
        check_model_shards(cfg.model.spec())
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
    try:
        world = World.from_env(backend, cfg.run.wait_timeout_s)
    except LaunchError as e:  # not a failure of the run: the launch was not one (world.py); one line, exit 2
        raise ConfigError(str(e)) from None
    try:  # both refusals are the same on every rank (the configs agree before the second), so all leave together
        check_same_config(cfg, world)
        cfg = config_for_rank(cfg, world)
    except ConfigError:
        world.close()  # a rank leaving with live gloo threads can die in their destructors (SIGABRT, not exit 2)
        raise
    if world.rank != 0:
        log, trackers = silent, ()
    if world.distributed:
        line = launch_line(world, world.gather((world.node, list(world.cores))))  # every rank: one exchange
        (log or print)(line)  # no sink given: the run log prints, before its file exists
    return world, cfg, log, trackers


def launch_line(world: World, per_rank: list[tuple[int, list[int]]]) -> str:
    """One line: the ranks by node and the cores each is bound to (`per_rank`: every rank's (node, cores))."""
    by_node: dict[int, list[str]] = {}
    for rank, (node, cores) in enumerate(per_rank):
        by_node.setdefault(node, []).append(f"rank {rank} {core_ranges(cores) if cores else 'unbound'}")
    bound = any(cores for _, cores in per_rank)
    how = (f"each rank bound to its share of its node's cores, update threads sized to them; {BIND_ENV}=0 turns it "
           "off" if bound else f"ranks not bound to cores ({BIND_ENV}=0)")
    return (f"launch: {world.size} ranks on {world.nodes} node{'s' if world.nodes > 1 else ''} x {world.local_size}; "
            f"cores: {'; '.join(f'node {n}: ' + ', '.join(rs) for n, rs in sorted(by_node.items()))} ({how})")


def core_ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def node_store_line(world: World, store_bytes: int, planned_bytes: int) -> str | None:
    """The host store each node holds (the sum of its ranks' slices, reported by every rank) against the plan's, in
    one line; None for one process. Call it on every rank (one exchange)."""
    if not world.distributed:
        return None
    per_node: dict[int, int] = {}
    for node, nbytes in world.gather((world.node, store_bytes)):
        per_node[node] = per_node.get(node, 0) + nbytes
    planned = format_bytes(world.local_size * planned_bytes)
    return ("host store per node: " + ", ".join(f"node {n} {format_bytes(b)}" for n, b in sorted(per_node.items()))
            + f" ({world.local_size} ranks each, planned {planned}; bytes by node: "
            + ", ".join(f"{n}={b}" for n, b in sorted(per_node.items())) + ")")



def config_fields(cfg: RunConfig) -> dict[str, str]:
    """The resolved config as "section.key" -> JSON text of the value, the rank-local keys left out: what the
    ranks compare. [schedule] is every knob as resolved (the named schedule's and the ones set on top)."""
    out = {}
    sections = {**cfg.to_dict(), "schedule": {"name": cfg.schedule.name, **cfg.schedule.knobs().to_dict()}}
    for section, values in sections.items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in RANK_LOCAL_KEYS:
                out[name] = json.dumps(value, sort_keys=True, default=str)
    return out


def differing_keys(per_rank: list[dict[str, str]]) -> dict[str, dict[str, list[int]]]:
    """Keys whose values are not the same on every rank: key -> {value: [ranks holding it]}."""
    keys = sorted(set().union(*per_rank))
    out = {}
    for key in keys:
        holders: dict[str, list[int]] = {}
        for rank, fields in enumerate(per_rank):
            holders.setdefault(fields.get(key, "(unset)"), []).append(rank)
        if len(holders) > 1:
            out[key] = holders
    return out


def check_same_config(cfg: RunConfig, world: World) -> None:
    """Refuse, on every rank with the same message, unless every rank runs the same resolved config (all but
    RANK_LOCAL_KEYS). One exchange on the host (gloo) group, within the run's wait timeout; before the store is
    allocated or the run directory written."""
    if not world.distributed:
        return
    differ = differing_keys(world.gather(config_fields(cfg)))
    if not differ:
        return

    def ranks(rs: list[int]) -> str:
        return f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}"

    shown = [f"{key} ({'; '.join(f'{ranks(rs)}: {value}' for value, rs in holders.items())})"
             for key, holders in list(differ.items())[:MAX_KEYS_SHOWN]]
    more = f" and {len(differ) - MAX_KEYS_SHOWN} more" if len(differ) > MAX_KEYS_SHOWN else ""
    raise ConfigError(f"the {world.size} ranks were given different run configurations: {', '.join(shown)}{more}; "
                      "every rank must get the same config and options (launch them with one torchrun command "
                      "line); nothing was trained or written")


def silent(line: str) -> None:
    """The log sink of ranks other than 0."""

