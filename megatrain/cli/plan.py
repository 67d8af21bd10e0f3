"""`megatrain plan`: host and GPU memory of a run, whether it fits, and which knob helps if not."""
from __future__ import annotations

from pathlib import Path

from .common import add_run_arguments


def machine_memory() -> tuple[int | None, int | None]:
    """(host bytes, GPU bytes) of this machine; GPU is None without CUDA."""
    import psutil

    host = psutil.virtual_memory().total
    gpu = None
    if Path("/proc/driver/nvidia").exists():  # importing torch costs seconds; only where a GPU can be
        try:
            import torch

            if torch.cuda.is_available():
                gpu = torch.cuda.get_device_properties(0).total_memory
        except ImportError:
            pass
    return host, gpu


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory plan of a run: host and GPU bytes, fit, knobs that help")
    add_run_arguments(p, model="debug", batch=8, seq=2048)
    p.add_argument("--host-gib", type=float, help="host memory to check against (default: this machine's)")
    p.add_argument("--gpu-gib", type=float, help="GPU memory to check against (default: this machine's GPU)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..ir.knobs import resolve_knobs
    from ..ir.memory import GiB, fit_report, format_plan, plan_memory
    from ..presets import get_model

    spec = get_model(args.model)
    name, knobs = resolve_knobs(args.schedule, args.set)
    plan = plan_memory(spec, args.batch, args.seq, knobs)
    host, gpu = machine_memory()
    host = int(args.host_gib * GiB) if args.host_gib else host
    gpu = int(args.gpu_gib * GiB) if args.gpu_gib else gpu
    print(f"schedule {name}")
    print(plan.placement.describe())
    print()
    print(format_plan(plan))
    ok, lines = fit_report(plan, host, gpu)
    print()
    print("\n".join(lines))
    return 0 if ok else 1
