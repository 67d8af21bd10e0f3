"""A profile records the machine it measured; train and simulate say in one line when it is not this one."""
import os

from megatrain.cli import main
from megatrain.profiling.machine import differences, this_machine
from megatrain.sim import load_profile


def _with_machine(tmp_path, machine: dict):
    p = load_profile("cpu").with_(machine=machine)
    path = tmp_path / "p.json"
    p.save(path)
    return path


def test_this_machine_reads_the_system():
    m = this_machine()
    assert m["cores"] == len(os.sched_getaffinity(0))
    assert m["memory_gib"] == round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    with open("/proc/cpuinfo") as f:
        assert m["cpu"] in f.read()
    assert differences(m, dict(m)) == [] and differences(m, dict(m, memory_gib=m["memory_gib"] * 1.01)) == []
    assert differences(m, dict(m, cores=m["cores"] + 16)) == [f"cores {m['cores']} -> {m['cores'] + 16}"]


def test_simulate_says_when_the_profile_measured_another_machine(tmp_path, capsys):
    here = this_machine()
    args = ["simulate", "--model", "debug", "--batch", "2", "--seq", "16", "--no-plots", "--out", str(tmp_path / "s")]
    assert main([*args, "--profile", str(_with_machine(tmp_path, dict(here, cores=here["cores"] + 16)))]) == 0
    out = capsys.readouterr().out.splitlines()
    notes = [line for line in out if "measured on another machine" in line]
    assert len(notes) == 1 and f"cores {here['cores'] + 16} -> {here['cores']}" in notes[0]
    assert "megatrain profile --quick --model debug --batch 2 --seq 16" in notes[0]
    assert main([*args, "--profile", str(_with_machine(tmp_path, here))]) == 0
    assert "machine" not in capsys.readouterr().out  # the same machine: no line
    assert main([*args, "--profile", "cpu"]) == 0  # a shipped profile records no machine: said too
    assert "does not record the machine it measured" in capsys.readouterr().out


def test_train_says_when_the_profile_measured_another_machine(tmp_path, capsys):
    here = this_machine()
    path = _with_machine(tmp_path, dict(here, cpu="Some Other CPU"))
    assert main(["train", "--steps", "1", "--batch", "2", "--seq", "16", "--device", "cpu", "--no-progress",
                 "--out-dir", str(tmp_path / "runs"), "--set", f"run.profile={path}"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "measured on another machine" in line]
    assert len(notes) == 1 and "cpu Some Other CPU ->" in notes[0] and "megatrain profile --quick" in notes[0]
