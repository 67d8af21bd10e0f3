"""The "sharded" collective strategy, whole: each rank owns a slice of every unit; all-gathers fill the GPU slots,
reduce-scatters sum the gradients, every rank updates its slices on its host.

This module lists the strategy's parts and registers each with the floor that uses it (those floors never import
parallel/; `import megatrain.parallel` imports this module). It loads no torch: the executor's parts are imported
when a rank first needs them, so `megatrain plan` / `simulate --gpus N` stay torch-free.

    part                     implementation                                       registered with
    rules (what N ranks      compile/resolve.py check_parallelism,                (the resolver: one place for
      and hosts support)       check_model_shards, check_run_for_ranks              every strategy so far)
    lowering passes          compile/collectives.py add_collectives               compile/strategies.py
    comm queue order         compile/collectives.py gathers_before_reductions     compile/strategies.py
    per-rank host plan       compile/collectives.py sharded_host_plan             compile/strategies.py
    sim costs                sim/collectives.py rank_share (and collective_s,     sim/collectives.py
                               which the cost model charges G / Z tasks by kind)
    task bodies (P G Z O)    parallel/work.py ShardedCopies                       exec/strategies.py
    host store (slicing)     parallel/shard.py ShardedHostStore                   exec/strategies.py
    checkpoint cut           the store's `shard(unit)` range, read and written    (io/ sits above parallel/: it
                               by io/sharded_checkpoint.py, io/sharded_hf_load.py   reads the cut from the store)
"""
from __future__ import annotations

from megatrain.compile.collectives import add_collectives, gathers_before_reductions, sharded_host_plan
from megatrain.compile.strategies import CompileStrategy, register_strategy
from megatrain.exec.strategies import register_host_store, register_parallel_handlers
from megatrain.ir.placement import DEFAULT_STRATEGY
from megatrain.sim.collectives import rank_share, register_rank_profile

NAME = DEFAULT_STRATEGY  # "sharded"


def _handlers(work, world) -> dict:
    """The bodies the sharded strategy substitutes in a StepWork: P of the slice, G, Z, and O of the slice."""
    from megatrain.parallel.work import ShardedCopies  # torch: loaded when a rank runs, not when the CLI registers

    d = ShardedCopies(world, work.store, work.buffers, work.updates, work.backend)
    return {"P": d.prefetch, "G": d.gather, "Z": d.reduce_scatter, "O": d.offload}


def _host_store(spec, layout, world, backend=None, tiles=None):
    """This rank's slices of the host store (parallel/shard.py)."""
    from megatrain.parallel.shard import ShardedHostStore  # torch: loaded when a rank runs, not by the CLI

    return ShardedHostStore(spec, layout, world, backend, tiles)


register_strategy(CompileStrategy(NAME, passes=(add_collectives,), order_comm=gathers_before_reductions,
                                  host_plan=sharded_host_plan))
register_rank_profile(NAME, rank_share)
register_parallel_handlers(NAME, _handlers, kinds="PGZO")
register_host_store(NAME, _host_store)
