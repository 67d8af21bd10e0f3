"""The `megatrain` command itself: --version, a --help that imports nothing heavy, memory checks before
`compare` and `profile` allocate, profile's --quick hint, and `simulate`'s table and output directory."""
from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from megatrain import __version__
from megatrain.cli import main
from megatrain.model.presets import PRESETS
from megatrain.profiling import calibrate
from megatrain.profiling.calibrate import ProfileRequest, measure_profile
from megatrain.train import fit


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"megatrain {__version__}"


def test_help_imports_no_heavy_module():
    # What made `--help` take seconds: torch, pandas, networkx, simpy, matplotlib imported to build the parser.
    code = ("import sys; from megatrain.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'pandas', 'simpy', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("argv", [["plan", "--model", "bench-3b"],
                                  ["simulate", "--model", "debug", "--batch", "2", "--seq", "16", "--no-plots"],
                                  ["plan", "--model", "debug", "--set", "recompute_block=9"]],  # an error too
                         ids=["plan", "simulate", "plan-error"])
def test_plan_and_simulate_import_no_torch(argv, tmp_path):
    """The planner and the simulator need no torch (seconds of import on a CPU machine; DESIGN.md: fast CLI)."""
    if argv[0] == "simulate":
        argv = argv + ["--out", str(tmp_path / "s")]
    code = (f"import sys; from megatrain.cli import main; rc = main({argv!r}); "
            "print('RC', rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] in ("RC 0 False", "RC 1 False", "RC 2 False"), out


def _tiny_machine(monkeypatch, host_bytes=64 * 2**20):
    monkeypatch.setattr(fit, "machine_capacity", lambda backend: (host_bytes, None))


def test_compare_checks_memory_before_allocating(monkeypatch, tmp_path, capsys):
    _tiny_machine(monkeypatch)
    out = tmp_path / "c"
    rc = main(["compare", "--model", "bench-3b", "--batch", "1", "--seq", "64", "--device", "cpu",
               "--profile", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "compare's variant overlap does not fit this machine" in err
    assert "host: DOES NOT FIT" in err and "lower --batch / --seq" in err and "Traceback" not in err
    assert not out.exists()


def test_profile_checks_memory_before_measuring(monkeypatch, tmp_path, capsys):
    _tiny_machine(monkeypatch, host_bytes=16 * 2**20)
    rc = main(["profile", "--model", "bench-3b", "--batch", "8", "--seq", "2048", "--device", "cpu",
               "--out", str(tmp_path / "p.json")])
    captured = capsys.readouterr()
    assert rc == 2 and "profiling bench-3b does not fit this machine" in captured.err
    assert "measurements" not in captured.out and not (tmp_path / "p.json").exists()


def test_profile_of_several_models_says_whose_layer_the_host_is_measured_on(monkeypatch, tmp_path, capsys):
    """The host's update rate comes from the first model's layer: with a second model of another layer size,
    `profile` says so before measuring (here it then stops: the machine is too small, nothing is measured)."""
    _tiny_machine(monkeypatch, host_bytes=16 * 2**20)
    argv = ["--batch", "8", "--seq", "2048", "--device", "cpu", "--out", str(tmp_path / "p.json")]
    assert main(["profile", "--model", "bench-3b,llama3-8b", *argv]) == 2
    out = capsys.readouterr().out
    assert "note: the host's update rate is measured on bench-3b's layer (99.1 M parameters) only; llama3-8b" in out
    assert main(["profile", "--model", "bench-3b,bench-3b", *argv]) == 2
    assert "note:" not in capsys.readouterr().out  # the same layer: nothing to say


def test_a_long_profile_suggests_quick_before_it_starts(monkeypatch):
    class Stop(Exception):
        pass

    def stop(*args):
        raise Stop

    monkeypatch.setattr(calibrate, "LONG_PROFILE_S", 0.0)  # every profile is "long"
    monkeypatch.setattr(calibrate.Progress, "done", stop)  # end after the first measurement
    lines: list[str] = []
    req = ProfileRequest(PRESETS["debug"], batch=1, seqs=[16], device="cpu", dtypes=["fp32"])
    with pytest.raises(Stop):
        measure_profile(req, log=lines.append)
    assert "measurements, about" in lines[0] and lines[1].startswith("that is long: --quick")
    assert "the longest measurement is " in lines[1] and "Ctrl-C now costs nothing" in lines[1]
    lines.clear()
    with pytest.raises(Stop):
        measure_profile(ProfileRequest(PRESETS["debug"], batch=1, seqs=[16], device="cpu", dtypes=["fp32"],
                                       quick=True), log=lines.append)
    assert "--quick" not in lines[1] and "the longest measurement is" in lines[1]  # already quick


def test_simulate_table_is_in_ms_fastest_first_and_stale_variants_go(tmp_path, capsys):
    out = tmp_path / "sim"
    base = ["simulate", "--model", "debug", "--batch", "4", "--seq", "16", "--profile", "cpu", "--no-plots",
            "--out", str(out)]
    assert main([*base, "--sweep", "buffers=1,2,3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["schedule", "knobs", "step", "ms"]
    rows = [line for line in lines[2:5]]
    ms = [float(r.split()[2]) for r in rows]
    assert ms == sorted(ms)
    table = pd.read_csv(out / "comparison.csv")
    assert sorted(table["step_s"] * 1e3) == pytest.approx(ms, abs=0.006)
    assert len([d for d in out.iterdir() if d.is_dir()]) == 3
    (out / "mine").mkdir()  # a folder simulate did not write stays
    assert main([*base, "--sweep", "buffers=2"]) == 0
    assert "removed 2 variant folder(s)" in capsys.readouterr().out
    kept = sorted(d.name for d in out.iterdir() if d.is_dir())
    assert kept == ["mine", "overlap_buffers-2"]
    assert json.loads((out / "overlap_buffers-2" / "config.json").read_text())["knobs"]["buffers"] == 2


# ---- README: every command runs as written ------------------------------------------------------------------------
REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def readme_commands() -> list[list[str]]:
    """The `megatrain ...` command lines of README.md's bash blocks (continuations joined, comments dropped)."""
    import shlex

    text = (REPO / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```bash\n")[1:]]
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith(".venv/bin/megatrain "):
                commands.append(shlex.split(line)[1:])
    return commands


def test_every_readme_command_parses_and_names_files_that_exist():
    from megatrain.cli import build_parser

    commands = readme_commands()
    assert {c[0] for c in commands} >= {"plan", "simulate", "train", "export", "profile", "compare", "--version"}
    parser = build_parser()
    for argv in commands:
        if argv == ["--version"]:
            continue
        args = parser.parse_args(argv)  # exits (fails the test) on an option the CLI does not have
        if getattr(args, "config", None):
            assert (REPO / args.config).is_file(), argv
        if args.command == "export":
            assert args.checkpoint == "runs/demo"  # what examples/demo.toml trains (run.name = "demo")
    assert "run.toml" not in (REPO / "README.md").read_text()  # the file the README used to name


def test_readme_plan_and_simulate_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in readme_commands():
        if argv[0] in ("plan", "simulate"):
            assert main(argv) in (0, 1), argv  # plan: 1 = does not fit this machine, with the table
            assert "error" not in capsys.readouterr().err
    assert len(list((tmp_path / "runs" / "simulate-bench-3b").glob("*/gantt.png"))) == 6
