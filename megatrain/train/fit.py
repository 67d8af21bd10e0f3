"""Does a run fit this machine? The planner's host and GPU bytes against what the machine has, checked before
anything is allocated, with the knobs that help when it does not."""
from __future__ import annotations

from megatrain.compile.knobs import ScheduleKnobs
from megatrain.plan.machine import gpu_memory, host_memory, process_rss_bytes
from megatrain.plan.memory import GiB, MemoryPlan
from megatrain.compile.advice import alternative_plans, fit_report, gpu_alternatives, host_alternatives, plan_memory
from megatrain.model.spec import ModelSpec
from megatrain.train.config import ConfigError


class MemoryFitError(ConfigError):
    """The run does not fit this machine's host or GPU memory; the message has the numbers and the knobs."""



# ---- memory check ----------------------------------------------------------------------------------------------
def machine_capacity(backend: str) -> tuple[int, int | None]:
    """(host bytes this process can use, free GPU bytes or None on the CPU backend). Host: the machine's usable
    memory (megatrain/plan/machine.py: MemAvailable, the container's cgroup limit and the ulimits, the tightest)
    plus what this process already holds (the planner counts the runtime's own footprint)."""
    host = host_memory(held_bytes=process_rss_bytes()).usable_bytes
    gpu = (gpu_memory() or (None, None))[0] if backend == "cuda" else None
    return host, gpu


def _host_bound_note() -> str:
    """", or where a limit other than the machine's available memory bounds the host figure: which one."""
    mem = host_memory(held_bytes=process_rss_bytes())
    return "" if mem.bound_by == "available" else f"\n  host memory is bound by {mem.describe()}"


TRAIN_ADVICE = ("set a knob with --set schedule.<knob>=<value>, lower data.batch_size / data.seq_len, or train "
                "fewer layers (model.num_layers); `megatrain plan` shows the full table")


def check_memory(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str,
                 host_bytes: int | None = None, gpu_bytes: int | None = None, *, what: str = "the run",
                 advice: str = TRAIN_ADVICE, reserve_host_bytes: int = 0) -> tuple[MemoryPlan, list[str]]:
    """Plan the run's memory and check it against this machine (or the given capacities).

    Returns (plan, report lines); raises MemoryFitError, with the numbers and the knobs that help, when it does
    not fit. On the CPU backend the "GPU" buffers and activations live in host memory, so they count there.
    `what` names the work in the message ("the run", "compare's variant overlap"); `advice` is its last line, in
    the words of the command that checks (config keys for `train`, options for `compare` and `profile`).
    `reserve_host_bytes`: host memory the command holds besides the run, taken off this machine's figure.
    """
    plan = plan_memory(spec, batch, seq, knobs, backend)
    measured_host = host_bytes is None
    have_host, have_gpu = machine_capacity(backend)
    host_bytes = max(0, have_host - reserve_host_bytes) if host_bytes is None else host_bytes
    gpu_bytes = have_gpu if gpu_bytes is None else gpu_bytes
    if backend == "cpu":
        ok, lines = _cpu_fit(plan, host_bytes)
    else:
        ok, lines = fit_report(plan, host_bytes, gpu_bytes)
    if not ok:
        raise MemoryFitError(
            f"{what} does not fit this machine ({spec.name}, {spec.num_params / 1e9:.3f} B parameters, batch "
            f"{batch} x seq {seq}, {backend} backend):\n  " + "\n  ".join(lines)
            + (_host_bound_note() if measured_host else "") + "\n  " + advice)
    return plan, lines


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
    check_memory(spec, batch, seq, knobs, backend, what=what, advice=advice, reserve_host_bytes=reserve_host_bytes)
