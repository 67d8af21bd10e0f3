"""Does a run fit this machine? The planner's host and GPU bytes against what the machine has, checked before
anything is allocated, with the knobs that help when it does not.

The host figure is the limit the process actually has (plan/machine.py: MemAvailable, the container's cgroup
limit, the ulimits). Under torchrun the LOCAL_WORLD_SIZE ranks of a node share the host's memory: the check
compares the sum of their needs (each rank's plan: its slices of the store, its own runtime and, on the CPU backend,
its device buffers) with what the node has, so the ranks refuse together instead of the kernel killing one of them
half-way through allocating.
"""
from __future__ import annotations

import megatrain.parallel  # noqa: F401  (registers the collective strategies' slicing rules: rank_host_plan)
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.compile.resolve import resolve
from megatrain.compile.strategies import rank_host_plan
from megatrain.ir.dag import ScheduleError
from megatrain.ir.placement import Parallelism
from megatrain.parallel.world import launch_shape
from megatrain.plan.machine import gpu_memory, host_memory, process_rss_bytes
from megatrain.plan.memory import MemoryPlan, plan_gpu_memory
from megatrain.units import GiB
from megatrain.compile.advice import (alternative_plans, fit_report, gpu_alternatives, host_alternatives, plan_memory,
                                      refuse_planned_only)
from megatrain.model.spec import ModelSpec
from megatrain.train.config import ConfigError


class MemoryFitError(ConfigError):
    """The run does not fit this machine's host or GPU memory; the message has the numbers and the knobs."""



# ---- memory check ----------------------------------------------------------------------------------------------
def node_ranks() -> int:
    """The ranks torchrun starts on this node (LOCAL_WORLD_SIZE), which share its host memory; 1 outside torchrun."""
    return launch_nodes()[0]


def launch_nodes() -> tuple[int, int, int]:
    """(ranks on this node, this node, nodes) of the torchrun launch (GROUP_RANK, WORLD_SIZE / LOCAL_WORLD_SIZE);
    (1, 0, 1) outside torchrun."""
    shape = launch_shape()
    return (1, 0, 1) if shape is None else (shape[3], shape[4], shape[5])


def machine_capacity(backend: str) -> tuple[int, int | None]:
    """(host bytes this process can use, free GPU bytes or None on the CPU backend). Host: the machine's usable
    memory (megatrain/plan/machine.py: MemAvailable, the container's cgroup limit and the ulimits, the tightest)
    plus what this process already holds (the planner counts the runtime's own footprint)."""
    return node_capacity(backend, 1)


def node_capacity(backend: str, ranks: int) -> tuple[int, int | None]:
    """machine_capacity for `ranks` processes like this one sharing the host (the ranks of a node): MemAvailable and
    the container's limit once, each process's ulimits `ranks` times, plus what they all hold (every rank holds
    about what this one does). The GPU figure is this process's own device."""
    host = _host_limit(ranks).usable_bytes
    gpu = (gpu_memory() or (None, None))[0] if backend == "cuda" else None
    return host, gpu


def _host_limit(ranks: int):
    return host_memory(held_bytes=ranks * process_rss_bytes(), processes=ranks)


def _host_bound_note(ranks: int) -> str:
    """", or where a limit other than the machine's available memory bounds the host figure: which one."""
    mem = _host_limit(ranks)
    return "" if mem.bound_by == "available" else f"\n  host memory is bound by {mem.describe()}"


def rank_plan(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str,
              ranks: int = 1, nodes: int = 1) -> MemoryPlan:
    """The memory of one rank of a data-parallel run over `ranks` ranks on each of `nodes` hosts (its slices of the
    store, 1/(ranks x nodes) of each unit, as `plan --gpus N --hosts H` counts them); the one-process plan for one
    rank. ScheduleError when the schedule or the model is not supported on that many ranks."""
    world = ranks * nodes
    if world <= 1:
        return plan_memory(spec, batch, seq, knobs, backend)
    p = resolve(spec, batch, seq, knobs, Parallelism(world, nodes))
    return MemoryPlan(p, rank_host_plan(p, backend), plan_gpu_memory(p), knobs)


