"""How much memory this machine lets a run use: the one answer `plan`, `train`, `profile` and `--schedule auto` read.

The host figure is the tightest of what bounds this process:

    MemAvailable    what the kernel says a new allocation can take without swapping (psutil)
    the container   cgroup v2 `memory.max - memory.current`, or v1 `memory.limit_in_bytes - memory.usage_in_bytes`,
                    at this process's cgroup and every cgroup above it (a container's limit usually sits one or
                    two levels up); page cache the kernel can drop (`inactive_file`) counts as free, as `docker
                    stats` counts it
    ulimit          `ulimit -v` (RLIMIT_AS, the address space) and `ulimit -d` (RLIMIT_DATA) of this process

A machine with 2 TiB of RAM in a 3 GiB container has 3 GiB: psutil alone reports the 2 TiB, and a plan that trusts
it is killed by the OOM killer instead of refused with the knobs that help.

`held_bytes` is memory this process already holds and the run may count as its own (the planner counts the
runtime's footprint, so `train` passes its resident set): it is added back to MemAvailable and to the container's
headroom, never to a ulimit, which caps the whole process.

The GPU figure (`gpu_memory`) is CUDA's free and total bytes of one device. It imports torch inside the function:
this module is read by the torch-free CLI commands (`plan`, `simulate`), and importing torch costs seconds.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import psutil
from megatrain.units import GiB

CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the cgroup filesystems are mounted (tests point it elsewhere)
PROC_CGROUP = Path("/proc/self/cgroup")  # which cgroup this process is in


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes a run may use and what bound them.

    bound_by: "available" (MemAvailable), "container" (a cgroup limit), "ulimit -v" or "ulimit -d".
    limit_bytes: the limit itself (the container's or the ulimit's; the machine's total for "available")."""

    usable_bytes: int
    bound_by: str
    limit_bytes: int
    processes: int = 1  # a per-process limit (ulimit) bounding this many processes' sum

    def describe(self) -> str:
        """What bound the figure, in words: "the container's limit of 3.0 GiB"."""
        lim = f"{self.limit_bytes / GiB:.1f} GiB"
        each = f"{self.processes} x " if self.processes > 1 else ""
        return each + {"available": f"the memory available on this machine ({lim} total)",
                "container": f"the container's limit of {lim}",
                "ulimit -v": f"the process's address-space limit (ulimit -v) of {lim}",
                "ulimit -d": f"the process's data-segment limit (ulimit -d) of {lim}"}[self.bound_by]


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None when it is missing, unreadable or "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(directory: Path, key: str) -> int:
    """Page cache the kernel can drop before it would hit the cgroup's limit (memory.stat's `key`)."""
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per hierarchy: {"": "/a/b"} for v2, {"memory": "/a/b"} for v1."""
    out = {}
    try:
        for line in PROC_CGROUP.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _dirs_up(mount: Path, cgroup: str) -> list[Path]:
    """The cgroup's directory under `mount` and every one above it up to the mount (those that exist)."""
    parts = [p for p in cgroup.strip("/").split("/") if p]
    dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def container_headroom() -> tuple[int, int] | None:
    """(limit, bytes free under it) of the tightest cgroup memory limit over this process, None without one.

    cgroup v2 (unified, memory.max / memory.current) first, then v1 (memory/memory.limit_in_bytes /
    memory.usage_in_bytes). v1 writes "no limit" as a huge number (2^63 rounded to pages): a limit above the
    machine's total memory is no limit."""
    own = _own_cgroups()
    total = psutil.virtual_memory().total
    candidates = []  # (free, limit): the tightest is the one with the least free
    for mount, cgroup, limit_file, usage_file, stat_key in (
            (CGROUP_ROOT, own.get("", "/"), "memory.max", "memory.current", "inactive_file"),
            (CGROUP_ROOT / "unified", own.get("", "/"), "memory.max", "memory.current", "inactive_file"),
            (CGROUP_ROOT / "memory", own.get("memory", "/"), "memory.limit_in_bytes", "memory.usage_in_bytes",
             "total_inactive_file")):
        for d in _dirs_up(mount, cgroup):
            limit, usage = _read_int(d / limit_file), _read_int(d / usage_file)
            if limit is None or limit >= total:
                continue
            used = max(0, (usage or 0) - _inactive_file(d, stat_key))
            candidates.append((max(0, limit - used), limit))
    if not candidates:
        return None
    free, limit = min(candidates)
    return limit, free


def host_memory(held_bytes: int = 0, processes: int = 1) -> MemoryLimit:
    """Host bytes a run in this process may use: the tightest of MemAvailable, the container's cgroup limit and the
    process's ulimits (see the module docstring); `held_bytes` of this process's own memory count as usable.

    `processes`: the figure for that many processes like this one together (the ranks of a data-parallel run on
    one node): MemAvailable and the container are shared, each process has its own ulimits (so `processes` times
    them bound the sum); `held_bytes` is then what they all hold."""
    vm = psutil.virtual_memory()
    bounds = [(vm.available + held_bytes, "available", vm.total)]
    box = container_headroom()
    if box is not None:
        limit, free = box
        bounds.append((free + held_bytes, "container", limit))
    for which, name in ((resource.RLIMIT_AS, "ulimit -v"), (resource.RLIMIT_DATA, "ulimit -d")):
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY and soft >= 0:
            bounds.append((processes * soft, name, soft))
    usable, bound_by, limit = min(bounds, key=lambda b: b[0])
    return MemoryLimit(int(usable), bound_by, int(limit), processes if bound_by.startswith("ulimit") else 1)


def process_rss_bytes() -> int:
    """This process's resident set: the `held_bytes` a run in this process counts as its own."""
    return psutil.Process().memory_info().rss


def gpu_memory(device: int | None = None) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device (the current one by default); None on a machine without a usable GPU.

    Torch is imported here, not at the top: `plan` and `simulate` read this module and stay torch-free on a
    machine without an NVIDIA driver, where importing torch would cost seconds for nothing."""
    if not Path("/proc/driver/nvidia").exists():
        return None
    try:
        import torch  # lazily: the CLI stays torch-free (see the docstring)
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info() if device is None else torch.cuda.mem_get_info(device)
    return int(free), int(total)
