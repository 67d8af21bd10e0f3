"""The machine's usable memory (megatrain/plan/machine.py): the container's cgroup limit and the process's ulimits
bound it, not only what the kernel says is available; fake cgroup files and a monkeypatched getrlimit stand in for a
container."""
import resource
from types import SimpleNamespace

import pytest

from megatrain.plan import machine

GiB = 2**30


@pytest.fixture
def big_machine(monkeypatch, tmp_path):
    """A 512 GiB machine with 400 GiB available, no cgroup files, no ulimits; returns the fake cgroup root."""
    monkeypatch.setattr(machine.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=512 * GiB, available=400 * GiB))
    monkeypatch.setattr(machine, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(machine, "PROC_CGROUP", tmp_path / "proc-self-cgroup")
    monkeypatch.setattr(machine.resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return tmp_path / "cgroup"


def _write(directory, **files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text + "\n")


def test_no_limit_gives_what_the_kernel_says_is_available(big_machine):
    m = machine.host_memory()
    assert (m.usable_bytes, m.bound_by) == (400 * GiB, "available")
    assert machine.host_memory(held_bytes=GiB).usable_bytes == 401 * GiB  # this process's own memory counts


def test_a_container_limit_on_a_big_machine_is_the_limit_less_its_usage(big_machine, tmp_path):
    (tmp_path / "proc-self-cgroup").write_text("0::/box\n")
    _write(big_machine / "box", **{"memory.max": str(3 * GiB), "memory.current": str(GiB // 2)})
    _write(big_machine, **{"memory.max": "max", "memory.current": str(100 * GiB)})  # the root: no limit
    m = machine.host_memory()
    assert (m.usable_bytes, m.bound_by, m.limit_bytes) == (3 * GiB - GiB // 2, "container", 3 * GiB)
    assert m.describe() == "the container's limit of 3.0 GiB"
    # Droppable page cache is free, and the memory this process holds is the run's own.
    _write(big_machine / "box", **{"memory.stat": f"anon 1\ninactive_file {GiB // 4}"})
    assert machine.host_memory(held_bytes=GiB // 4).usable_bytes == 3 * GiB


def test_a_limit_on_a_parent_cgroup_counts_and_cgroup_v1_is_read(big_machine, tmp_path):
    (tmp_path / "proc-self-cgroup").write_text("4:memory:/jobs/one\n0::/\n")
    v1 = big_machine / "memory"
    _write(v1, **{"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": str(50 * GiB)})
    _write(v1 / "jobs", **{"memory.limit_in_bytes": str(8 * GiB), "memory.usage_in_bytes": str(2 * GiB)})
    _write(v1 / "jobs" / "one", **{"memory.limit_in_bytes": "9223372036854771712",
                                   "memory.usage_in_bytes": str(GiB)})
    m = machine.host_memory()
    assert (m.usable_bytes, m.bound_by, m.limit_bytes) == (6 * GiB, "container", 8 * GiB)


def test_a_ulimit_smaller_than_both_wins(big_machine, tmp_path, monkeypatch):
    (tmp_path / "proc-self-cgroup").write_text("0::/\n")
    _write(big_machine, **{"memory.max": str(3 * GiB), "memory.current": "0"})
    limits = {resource.RLIMIT_AS: 2 * GiB, resource.RLIMIT_DATA: resource.RLIM_INFINITY}
    monkeypatch.setattr(machine.resource, "getrlimit", lambda which: (limits.get(which, resource.RLIM_INFINITY),) * 2)
    m = machine.host_memory(held_bytes=GiB)  # a ulimit caps the whole process: what it holds is not added
    assert (m.usable_bytes, m.bound_by) == (2 * GiB, "ulimit -v")
    assert "ulimit -v" in m.describe() and "2.0 GiB" in m.describe()
    limits[resource.RLIMIT_DATA] = GiB
    assert machine.host_memory().bound_by == "ulimit -d"


def test_this_machine_gives_a_positive_figure():
    m = machine.host_memory()
    assert m.usable_bytes > 0 and m.bound_by in ("available", "container", "ulimit -v", "ulimit -d")


def test_the_memory_check_says_which_limit_bound_the_host(monkeypatch):
    from megatrain.compile.knobs import knobs_for
    from megatrain.model.presets import PRESETS
    from megatrain.train import fit

    monkeypatch.setattr(fit, "host_memory", lambda held_bytes=0, processes=1: machine.MemoryLimit(2**20, "container", 3 * GiB))
    with pytest.raises(fit.MemoryFitError, match=r"(?s)host: DOES NOT FIT.*bound by the container's limit of 3.0 GiB"):
        fit.check_memory(PRESETS["debug"], 2, 16, knobs_for("overlap"), "cpu")


def test_one_budget_rule_for_auto(monkeypatch):
    from megatrain.tune import auto

    monkeypatch.setattr(auto, "host_memory", lambda held_bytes=0: machine.MemoryLimit(10 * GiB, "container", 12 * GiB))
    monkeypatch.setattr(auto, "gpu_memory", lambda: (20 * GiB, 80 * GiB))
    assert auto.auto_budget("cuda") == auto.AutoBudget(18 * GiB, 10 * GiB, "GPU free")  # free less 10%
    assert auto.auto_budget("cpu") == auto.AutoBudget(5 * GiB, 10 * GiB, "CPU backend")  # half the usable host
    assert auto.auto_budget("cuda", 16, with_host=False) == auto.AutoBudget(16 * GiB, None, "given")
    monkeypatch.setattr(auto, "gpu_memory", lambda: None)
    with pytest.raises(auto.BudgetError, match="--gpu-budget-gib"):
        auto.auto_budget("cuda")
