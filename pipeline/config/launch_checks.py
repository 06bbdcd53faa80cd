"""Pre-flight checks of a Dataflow launch: what would fail the first job, caught before the job exists.

The Flex Template launcher runs the entry point with the template parameters
and the pipeline options it was given as ``--name=value`` arguments, and the
Beam SDK builds the job from what reaches it; so what the workers will run can
be read here, offline. A check refuses the launch only where Beam's own code
makes the failure certain; otherwise it warns, since a check that misfired
would block every launch and cannot be tried against Dataflow from here.

What the launcher passes, from Dataflow's documentation: "Run a Flex
Template" (https://cloud.google.com/dataflow/docs/guides/templates/run-flex-templates)
runs ``gcloud dataflow flex-template run ... --parameters PARAMETERS``, the
job's pipeline parameters; Google's Flex Template sample that the "Configure
Flex Templates" page points to for building a template from the workers' own
image (python-docs-samples, ``dataflow/flex-templates/pipeline_with_dependencies``,
see https://cloud.google.com/dataflow/docs/guides/templates/configuring-flex-templates#use_custom_container_images)
passes the worker image itself, ``--parameters sdk_container_image=IMAGE``, at
every run: the template's own image is not made the workers' image for you.

So the worker image is a case where the failure is certain: Beam 2.77 sets the
job's worker image from ``sdk_container_image`` alone
(``apache_beam/runners/dataflow/internal/apiclient.py``,
``get_container_image_from_options``) and otherwise uses its default SDK image,
which has neither this code nor vLLM. The launcher image built by ``make image``
knows the worker image of its own commit (``STREAMING_LLM_WORKER_IMAGE``), and
:func:`apply_launch_defaults` uses it when a launch names none, as it sets a
boot disk the worker image fits on; without either the launch is refused.
Whether a GPU comes with the workers cannot be read with certainty (a machine
type can bring its own), so a missing ``worker_accelerator`` is a warning, as is
a gated model without a token.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from apache_beam.options.pipeline_options import (
    DebugOptions,
    GoogleCloudOptions,
    PipelineOptions,
    SetupOptions,
    StandardOptions,
    WorkerOptions,
)

from pipeline.config.options import PipelineConfig
from pipeline.config.settings import JobSettings
from pipeline.contract.parameters import DEFAULT_DISK_SIZE_GB, DEFAULT_HARNESS_THREADS
from pipeline.serving.adapter_root import root_problem
from pipeline.serving.gpus import (
    CUDA_MAJORS,
    DEFAULT_CUDA_MAJOR,
    FIXED_SHAPES,
    GPUS_BY_TYPE,
    gpu_type_problem,
    machine_problem,
)
from pipeline.serving.lora_adapters import LAUNCH_READ_TIMEOUT_S
from pipeline.serving.lora_adapters import launch_problems as adapter_launch_problems
from pipeline.serving.model_access import gated_model_warning

LOGGER = logging.getLogger(__name__)
DATAFLOW_RUNNERS = ("DataflowRunner",)
GPU_OPTION = "worker_accelerator"
WORKER_IMAGE_ENV = "STREAMING_LLM_WORKER_IMAGE"  # set in the launcher image (container/Dockerfile)
WORKER_CUDA_ENV = "STREAMING_LLM_WORKER_CUDA"  # the worker image's CUDA major, set in the launcher image
# Model families known to overflow in float16, the dtype GPUs without bfloat16 (compute capability below 8.0) fall
# back to.
FLOAT16_UNSAFE_FAMILIES = ("google/gemma", "google/medgemma", "google/codegemma")


def is_dataflow(options: PipelineOptions) -> bool:
    return (options.view_as(StandardOptions).runner or "").split(".")[-1] in DATAFLOW_RUNNERS


def apply_launch_defaults(options: PipelineOptions, environ: Mapping[str, str] = os.environ) -> None:
    """Fills in, for a Dataflow launch, the worker image of this launcher's commit, a boot disk the image fits on
    and the number of work items a worker runs at once, where the launch set none, so a console launch with only
    the required parameters builds the job make run does.

    The thread count is set because the worker must know it: its runtime client keeps a call thread for each
    (:func:`pipeline.worker.runtime_client.call_threads`). Dataflow's own default "depends on multiple factors and
    varies between batch and streaming jobs" ("Troubleshoot Dataflow out of memory errors"); Beam hands the
    option to the job's worker pool as ``numThreadsPerWorker`` (``apiclient.py``), and the Python SDK harness
    runs whatever bundles the runner sends on an unbounded thread pool, so the runner's count is the bound.
    """
    if not is_dataflow(options):
        return
    worker = options.view_as(WorkerOptions)
    if not worker.sdk_container_image and environ.get(WORKER_IMAGE_ENV):
        worker.sdk_container_image = environ[WORKER_IMAGE_ENV]
        LOGGER.info("Workers run %s, the worker image built with this launcher", worker.sdk_container_image)
    if not worker.disk_size_gb:
        worker.disk_size_gb = DEFAULT_DISK_SIZE_GB
        LOGGER.info("Worker boot disk: %d GB (set disk_size_gb for another size)", DEFAULT_DISK_SIZE_GB)
    debug = options.view_as(DebugOptions)
    if not debug.number_of_worker_harness_threads:
        debug.number_of_worker_harness_threads = DEFAULT_HARNESS_THREADS


def requested_gpus(options: PipelineOptions) -> tuple[str | None, int | None]:
    """The GPU type and count a launch asks Dataflow for, from its worker_accelerator service option or
    experiment."""
    service_options = options.view_as(GoogleCloudOptions).dataflow_service_options or []
    experiments = options.view_as(DebugOptions).experiments or []
    for option in [*service_options, *experiments]:
        found = re.search(rf"{GPU_OPTION}=type:([^;,\s]+)(?:;count:(\d+))?", option)
        if found:
            return found.group(1), int(found.group(2)) if found.group(2) else None
    return None, None


def image_cuda_major(environ: Mapping[str, str] = os.environ) -> int:
    """The CUDA major the workers' image is built for: the launcher image's own (``STREAMING_LLM_WORKER_CUDA``,
    set by make image), or the default image's."""
    text = environ.get(WORKER_CUDA_ENV, "")
    return int(text) if text.isdigit() and int(text) in CUDA_MAJORS else DEFAULT_CUDA_MAJOR


