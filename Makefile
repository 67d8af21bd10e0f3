# Two commands work on a fresh machine: `make demo` (the main job on the embedded default) and `make test`.
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

test: venv
	$(BIN)/python -m pytest -q

.PHONY: venv demo test
