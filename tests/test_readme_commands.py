"""README.md's shell commands work as written (issue 23): every line of its ```bash blocks is either run here, in
order, from a temporary directory laid out like the repository root (examples/ copied, `.venv/bin/megatrain` the
command of this checkout), and must exit 0, or is listed in NOT_RUN with the reason. A new README command that is
in neither fails the test, so the list cannot go stale silently; nothing is written into the repository."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Commands not run here, each with why (matched by their start, after the line continuations are joined).
NOT_RUN = {
    "make demo": "`make` builds a fresh .venv (pip install, minutes, network); its command is `megatrain train "
                 "--model debug`, which tests/test_training.py covers",
    "make test": "`make` builds a fresh .venv (network), then runs this very suite",
    ".venv/bin/megatrain profile --model bench-3b --device cuda": "needs a GPU (--device cuda)",
    ".venv/bin/megatrain compare --model bench-3b": "needs a GPU (it uses the profile the line before measures "
                                                    "into the per-user cache)",
}


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks of `text`, one per command: continuation lines joined, comment-only and
    blank lines dropped (a trailing `# ...` stays: bash ignores it)."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return commands


def _not_run(command: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.startswith(start)), None)


def test_readme_commands_are_all_run_or_explained():
    commands = readme_commands((REPO / "README.md").read_text())
    unexplained = [c for c in commands if not c.startswith(".venv/bin/megatrain ") and _not_run(c) is None]
    assert not unexplained, f"README commands neither run by this test nor listed in NOT_RUN: {unexplained}"
    used = {start for start in NOT_RUN if any(c.startswith(start) for c in commands)}
    assert used == set(NOT_RUN), f"NOT_RUN names commands the README no longer has: {set(NOT_RUN) - used}"


def _checkout_like(tmp: Path) -> dict:
    """A directory laid out like the repository root for the README's commands; the environment to run them in."""
    shutil.copytree(REPO / "examples", tmp / "examples")
    bin_dir = tmp / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "megatrain").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m megatrain "$@"\n')
    (bin_dir / "megatrain").chmod(0o755)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return env


def _config_line(out: str) -> str:
    """A run's first line (`config: ...`) without its step count: what a resumed run must share with its run."""
    line = out.splitlines()[0]
    assert line.startswith("config: "), out
    return re.sub(r"\b\d+ steps\b", "N steps", line)


@pytest.mark.slow  # two demo runs of 120 steps each: about 30 s on 2 cores
def test_readme_commands_run_as_written(tmp_path):
    before = sorted(p.name for p in REPO.iterdir())
    env = _checkout_like(tmp_path)
    config_lines = {}
    for command in readme_commands((REPO / "README.md").read_text()):
        if _not_run(command) is not None:
            continue
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr, f"{command}\n{proc.stderr}"
        if " train " in command:
            config_lines[command] = _config_line(proc.stdout)
    # "continue it" continues the run started before it, with its settings (issue 23: the README's lr differed)
    started, resumed = None, 0
    for command, line in config_lines.items():  # in README order
        if "--resume" not in command:
            started = command
            continue
        resumed += 1
        assert started is not None and line == config_lines[started], (command, line, config_lines.get(started))
    assert resumed, "the README no longer continues a run: update this test"
    assert (tmp_path / "runs" / "demo-hf" / "config.json").is_file()
    assert sorted(p.name for p in REPO.iterdir()) == before  # nothing written into the repository


def test_make_venv_says_what_it_installs():
    """`make demo` on a fresh clone installs for minutes before its first line (issue 23): the venv recipe prints
    one line before each step (creating the venv, each pip install) and nothing else of its own."""
    text = (REPO / "Makefile").read_text()
    recipe = re.search(r"^\$\(BIN\)/megatrain:.*\n((?:\t.*\n)+)", text, flags=re.M).group(1).splitlines()
    steps = [i for i, line in enumerate(recipe) if re.search(r"-m venv|pip install", line) and "echo" not in line]
    assert len(steps) == 4, recipe
    for i in steps:
        assert i > 0 and recipe[i - 1].startswith("\t@echo ") and recipe[i - 1].rstrip().endswith('..."'), recipe
        assert recipe[i].startswith("\t@") and ("-q" in recipe[i] or "-m venv" in recipe[i]), recipe  # quiet pip
    torch_line = next(recipe[i - 1] for i in steps if "torch==" in recipe[i])
    version = re.search(r"torch==([\d.]+)", recipe[next(i for i in steps if "torch==" in recipe[i])]).group(1)
    assert f"torch {version}" in torch_line  # the message names the version it installs