TRAIN_ADVICE = ("set a knob with --set schedule.<knob>=<value>, lower data.batch_size / data.seq_len, or train "
                "fewer layers (model.num_layers); `megatrain plan` shows the full table")


def check_memory(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str,
                 host_bytes: int | None = None, gpu_bytes: int | None = None, *, what: str = "the run",
                 advice: str = TRAIN_ADVICE, reserve_host_bytes: int = 0,
                 ranks: int | None = None, node: tuple[int, int] | None = None) -> tuple[MemoryPlan, list[str]]:
    """Plan the run's memory and check it against this machine (or the given capacities).

    Returns (plan, report lines); raises MemoryFitError, with the numbers and the knobs that help, when it does
    not fit. On the CPU backend the "GPU" buffers and activations live in host memory, so they count there.
    `what` names the work in the message ("the run", "compare's variant overlap"); `advice` is its last line, in
    the words of the command that checks (config keys for `train`, options for `compare` and `profile`).
    `reserve_host_bytes`: host memory the command holds besides the run, taken off this machine's figure.
    `ranks`: the data-parallel ranks of this node, each checking the same run (None: `node_ranks()`, torchrun's
    LOCAL_WORLD_SIZE); the returned plan is one rank's, and the host check is their sum against the node's memory
    (`host_bytes`, when given, is the node's). The GPU check is one rank's against its own device.
    `node`: (this node, nodes) of a launch over several hosts (None: torchrun's GROUP_RANK and WORLD_SIZE /
    LOCAL_WORLD_SIZE): each rank holds 1/(ranks x nodes) of the store, each node checks its own ranks against its own
    memory, and the refusal names the node.
    Every caller runs the work it checks, so a planned-only layout (the NVMe tier) is refused here, before the
    store would refuse it, and no advice below names one.
    """
    try:
        refuse_planned_only(knobs)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    launched = launch_nodes()
    ranks = launched[0] if ranks is None else ranks
    node_id, nodes = launched[1:] if node is None else node
    world = ranks * nodes
    plan = rank_plan(spec, batch, seq, knobs, backend, ranks, nodes)
    measured_host = host_bytes is None
    have_host, have_gpu = machine_capacity(backend) if ranks == 1 else node_capacity(backend, ranks)
    host_bytes = max(0, have_host - reserve_host_bytes) if host_bytes is None else host_bytes
    gpu_bytes = have_gpu if gpu_bytes is None else gpu_bytes
    if world > 1:
        ok, lines = _node_fit(plan, host_bytes, gpu_bytes, ranks, backend, nodes)
    elif backend == "cpu":
        ok, lines = _cpu_fit(plan, host_bytes)
    else:
        ok, lines = fit_report(plan, host_bytes, gpu_bytes)
    if not ok:
        if world == 1:
            where = "this machine"
        elif nodes == 1:
            where = f"this node ({ranks} ranks)"
        else:
            where = f"node {node_id} of {nodes} ({ranks} ranks, {plan.placement.world} in all)"
        raise MemoryFitError(
            f"{what} does not fit {where} ({spec.name}, {spec.num_params / 1e9:.3f} B parameters, batch "
            f"{batch} x seq {seq}{' per rank' if world > 1 else ''}, {backend} backend):\n  " + "\n  ".join(lines)
            + (_host_bound_note(ranks) if measured_host else "") + "\n  " + advice)
    return plan, lines


def _host_need(plan: MemoryPlan, backend: str) -> int:
    """Host bytes of one process of `plan`: on the CPU backend the device working set is host memory too."""
    return plan.host.total_bytes + (plan.gpu.peak_bytes if backend == "cpu" else 0)


