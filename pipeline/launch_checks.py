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
which has neither this code nor vLLM; the launch is refused. Whether a GPU comes
with the workers cannot be read with certainty (a machine type can bring its
own), so a missing ``worker_accelerator`` is a warning.
"""

from __future__ import annotations

from apache_beam.options.pipeline_options import DebugOptions, GoogleCloudOptions, PipelineOptions, SetupOptions, \
    StandardOptions, WorkerOptions

from pipeline.options import PipelineConfig

DATAFLOW_RUNNERS = ("DataflowRunner",)
GPU_OPTION = "worker_accelerator"


def is_dataflow(options: PipelineOptions) -> bool:
    return (options.view_as(StandardOptions).runner or "").split(".")[-1] in DATAFLOW_RUNNERS


def dataflow_launch_problems(options: PipelineOptions, config: PipelineConfig) -> tuple[list[str], list[str]]:
    """(problems that must stop the launch, warnings) for a Dataflow launch; nothing for other runners."""
    if not is_dataflow(options):
        return [], []
    problems, warnings = [], []
    managed_server = not config.server_url and config.engine == "vllm"  # the worker starts vLLM itself
    image = options.view_as(WorkerOptions).sdk_container_image
    if not image:
        # Beam 2.77, apache_beam/runners/dataflow/internal/apiclient.py, get_container_image_from_options:
        # without sdk_container_image the job's workers run Beam's default beam_python3.x_sdk image.
        if options.view_as(SetupOptions).setup_file is None or managed_server:
            problems.append(
                "sdk_container_image is not set, so the workers would run Beam's default SDK image, which has "
                "neither this template's code nor its engine (vLLM or transformers); add sdk_container_image=<the template's image> to the "
                "parameters (make run does), the same image the template was built from")
    if managed_server:
        service_options = options.view_as(GoogleCloudOptions).dataflow_service_options or []
        experiments = options.view_as(DebugOptions).experiments or []
        if not any(GPU_OPTION in option for option in [*service_options, *experiments]):
            warnings.append(
                "no GPU is requested (no worker_accelerator in --dataflow_service_options or experiments), and the "
                "template starts vLLM on each worker: unless the machine type brings its own GPU, every worker will "
                "refuse to start the server. Add --dataflow_service_options=worker_accelerator=type:nvidia-l4;"
                "count:1;install-nvidia-driver (make run does, from GPU_TYPE and GPU_COUNT), or set server_url "
                "to a server you run")
    return problems, warnings