def launch_problems(options: PipelineOptions, settings: JobSettings,
                    cuda_major: int = DEFAULT_CUDA_MAJOR) -> tuple[list[str], list[str]]:
    """(problems that must stop the launch, warnings): every check a launch gets before anything is submitted,
    the same for the launcher (``run`` in :mod:`pipeline.assembly`) and ``make run`` (``ops/deploy.py``). The worker
    repeats the GPU check on the GPUs it has (:func:`pipeline.serving.gpus.gpus_problem`)."""
    problems, warnings = dataflow_launch_problems(options, settings.config, cuda_major)
    problems += [f"LoRA adapters: {problem}" for problem in
                 adapter_launch_problems(settings.adapters, settings.config.max_lora_rank)]
    if settings.adapter_root is not None:
        problem, warning = root_problem(settings.adapter_root, LAUNCH_READ_TIMEOUT_S)
        problems += [problem] if problem else []
        warnings += [warning] if warning else []
    return problems, warnings


def dataflow_launch_problems(options: PipelineOptions, config: PipelineConfig,
                             cuda_major: int = DEFAULT_CUDA_MAJOR) -> tuple[list[str], list[str]]:
    """(problems that must stop the launch, warnings) for a Dataflow launch; nothing for other runners."""
    if not is_dataflow(options):
        return [], []
    problems, warnings = [], []
    managed_server = not config.server_url and config.engine == "vllm"  # the worker starts vLLM itself
    image = options.view_as(WorkerOptions).sdk_container_image
    # Beam 2.77, apache_beam/runners/dataflow/internal/apiclient.py, get_container_image_from_options: without
    # sdk_container_image the job's workers run Beam's default beam_python3.x_sdk image.
    if not image and (options.view_as(SetupOptions).setup_file is None or managed_server):
        problems.append(
            "sdk_container_image is not set, so the workers would run Beam's default SDK image, which has "
            "neither this template's code nor its engine (vLLM or transformers); add sdk_container_image=<the "
            "worker image> to the parameters (make run does; a launcher built by make image knows its own)")
    if not config.server_url:
        gated = gated_model_warning(config.model, config.model_gcs_folder, config.hf_token_secret)
        if gated:
            warnings.append(gated)
    gpu, count = requested_gpus(options)
    machine = options.view_as(WorkerOptions).machine_type
    if machine and (problem := machine_problem(machine, gpu, count)):
        problems.append(problem)
    if managed_server and gpu and (problem := gpu_type_problem(gpu, cuda_major)):
        problems.append(problem)
    known = GPUS_BY_TYPE.get(gpu or "")
    if managed_server and known and known.capability < (8, 0) and config.dtype in ("auto", "float16") and \
            config.effective_model.lower().startswith(FLOAT16_UNSAFE_FAMILIES):
        warnings.append(f"{gpu} has no bfloat16, so the workers run {config.effective_model} in float16, in which "
                        "this family's activations are known to overflow (empty or garbled answers): use an L4 or "
                        "newer GPU, or --dtype=float32 if it fits")
    if managed_server and gpu is None and not (machine and machine in FIXED_SHAPES):
        warnings.append(
            "no GPU is requested (no worker_accelerator in --dataflow_service_options or experiments), and the "
            "template starts vLLM on each worker: unless the machine type brings its own GPU, every worker will "
            "refuse to start the server. Add --dataflow_service_options=worker_accelerator=type:nvidia-l4;"
            "count:1;install-nvidia-driver (make run does, from GPU_TYPE and GPU_COUNT), or set server_url "
            "to a server you run")
    return problems, warnings
