"""`make notebook` opens JupyterLab on notebooks/ from the project's venv (issue 23, item 5), and only it installs
JupyterLab: `make demo` and `make test` (CI) install the `test` extra alone, and the notebooks run headless through
nbclient (tests/notebook_runner.py). Checked with `make -n` (prints the recipes, runs nothing): no install here."""
from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _dry_run(*args: str) -> list[str]:
    # Under `make test` (CI) this make is a sub-make: without the parent's MAKELEVEL / MAKEFLAGS and with
    # --no-print-directory it prints the recipe lines only, as it does from a shell
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=REPO, capture_output=True, text=True,
                          check=True, env=env)
    return proc.stdout.splitlines()


def test_make_notebook_runs_the_venvs_jupyter_lab_on_notebooks():
    lines = _dry_run("notebook")
    assert lines[-1] == ".venv/bin/jupyter lab  notebooks/", lines
    install = next(line for line in lines if "jupyter" not in line and "[test,notebook]" in line)
    assert install.startswith(".venv/bin/pip install -q -c constraints.txt -e "), install
    assert any(line.startswith("echo ") and "installing JupyterLab" in line for line in lines), lines  # says so
    with_args = _dry_run("notebook", "JUPYTER_ARGS=--no-browser --port 8899")
    assert with_args[-1] == ".venv/bin/jupyter lab --no-browser --port 8899 notebooks/", with_args


def test_only_make_notebook_installs_jupyterlab():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("jupyterlab") for dep in extras["notebook"]), extras
    assert not any("jupyter" in dep for dep in extras["test"]), extras  # CI: nbclient + ipykernel, no front end
    for target in ("demo", "test"):
        lines = _dry_run(target)
        assert not any("notebook" in line or "jupyter" in line for line in lines), (target, lines)
