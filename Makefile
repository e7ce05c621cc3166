# pmnet-consolidator: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the torch this project is tested with: docker/constraints.txt's pin (pmnet/gpu_check/table.py's
# TESTED_TORCH; tests/test_gpu_check_faults.py checks they agree)
TESTED_TORCH := $(shell sed -n 's/^torch==\([^ #]*\).*/\1/p' docker/constraints.txt)
# CPU machines take the local CPU wheel (never the multi-GB CUDA build); on a machine
# with an NVIDIA GPU the venv sees the torch the user already has (system site packages),
# and only installs PyPI's default (CUDA) build of the tested version when there is none.
# An installed torch of another version is kept, and `make install` says it is untested.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= torch==$(TESTED_TORCH)
ifeq ($(HAS_GPU),1)
VENV_FLAGS ?= --system-site-packages
else
VENV_FLAGS ?=
endif
# `make gpu-check PY=python3` (PY given on the command line): that interpreter as it is, no
# venv made and nothing installed (a bare GPU box: torch and Lightning, no network)
GPU_CHECK_DEPS := $(if $(filter command line,$(origin PY)),,install)
GPU_CHECK_ARGS ?=

PRESET ?=
GRID ?=
VARIANTS ?=
SEEDS ?=
CONDITIONS ?=
NAME ?=
PHASE1 ?=
GPU_MEM ?=
ALLOW_CPU_PAPER ?=
STORE ?=
PHASE1_SEEDS ?=
MAX_WALL ?=
SET ?=
CPUS_PER_TRIAL ?=
STAGE1_CPUS ?=
TEST_WORKERS ?= 2
GPUS_PER_TRIAL ?=
MAX_FAILURES ?=
MAX_CONCURRENT ?=
RUNS ?= $(CURDIR)/runs
HOST ?=
PORT ?=
ALLOWED_HOSTS ?=

# `make help` fills {presets} in with the names of the one preset registry (pmnet/config.py's
# PRESETS; it imports no torch, so the venv's Python or a bare python3 reads it)
HELP_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

help: ## list the targets
	@presets=$$($(HELP_PY) -c 'from pmnet.config import PRESETS; print("|".join(PRESETS))' 2>/dev/null || echo "a preset of pmnet/config.py"); \
	grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | sed "s#{presets}#$$presets#g" | awk 'BEGIN{FS=":.*?## "}{printf "  \033[1m%-12s\033[0m %s\n", $$1, $$2}'

# Everything but torch is installed at docker/constraints.txt's tested version, as the image
# does: a new release on PyPI (mlflow 3.18 broke CI in stop 76) never reaches a fresh clone
# untested. torch's line is left out of the constraints: it is installed above (or is the
# GPU machine's own), and a pin there would make pip replace a GPU's CUDA build.
$(VENV)/.installed: pyproject.toml docker/constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	@grep -v '^torch==' docker/constraints.txt > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[dev,postgres]"
	@$(PY) -c "import sys, torch; v = torch.__version__.split('+')[0]; v == '$(TESTED_TORCH)' or print(f'install: torch {torch.__version__} is UNTESTED (tested: $(TESTED_TORCH)); the code uses private torch APIs: run make gpu-check / make test first', file=sys.stderr)"
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

test: install browser ## run the fast test suite (no slow, no gpu tests) in TEST_WORKERS processes (default 2, pytest-xdist, one test file per worker at a time; 0: in this process)
	$(PY) -m pytest -q -rs -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadfile

test-all: install browser ## run every test, slow ones included
	$(PY) -m pytest -q

lint: install ## ruff check
	$(VENV)/bin/ruff check .

gpu-check: $(GPU_CHECK_DEPS) ## run first on a new GPU: the GPU path's predictions against the card, one table (PY=python3: that interpreter, nothing installed; GPU_CHECK_ARGS='--kinds phase1': one piece; exit 0 ok, 1 a gate failed, 2 no GPU, 3 timed out, 4 the check failed; docs/gpu-check.md)
	$(PY) -m pmnet.gpu_check $(GPU_CHECK_ARGS)

bench: install ## speed benchmark of the model (writes benchmarks/results/*.json)
	$(PY) benchmarks/bench_model.py

