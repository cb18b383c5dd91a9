# Two commands on a fresh clone: `make demo` and `make test`.
# torch is installed first as `torch==2.13.0` (a CPU build on CPU-only machines, CUDA on GPU
# machines), so that pip never pulls a multi-GB build the machine cannot use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0

.PHONY: demo test lint install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH)
	$(PIP) install -q -e .

install-dev: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev]'

demo: install
	$(VENV)/bin/ctxrl demo

lint: install-dev
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
