# Two commands work on a fresh machine: `make demo` (the main job on the embedded default) and `make test`.
# `make notebook` opens JupyterLab on notebooks/ (it installs the `notebook` extra, which demo and test never do).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The first `make demo` installs for a few minutes: one line per step says what it is doing (pip itself stays quiet).
$(BIN)/megatrain: pyproject.toml constraints.txt
	@echo "creating the virtual environment $(VENV) ($(PYTHON) -m venv) ..."
	@$(PYTHON) -m venv $(VENV)
	@echo "upgrading pip in $(VENV) ..."
	@$(BIN)/pip install -q --upgrade pip
	@echo "installing torch 2.13.0 into $(VENV) (the largest download: a few minutes on a fresh machine) ..."
	@$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	@echo "installing megatrain (editable) and its test dependencies into $(VENV) ..."
	@$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	@touch $@
	@echo "$(VENV) is ready"

venv: $(BIN)/megatrain

demo: venv
	$(BIN)/megatrain train --model debug

# --durations: every run's log names its slowest tests (the suite is held to about 10 minutes on a 2-core machine)
test: venv
	$(BIN)/python -m pytest -q --durations=25

# JupyterLab in the same venv, so the notebooks' kernel imports this checkout. On a remote machine, serve without a
# browser on a port you forward (ssh -L 8888:localhost:8888 host), e.g.
#   make notebook JUPYTER_ARGS="--no-browser --port 8888"
# (as root, in a container, Jupyter also wants --allow-root).
JUPYTER_ARGS ?=

$(BIN)/jupyter-lab: $(BIN)/megatrain
	@echo "installing JupyterLab (the 'notebook' extra of pyproject.toml: jupyterlab, ipykernel) into $(VENV) ..."
	@$(BIN)/pip install -q -c constraints.txt -e '.[test,notebook]'
	@touch $@

notebook: $(BIN)/jupyter-lab
	@echo "opening JupyterLab on notebooks/ (Ctrl-C stops it; JUPYTER_ARGS=\"--no-browser --port 8888\" on a remote machine) ..."
	$(BIN)/jupyter lab $(JUPYTER_ARGS) notebooks/

.PHONY: venv demo test notebook
