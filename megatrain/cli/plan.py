"""`megatrain plan`: host and GPU memory of a run, whether it fits, and which knob helps if not."""
from __future__ import annotations

from megatrain.cli.common import add_run_arguments, positive_float, positive_int
from megatrain.units import GiB
import textwrap


def machine_memory(host_gib: float | None = None, gpu_gib: float | None = None) -> tuple[int | None, int | None]:
    """(host bytes, GPU bytes) to check a plan against: the --host-gib / --gpu-gib given, else this machine's usable
    host memory (megatrain/plan/machine.py: cgroup and ulimit limits included, said in one line when one binds)
    and its GPU's total memory (None without CUDA)."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.plan.machine import gpu_memory, host_memory

    if host_gib:
        host = int(host_gib * GiB)
    else:
        mem = host_memory()
        host = mem.usable_bytes
        if mem.bound_by != "available":
            print(f"host memory: {host / GiB:.1f} GiB usable, bound by {mem.describe()}")
    gpu = int(gpu_gib * GiB) if gpu_gib else (gpu_memory() or (None, None))[1]
    return host, gpu


def knob_lines(knobs) -> list[str]:
    """The knobs by group (placement, step shape, numerics: megatrain/compile/knobs.py), one line each, wrapped."""

    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.compile.knobs import knobs_by_group

    lines = ["knobs:"]
    for group, values in knobs_by_group(knobs).items():
        text = ", ".join(f"{k}={'unset' if v is None else v}" for k, v in values.items())
        lines += textwrap.wrap(text, 116, initial_indent=f"  {group + ':':<12}", subsequent_indent=" " * 14)
    return lines


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory plan of a run: host and GPU bytes, fit, knobs that help")
    add_run_arguments(p, model="debug", batch=8, seq=2048)
    p.add_argument("--host-gib", type=positive_float, help="host memory to check against (default: this machine's)")
    p.add_argument("--gpu-gib", type=positive_float, help="GPU memory to check against (default: this machine's GPU)")
    p.add_argument("--gpus", type=positive_int, default=1, help="data parallel over this many GPUs of the host (--batch is "
                                                       "per GPU): per-rank and whole-host memory")
    p.add_argument("--hosts", type=positive_int, default=1, help="data parallel over this many hosts of --gpus GPUs each: "
                                                        "the fit is judged per host (--host-gib is one host's memory)")
    p.set_defaults(func=run)


def run(args) -> int:
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.compile.knobs import resolve_knobs
    from megatrain.plan.memory import format_plan
    from megatrain.compile.advice import fit_report, plan_memory
    from megatrain.model.presets import get_model

    spec = get_model(args.model)
    name, knobs = resolve_knobs(args.schedule, args.set)
    plan = plan_memory(spec, args.batch, args.seq, knobs)
    if args.gpus > 1 or args.hosts > 1:
        return _run_world(args, spec, name, knobs)
    host, gpu = machine_memory(args.host_gib, args.gpu_gib)
    print(f"schedule {name}, {spec.name}, batch {args.batch} x seq {args.seq}")
    print("\n".join(knob_lines(knobs)))
    print(plan.placement.describe())
    print()
    print(format_plan(plan))
    ok, lines = fit_report(plan, host, gpu, planned=True)  # plan shows the planned-only layouts, labelled
    print()
    print("\n".join(lines))
    return 0 if ok else 1


def _run_world(args, spec, name, knobs) -> int:
    """`plan --gpus N [--hosts H]`: one rank's host and GPU memory, the host's total over its N ranks (what must
    fit in one host's memory) and, over H hosts, the whole job's."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    import megatrain.parallel  # noqa: F401  (registers the collective strategies' slicing rules)
    from megatrain.compile.strategies import rank_host_plan
    from megatrain.ir.dag import ScheduleError
    from megatrain.plan.memory import plan_gpu_memory
    from megatrain.compile.resolve import resolve
    from megatrain.cli import UserError
    from megatrain.cli.simulate import parallelism_of

    try:
        p = resolve(spec, args.batch, args.seq, knobs, parallelism_of(args))
    except ScheduleError as e:
        raise UserError(str(e)) from None
    host_plan, gpu_plan = rank_host_plan(p), plan_gpu_memory(p)
    host, gpu = machine_memory(args.host_gib, args.gpu_gib)
    n, hosts = args.gpus, args.hosts
    where = f"{n} GPUs" + (f" per host x {hosts} hosts ({n * hosts} ranks)" if hosts > 1 else "")
    print(f"schedule {name}, data parallel over {where}, batch {args.batch} x seq {args.seq} per GPU")
    print("\n".join(knob_lines(knobs)))
    print(p.describe())
    print()
    print("host, one rank:")
    for k, v in host_plan.components.items():
        print(f"  {k:<24} {v / GiB:10.3f} GiB")
    print(f"  {'total':<24} {host_plan.total_bytes / GiB:10.3f} GiB (pinned {host_plan.pinned_bytes / GiB:.3f} GiB)")
    total = n * host_plan.total_bytes
    store = n * host_plan.store_bytes
    if hosts == 1:
        print(f"host, all {n} ranks: {total / GiB:.3f} GiB (store {store / GiB:.3f} GiB, "
              f"{store / spec.num_params:.1f} B/param; pinned {n * host_plan.pinned_bytes / GiB:.3f} GiB)")
    else:  # each host holds its ranks' slices: 1/hosts of the store
        print(f"host, each of {hosts} ({n} ranks): {total / GiB:.3f} GiB (store {store / GiB:.3f} GiB; pinned "
              f"{n * host_plan.pinned_bytes / GiB:.3f} GiB)")
        print(f"job, {hosts} hosts: {hosts * total / GiB:.3f} GiB (store {hosts * store / GiB:.3f} GiB, "
              f"{hosts * store / spec.num_params:.1f} B/param)")
    print(f"GPU, each: {gpu_plan.peak_bytes / GiB:.3f} GiB")
    ok = (host is None or total <= host) and (gpu is None or gpu_plan.peak_bytes <= gpu)
    print(f"fits: {'yes' if ok else 'NO'} ({'each ' if hosts > 1 else ''}host "
          f"{'?' if host is None else f'{host / GiB:.1f}'} GiB, GPU "
          f"{'?' if gpu is None else f'{gpu / GiB:.1f}'} GiB)")
    return 0 if ok else 1
