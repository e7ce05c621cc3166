# pmnet-consolidator: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the local CPU wheel (never the multi-GB CUDA build); on a machine
# with an NVIDIA GPU the venv sees the torch the user already has (system site packages),
# and only installs PyPI's default (CUDA) build when there is none.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch
VENV_FLAGS ?= --system-site-packages
else
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
endif

PRESET ?=
GRID ?=
VARIANTS ?=
SEEDS ?=
CONDITIONS ?=
NAME ?=
PHASE1 ?=
GPU_MEM ?=
ALLOW_CPU_PAPER ?=
RUNS ?= $(CURDIR)/runs
HOST ?=
PORT ?=
ALLOWED_HOSTS ?=

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[1m%-12s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

install: $(VENV)/.installed ## create or reuse the virtual environment and install the project

browser: ## install Chromium for the report's browser check when missing (root + apt-get only; never fails)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) \
		|| echo "browser: installing chromium failed; tests/test_report_browser.py will skip"; \
	else \
		echo "browser: no chromium, and not root with apt-get to install it; tests/test_report_browser.py will skip"; \
	fi

test: install browser ## run the fast test suite (no slow, no gpu tests)
	$(PY) -m pytest -q -rs -m "not slow and not gpu"

test-all: install browser ## run every test, slow ones included
	$(PY) -m pytest -q

lint: install ## ruff check
	$(VENV)/bin/ruff check .

gpu-check: install ## run first on a new GPU: the GPU path's predictions against the card, one table (exit 1: off by more than docs/gpu-check.md's tolerances; 2: no GPU)
	$(PY) -m pmnet.gpu_check

bench: install ## speed benchmark of the model (writes benchmarks/results/*.json)
	$(PY) benchmarks/bench_model.py

pipeline: install ## run the whole pipeline (PRESET=paper|cpu|debug, GRID=default|paper|core|tiny|operators|segments|phase1_variance|baselines|checkpoints|checkpoint_channel, VARIANTS=T2-full,... CONDITIONS=a,b SEEDS=42,43 to narrow the grid, NAME=run name, PHASE1=reuse a Phase-1 checkpoint, GPU_MEM=GiB per GPU, ALLOW_CPU_PAPER=1 to run PRESET=paper without a GPU)
	$(PY) -m pipelines.run start $(if $(PRESET),--preset $(PRESET)) $(if $(GRID),--grid $(GRID)) $(if $(VARIANTS),--variants $(VARIANTS)) $(if $(CONDITIONS),--conditions $(CONDITIONS)) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(NAME),--name $(NAME)) $(if $(PHASE1),--phase1-from $(PHASE1)) $(if $(GPU_MEM),--gpu-mem $(GPU_MEM)) $(if $(ALLOW_CPU_PAPER),--allow-cpu-paper) --root $(RUNS)

resume: install ## resume the last (or NAME=...) pipeline
	$(PY) -m pipelines.run resume $(if $(NAME),--name $(NAME)) --root $(RUNS)

status: install ## table of trials of the last (or NAME=...) pipeline, read from disk
	$(PY) -m pipelines.run status $(if $(NAME),--name $(NAME)) --root $(RUNS)

report: install ## rebuild the report of the last (or NAME=...) pipeline from finished results
	$(PY) -m pipelines.run report $(if $(NAME),--name $(NAME)) --root $(RUNS)

ui: install ## start the MLflow UI for the local store (prints the last pipeline's runs address; HOST=0.0.0.0 serves beyond 127.0.0.1, unauthenticated: a warning says so; PORT=, ALLOWED_HOSTS=)
	$(PY) -m pipelines.run ui $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(if $(ALLOWED_HOSTS),--allowed-hosts $(ALLOWED_HOSTS)) --root $(RUNS)

clean: ## remove caches (keeps the venv and runs/)
	rm -rf .pytest_cache .ruff_cache build *.egg-info

.PHONY: help install browser test test-all lint gpu-check bench pipeline resume status report ui clean
