"""One place for a machine's profile (profiling/store.py): the precedence flag > $MEGATRAIN_PROFILE > a resumed
run's calibrated profile > this machine's cache > the shipped default, the cache that `megatrain profile` writes
(merging compute tables), and the one `profile: ... (why)` line the commands print. CPU only, no measurement:
profiles are built from the shipped cpu one with a machine written in."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatrain.profiling.calibrate import Calibration
from megatrain.profiling.machine import key, this_machine
from megatrain.profiling.store import (CALIBRATED, ProfileChoice, cache_dir, cache_path, merge_tables,
                                       resolve_profile, save_measured)
from megatrain.sim.profile import ComputeTable, load_profile

HERE = {"host": "a", "cpu": "Test CPU", "cores": 4, "memory_gib": 32.0, "gpu": "none", "gpu_count": 0,
        "torch": "2.0", "date": "2026-01-01 00:00 UTC"}
ELSEWHERE = dict(HERE, cores=64)


def _table(model: str, seq: int, dur: float = 1e-3) -> ComputeTable:
    return ComputeTable(model, "F", "layer", seq, (32, 64), (dur, 2 * dur), dtype="fp32")


def _profile(machine: dict, *tables: ComputeTable, name="m"):
    return load_profile("cpu").with_(name=name, machine=dict(machine), compute_tables=tuple(tables))


def _write(path: Path, profile) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return path


def test_the_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    assert cache_path(HERE) == tmp_path / "c" / "profiles" / f"{key(HERE)}.json"
    monkeypatch.delenv("MEGATRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "megatrain"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "megatrain"


def test_no_test_touches_the_real_cache():
    """tests/conftest.py points every test at an empty temporary cache."""
    assert os.environ["MEGATRAIN_CACHE"] and Path.home() / ".cache" not in cache_dir().parents
    assert "MEGATRAIN_PROFILE" not in os.environ


def test_precedence_flag_env_run_cache_shipped(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "r1"
    _write(run / CALIBRATED, _profile(HERE, name="run-cal"))
    cached = _write(cache_path(HERE), _profile(HERE, name="cached"))
    monkeypatch.setenv("MEGATRAIN_PROFILE", "h200")

    def pick(**kw):
        return resolve_profile("cpu", run_dir=run, resumed=True, here=HERE, **kw)

    assert (pick(flag="my.json").source, pick(flag="my.json").profile) == ("flag", "my.json")
    assert pick(flag="my.json").reason.startswith("--profile")
    assert (pick().source, pick().profile) == ("env", "h200")
    monkeypatch.delenv("MEGATRAIN_PROFILE")
    assert (pick().source, pick().profile) == ("run", str(run / CALIBRATED))
    # not resumed: the run's calibrated profile is not this run's
    fresh = resolve_profile("cpu", run_dir=run, resumed=False, here=HERE)
    assert (fresh.source, fresh.profile) == ("cache", str(cached))
    (run / CALIBRATED).unlink()
    assert (pick().source, pick().profile) == ("cache", str(cached))
    cached.unlink()
    for backend, name in (("cpu", "cpu"), ("cuda", "h200-measured"), ("cuda:1", "h200-measured")):
        c = resolve_profile(backend, here=HERE)
        assert (c.source, c.profile) == ("shipped", name)
        assert "NOT this machine's" in c.reason and "megatrain profile" in c.reason


def test_a_profile_of_another_machine_is_never_used_silently(tmp_path):
    """A cached file (copied from elsewhere) or a run's calibrated profile that records another machine is skipped,
    and the reason of what is used says why."""
    cached = _write(cache_path(HERE), _profile(ELSEWHERE))
    c = resolve_profile("cpu", here=HERE)
    assert c.source == "shipped" and "another machine (cores 64 -> 4)" in c.reason and str(cached) in c.reason
    run = tmp_path / "r"
    _write(run / CALIBRATED, _profile(ELSEWHERE))
    c = resolve_profile("cpu", run_dir=run, resumed=True, here=HERE)
    assert c.source == "shipped" and "the run's calibrated profile" in c.reason
    cached.unlink()
    _write(cache_path(ELSEWHERE), _profile(ELSEWHERE))  # only another machine's profile in the cache
    c = resolve_profile("cpu", here=HERE)
    assert c.source == "shipped" and "profiles of other machines only" in c.reason and key(ELSEWHERE) in c.reason
    # one that records no machine cannot be checked: skipped too
    _write(cache_path(HERE), load_profile("cpu").with_(machine={}))
    c = resolve_profile("cpu", here=HERE)
    assert c.source == "shipped" and "records no machine" in c.reason


def test_the_line():
    c = ProfileChoice("cpu", "shipped default for cpu", "shipped")
    assert c.line() == "profile: cpu (shipped default for cpu)"


def test_profile_writes_the_cache_and_keeps_earlier_tables():
    here = this_machine("cpu")
    first = Calibration(_profile(here, _table("sig-a", 64), _table("sig-a", 128)), {"n": 1})
    path, raw = save_measured(first, here=here)
    assert path == cache_path(here) and raw.is_file()
    # a second measurement of another shape (and again sig-a at seq 64): sig-a@128 is kept, sig-a@64 replaced
    second = Calibration(_profile(here, _table("sig-b", 64), _table("sig-a", 64, dur=5e-3)), {"n": 2})
    lines = []
    save_measured(second, log=lines.append, here=here)
    got = {(t.model, t.seq): t for t in load_profile(path).compute_tables}
    assert set(got) == {("sig-a", 64), ("sig-a", 128), ("sig-b", 64)}
    assert got[("sig-a", 64)].dur_s[0] == 5e-3  # the new measurement wins
    assert any("1 compute table(s) of other shapes are kept" in line for line in lines), lines
    assert resolve_profile("cpu", here=here).profile == str(path)  # and the next command uses it


def test_merge_does_not_take_tables_of_another_machine(tmp_path):
    here = this_machine("cpu")
    path = _write(tmp_path / "p.json", _profile(ELSEWHERE, _table("sig-a", 64)))
    lines = []
    save_measured(Calibration(_profile(here, _table("sig-b", 64)), {}), tmp_path / "p.json", log=lines.append)
    assert [t.model for t in load_profile(path).compute_tables] == ["sig-b"]
    assert any("another machine" in line for line in lines)


def test_merge_tables_keeps_the_new_ones_first():
    old, new = _profile(HERE, _table("x", 1), _table("y", 1)), _profile(HERE, _table("x", 1, dur=2e-3))
    merged, kept = merge_tables(old, new)
    assert kept == 1 and [(t.model, t.dur_s[0]) for t in merged.compute_tables] == [("x", 2e-3), ("y", 1e-3)]


def test_simulate_prints_one_profile_line(tmp_path, capsys):
    from megatrain.cli import main

    args = ["simulate", "--model", "debug", "--batch", "2", "--seq", "32", "--schedule", "overlap", "--no-plots",
            "--out", str(tmp_path / "s")]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("profile:")]
    assert len(lines) == 1 and lines[0].startswith("profile: h200-measured (shipped default for cuda, NOT this")
    _write(cache_path(this_machine("cuda")), _profile(this_machine("cuda"), name="mine"))
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("profile:")]
    assert lines == [f"profile: {cache_path()} (this machine's profile in the cache)"]
    assert main(args + ["--profile", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("profile:")]
    assert lines == ["profile: cpu (--profile)"]


@pytest.mark.parametrize("resume", [False, True])
def test_train_prints_one_profile_line_and_a_resume_starts_from_its_calibrated_profile(tmp_path, capsys, resume):
    from megatrain.cli import main

    base = ["train", "--steps", "5", "--batch", "2", "--seq", "16", "--device", "cpu", "--no-progress",
            "--out-dir", str(tmp_path / "runs"), "--name", "r", "--set", "run.checkpoint_every=5"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("profile: ")] == [
        "profile: cpu (shipped default for cpu, NOT this machine's: no profile of this machine at "
        f"{cache_path()}; `megatrain profile --quick --device cpu` measures one there)"]
    cal = tmp_path / "runs" / "r" / CALIBRATED
    assert cal.is_file() and load_profile(cal).machine["cores"] == this_machine()["cores"]  # records this machine
    if not resume:
        return
    assert main(base[:2] + ["7"] + base[3:] + ["--resume"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("profile: ")]
    assert len(lines) == 1 and lines[0].startswith(f"profile: {cal} (this resumed run's own calibrated profile")


def test_the_profile_command_writes_the_cache_by_default(monkeypatch, capsys):
    """`megatrain profile` without --out: this machine's cache file (the measurement itself is stubbed: the
    measuring is tests/test_calibrate.py's), and twice keeps the first run's tables."""
    from megatrain.cli import main
    from megatrain.profiling import calibrate, report

    here = this_machine("cpu")
    runs = iter([_table("sig-a", 16), _table("sig-b", 16)])
    monkeypatch.setattr(calibrate, "measure_profile", lambda req: Calibration(_profile(here, next(runs)), {}))
    monkeypatch.setattr(report, "calibration_report", lambda cal: "(report)")
    args = ["profile", "--model", "debug", "--batch", "2", "--seq", "16", "--device", "cpu", "--quick"]
    assert main(args) == 0 and main(args) == 0
    out = capsys.readouterr().out
    assert f"profile written to {cache_path()}" in out and "it is this machine's profile in the per-user cache" in out
    assert sorted(t.model for t in load_profile(cache_path()).compute_tables) == ["sig-a", "sig-b"]


def test_compare_resolves_its_profile_in_one_line(capsys, monkeypatch):
    """compare's profile (without --measure-profile) is the store's: the shipped one for the device, then
    $MEGATRAIN_PROFILE (the measuring itself is tests/test_compare.py's)."""
    from argparse import Namespace

    from megatrain.cli.compare import _profile_for

    args = Namespace(measure_profile=False, profile=None, model="debug", batch=2, seq=16)
    assert _profile_for(args, None, "cpu", None, Path("unused")).name == "cpu"
    assert capsys.readouterr().out.startswith("profile: cpu (shipped default for cpu, NOT this machine's")
    monkeypatch.setenv("MEGATRAIN_PROFILE", "h200")
    assert _profile_for(args, None, "cpu", None, Path("unused")).name == load_profile("h200").name
    assert capsys.readouterr().out.splitlines()[0] == "profile: h200 ($MEGATRAIN_PROFILE)"


def test_the_advice_for_a_gpu_prediction_runs_on_a_machine_without_a_gpu():
    """`simulate` predicts a GPU step on any machine; without a profile, its advice must be a command this machine
    accepts (issue 23: advice is only ever something the next command accepts)."""
    no_gpu = {**HERE, "gpu": "none", "gpu_count": 0}
    c = resolve_profile("cuda", here=no_gpu)
    assert c.source == "shipped" and "no GPU" in c.reason
    assert "`megatrain profile --quick --device cpu` measures its CPU backend" in c.reason
    with_gpu = {**HERE, "gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1}
    assert "`megatrain profile --quick --device cuda` measures one there" in resolve_profile("cuda", here=with_gpu).reason
