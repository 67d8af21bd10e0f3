"""Which machine a profile measured, and whether it is the one running now (no torch import: `simulate` uses it).

A profile is a measurement of one machine on one day (issue 13: two machine starts of the same kind differed by
25% on the host side). `megatrain profile` records the machine in the profile (`HardwareProfile.machine`);
`train` and `simulate` compare it with this one and say in one line when they differ, and how to re-profile.
"""
from __future__ import annotations

import datetime
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from megatrain.units import GiB

COMPARED = ("cpu", "cores", "memory_gib", "gpu", "gpu_count", "torch")  # what makes two machines "the same"
_NVIDIA = Path("/proc/driver/nvidia/gpus")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    """GPU model names from the NVIDIA driver's /proc files (no CUDA context, no torch)."""
    names = []
    if _NVIDIA.is_dir():
        for d in sorted(_NVIDIA.iterdir()):
            try:
                text = (d / "information").read_text()
            except OSError:
                continue
            m = re.search(r"^Model:\s*(.+)$", text, re.M)
            names.append(m.group(1).strip() if m else "NVIDIA GPU")
    return names


def this_machine(device: str | None = None) -> dict:
    """CPU model, cores in this process's affinity set, total memory, GPU name and count, torch version, date."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        mem = 0.0
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    gpus = _gpus()
    info = {"host": platform.node(), "cpu": _cpu_model(), "cores": cores, "memory_gib": round(mem, 1),
            "gpu": gpus[0] if gpus else "none", "gpu_count": len(gpus), "torch": torch_version,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if device is not None:
        info["device"] = device
    return info


def describe(info: dict) -> str:
    """One phrase: "NVIDIA H200 x1, AMD EPYC 9454 (16 cores), 125.8 GiB, torch 2.11.0"."""
    gpu = f"{info.get('gpu')} x{info.get('gpu_count')}, " if info.get("gpu_count") else "no GPU, "
    return (f"{gpu}{info.get('cpu', '?')} ({info.get('cores', '?')} cores), {info.get('memory_gib', '?')} GiB, "
            f"torch {info.get('torch', '?')}")


def differences(recorded: dict, current: dict) -> list[str]:
    """The compared fields that differ, as "cores 16 -> 32" (memory within 3% counts as equal: the kernel's
    reservations move it a little between boots)."""
    out = []
    for key in COMPARED:
        a, b = recorded.get(key), current.get(key)
        if key == "memory_gib" and a and b and abs(a - b) <= 0.03 * max(a, b):
            continue
        if a != b:
            out.append(f"{key} {a} -> {b}")
    return out


def key(info: dict) -> str:
    """A file-name slug of the compared fields: profiles of this machine are cached under it."""
    parts = [info.get("gpu", "none"), f"x{info.get('gpu_count', 0)}", info.get("cpu", "cpu"),
             f"{info.get('cores')}c", f"{round(float(info.get('memory_gib') or 0))}g", f"torch{info.get('torch')}"]
    return re.sub(r"[^A-Za-z0-9.]+", "-", "-".join(str(p) for p in parts)).strip("-").lower()


def mismatch_line(profile, label: str, reprofile: str, use: str = "", current: dict | None = None) -> str | None:
    """One line when `profile` (a HardwareProfile) was not measured on this machine, None when it was.

    label: how the profile is named to the user; reprofile: the command that measures this machine; use: how to
    use the profile it writes."""
    current = current or this_machine()
    rec = getattr(profile, "machine", None) or {}
    if not rec:
        return (f"note: profile {label} does not record the machine it measured, so it cannot be checked against "
                f"this one ({describe(current)}); its predictions may be off here: `{reprofile}` measures this "
                f"machine{use}")
    diff = differences(rec, current)
    if not diff:
        return None
    return (f"note: profile {label} was measured on another machine ({describe(rec)}, {rec.get('date', '?')}; "
            f"{', '.join(diff)}); its predictions are for that machine: `{reprofile}` measures this one{use}")
