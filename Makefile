# Two commands work on a fresh machine: `make demo` (the main job on the embedded default) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/megatrain: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

venv: $(BIN)/megatrain

demo: venv
	$(BIN)/megatrain train --model debug

test: venv
	$(BIN)/python -m pytest -q

.PHONY: venv demo test