def _node_fit(plan: MemoryPlan, have: int, gpu: int | None, ranks: int, backend: str,
              nodes: int = 1) -> tuple[bool, list[str]]:
    """fit_report for the `ranks` ranks of one node: the host check is the sum of their needs (each `plan`, one
    rank's) against the node's `have`; the GPU check is one rank's against its own device."""
    need = _host_need(plan, backend)
    total = ranks * need
    what = (f"{total / GiB:.1f} GiB, the sum of {ranks} ranks of {need / GiB:.2f} GiB each"
            + (" (device buffers and activations included: host memory on the CPU backend)" if backend == "cpu"
               else ""))
    ok = total <= have
    if ok:
        lines = [f"host: fits: this node needs {what} of {have / GiB:.1f} GiB ({100 * total / max(have, 1):.0f}%)"]
    else:
        lines = [f"host: DOES NOT FIT: this node needs {what}, has {have / GiB:.1f} GiB, short by "
                 f"{(total - have) / GiB:.1f} GiB"]
        alts = host_alternatives(plan.knobs) + (gpu_alternatives(plan) if backend == "cpu" else [])
        for label, alt_knobs in alts:
            try:
                alt = ranks * _host_need(rank_plan(plan.spec, plan.batch, plan.seq, alt_knobs, backend, ranks,
                                                   nodes), backend)
            except ScheduleError:
                continue
            lines.append(f"  - {label}: {alt / GiB:.1f} GiB ({'fits' if alt <= have else 'still short'})")
        if nodes == 1:
            lines.append(f"  - fewer ranks on this node (torchrun --nproc_per_node): {ranks - 1} need about "
                         f"{(ranks - 1) * need / GiB:.1f} GiB")
        else:  # each rank's share of the store is 1/(ranks x nodes): another node shrinks every node's part
            more = ranks * _host_need(rank_plan(plan.spec, plan.batch, plan.seq, plan.knobs, backend, ranks,
                                                nodes + 1), backend)
            lines.append(f"  - more nodes (torchrun --nnodes {nodes + 1}): each node then needs about "
                         f"{more / GiB:.1f} GiB")
    if backend == "cuda":
        peak = plan.gpu.peak_bytes
        if gpu is None:
            lines.append(f"GPU: needs {peak / GiB:.1f} GiB per rank (capacity not given, not checked)")
        elif peak <= gpu:
            lines.append(f"GPU: fits: needs {peak / GiB:.1f} GiB per rank of {gpu / GiB:.1f} GiB")
        else:
            ok = False
            lines.append(f"GPU: DOES NOT FIT: needs {peak / GiB:.1f} GiB per rank, has {gpu / GiB:.1f} GiB, short by "
                         f"{(peak - gpu) / GiB:.1f} GiB")
    return ok, lines


def _cpu_fit(plan: MemoryPlan, have: int) -> tuple[bool, list[str]]:
    """fit_report for the CPU backend, where the device working set (buffers, activations) is host memory too."""
    def need(p: MemoryPlan) -> int:
        return p.host.total_bytes + p.gpu.peak_bytes

    total = need(plan)
    what = (f"{total / GiB:.1f} GiB (store and runtime {plan.host.total_bytes / GiB:.1f} + device buffers and "
            f"activations {plan.gpu.peak_bytes / GiB:.1f}, host memory on the CPU backend)")
    if total <= have:
        return True, [f"host: fits: needs {what} of {have / GiB:.1f} GiB ({100 * total / have:.0f}%)"]
    lines = [f"host: DOES NOT FIT: needs {what}, has {have / GiB:.1f} GiB, short by {(total - have) / GiB:.1f} GiB"]
    for label, alt_plan in alternative_plans(plan, host_alternatives(plan.knobs) + gpu_alternatives(plan), "cpu"):
        alt = need(alt_plan)
        lines.append(f"  - {label}: {alt / GiB:.1f} GiB ({'fits' if alt <= have else 'still short'})")
    return False, lines


def check_fits(spec, batch: int, seq: int, knobs, device: str, what: str, advice: str,
               reserve_host_bytes: int = 0) -> None:
    """The planner's memory for `what` against this machine, before anything is allocated (as `train` does):
    MemoryFitError (one message with the numbers and `advice`) when it does not fit. `reserve_host_bytes`: host
    memory the command holds besides the run (compare's shared initial weights, profile's copy buffers)."""
    backend = "cuda" if device.startswith("cuda") else "cpu"
    # ranks=1: compare, profile and the auto re-check run one process's work, not a data-parallel run's rank
    check_memory(spec, batch, seq, knobs, backend, what=what, advice=advice, reserve_host_bytes=reserve_host_bytes,
                 ranks=1)