pipeline: install ## run the whole pipeline (PRESET={presets}, GRID=default|paper|core|tiny|operators|segments|phase1_variance|baselines|checkpoints|checkpoint_channel|ladder|add10_long|both_long, SET='compile=off lr=1e-3' TrainConfig overrides, space-separated (each a --set), CPUS_PER_TRIAL=, GPUS_PER_TRIAL= (a fraction of one GPU), MAX_FAILURES=, MAX_CONCURRENT= per-trial resources and retries, VARIANTS=T2-full,... CONDITIONS=a,b SEEDS=42,43 to narrow the grid, NAME=run name, PHASE1=reuse a Phase-1 checkpoint, GPU_MEM=GiB per GPU, ALLOW_CPU_PAPER=1 to run a preset built for a GPU without one; STORE=dir fills a durable store as well (and rebuilds its report), PHASE1_SEEDS=3,4 sets the grid's Phase-1 checkpoints, STAGE1_CPUS=1 trains them in waves of one per CPU, MAX_WALL=seconds stops between waves of checkpoints and pauses a Phase 1 at an epoch end)
	$(PY) -m pipelines.run start $(if $(PRESET),--preset $(PRESET)) $(if $(GRID),--grid $(GRID)) $(if $(VARIANTS),--variants $(VARIANTS)) $(if $(CONDITIONS),--conditions $(CONDITIONS)) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(NAME),--name $(NAME)) $(if $(PHASE1),--phase1-from $(PHASE1)) $(if $(GPU_MEM),--gpu-mem $(GPU_MEM)) $(if $(ALLOW_CPU_PAPER),--allow-cpu-paper) $(if $(STORE),--store $(STORE)) $(if $(PHASE1_SEEDS),--phase1-seeds $(PHASE1_SEEDS)) $(if $(MAX_WALL),--max-wall $(MAX_WALL)) $(foreach s,$(SET),--set '$(s)') $(if $(CPUS_PER_TRIAL),--cpus-per-trial $(CPUS_PER_TRIAL)) $(if $(STAGE1_CPUS),--stage1-cpus $(STAGE1_CPUS)) $(if $(GPUS_PER_TRIAL),--gpus-per-trial $(GPUS_PER_TRIAL)) $(if $(MAX_FAILURES),--max-failures $(MAX_FAILURES)) $(if $(MAX_CONCURRENT),--max-concurrent $(MAX_CONCURRENT)) --root $(RUNS)

resume: install ## resume the last (or NAME=...) pipeline on the Ray address it last ran on (RAY_ADDRESS=local: on local Ray; MAX_WALL=seconds: stop between waves of checkpoints)
	$(PY) -m pipelines.run resume $(if $(NAME),--name $(NAME)) $(if $(MAX_WALL),--max-wall $(MAX_WALL)) --root $(RUNS)

status: install ## table of trials of the last (or NAME=...) pipeline, read from disk
	$(PY) -m pipelines.run status $(if $(NAME),--name $(NAME)) --root $(RUNS)

report: install ## rebuild the report of the last (or NAME=...) pipeline from finished results; STORE=dir: the report of a durable store, into dir/report/ (verified first: a damaged store is refused, exit 2)
	$(PY) -m pipelines.run report $(if $(STORE),--store $(STORE),$(if $(NAME),--name $(NAME)) --root $(RUNS))

verify: install ## STORE=dir: read back every unit of a durable store (whole, partial, corrupt, orphaned); exit 0 whole, 1 damaged, 2 not a store
	$(if $(STORE),,$(error make verify needs STORE=dir, the durable store to check))
	$(PY) -m pmnet.cli store verify $(STORE)

ui: install ## the MLflow UI of the last (or NAME=...) pipeline's tracking store (the embedded SQLite, or its database; for a tracking server it prints the server's address); look first at the parent run named after the pipeline: its claims/* metrics and tags hold each claim's effect, CI and verdict (prints the runs address; HOST=0.0.0.0 serves beyond 127.0.0.1, unauthenticated: a warning says so; PORT=, ALLOWED_HOSTS=)
	$(PY) -m pipelines.run ui $(if $(NAME),--name $(NAME)) $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(if $(ALLOWED_HOSTS),--allowed-hosts $(ALLOWED_HOSTS)) --root $(RUNS)

clean: ## remove caches (keeps the venv and runs/)
	rm -rf .pytest_cache .ruff_cache build *.egg-info

.PHONY: help install browser test test-all lint gpu-check bench pipeline resume status report verify ui clean
