"""The Flex Template entry point, as the launcher calls it (every value a string)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.assembly import build
from pipeline.config.options import PipelineConfig
from pipeline.config.settings import JobSettings
from pipeline.serving.vllm_server import ServerSpec

REPO = Path(__file__).resolve().parent.parent
LAUNCHER_ARGS = ["--input_subscription=projects/my-project/subscriptions/prompts-sub",
                 "--output_chunks_topic=projects/my-project/topics/chunks", "--output_completions_topic=projects/my-project/topics/done",
                 "--dead_letter_topic=projects/my-project/topics/dead", "--length_bucketing=true", "--max_batch_delay_ms=25",
                 "--gpu_memory_utilization=0.85", "--vllm_args=--max-num-seqs 64"]


def test_invalid_parameters_stop_the_launch_with_every_problem_listed():
    result = subprocess.run([sys.executable, "-m", "template.main", "--input_subscription=prompts",
                             "--batch_size_target=0", "--max_batch_delay_ms=-1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    for problem in ("--input_subscription='prompts' is not valid", "--batch_size_target must be at least 1",
                    "--max_batch_delay_ms must be at least 0", "no output is configured"):
        assert problem in result.stderr
    assert "Running pipeline" not in result.stderr


def test_launcher_strings_build_the_whole_pipeline():
    options = PipelineOptions(LAUNCHER_ARGS)
    job = JobSettings.from_options(options)
    config = job.config
    pipeline = beam.Pipeline(options=options)
    build(pipeline, job)
    labels = {t.full_label for t in pipeline.transforms_stack[0].parts}
    assert {"ReadPrompts", "ParseRequests", "MeasurePromptLength", "BatchRequests", "StreamingGenerate",
            "PublishCompletions", "PublishDeadLetters"} <= labels
    # Chunks go from the worker's engine straight to their topic, not through a pipeline step.
    settings = job.engine
    assert "PublishChunks" not in labels and settings.chunk_topic == config.output_chunks_topic
    assert not settings.chunks_to_pipeline
    with_table = JobSettings.from_options(PipelineOptions(LAUNCHER_ARGS + ["--output_chunks_table=my-project:llm.chunks"]))
    assert with_table.engine.chunks_to_pipeline  # a BigQuery chunks table still gets them through Beam
    assert job.batching.boundaries[0] == 32 and config.max_batch_delay_ms == 25


def flag_pairs(args: tuple[str, ...]) -> dict[str, str]:
    """Server flags as flag -> value (every flag here takes one)."""
    return dict(zip(args[::2], args[1::2]))


def test_the_managed_server_makes_structured_answers_compact_unless_vllm_args_say_otherwise():
    default = JobSettings.from_options(PipelineOptions(LAUNCHER_ARGS)).engine.server
    assert flag_pairs(default.extra_args)["--structured-outputs-config.disable_any_whitespace"] == "true"
    assert flag_pairs(default.extra_args)["--structured-outputs-config.backend"] == "xgrammar"  # vLLM needs one
    for own in ("--structured-outputs-config.disable_any_whitespace false",
                "--structured-outputs-config.backend guidance",
                """--structured-outputs-config '{"backend": "guidance"}'"""):
        spec = JobSettings.from_options(PipelineOptions(LAUNCHER_ARGS[:-1] + [f"--vllm_args={own}"])).engine.server
        structured = [arg for arg in spec.extra_args if arg.startswith("--structured-outputs-config")]
        assert structured == [shlex.split(own)[0]], own  # the user's setting alone


def test_gpu_settings_travel_to_the_workers_whatever_the_launcher_has():
    # The launcher VM has no GPU; the worker decides at spawn time what its platform accepts.
    spec = JobSettings.from_options(PipelineOptions(LAUNCHER_ARGS)).engine.server
    assert spec.gpu_memory_utilization == 0.85 and flag_pairs(spec.extra_args)["--max-num-seqs"] == "64"
    assert flag_pairs(spec.extra_args)["--scheduling-policy"] == "priority"  # shorter prompts first
    gpu_command = spec.command("/models/m", 8000, on_cpu=False)
    assert gpu_command[gpu_command.index("--gpu-memory-utilization") + 1] == "0.85"
    assert "--gpu-memory-utilization" not in ServerSpec(model="m").command("m", 8000, on_cpu=True)


def test_requests_carry_their_length_bucket_as_priority_only_with_a_managed_server():
    from pipeline.contract.messages import InferenceRequest
    from pipeline.engines.vllm_engine import vllm_engine

    job = JobSettings.from_options(PipelineOptions(LAUNCHER_ARGS))
    settings = job.engine
    assert settings.priority_boundaries == job.batching.boundaries
    # An engine for an unreachable address: only its request payloads are looked at.
    engine = vllm_engine(dataclasses.replace(settings, server=None, server_url="http://127.0.0.1:9",
                                                 served_model_name="m", chunk_topic=None, chunks_to_pipeline=True))
    try:
        _, short = engine.backend.payload(InferenceRequest(id="a", prompt="hi", prompt_tokens=20))
        _, long = engine.backend.payload(InferenceRequest(id="b", prompt="hi", prompt_tokens=700))
        _, unmeasured = engine.backend.payload(InferenceRequest(id="c", prompt="hi"))
    finally:
        engine.close()
    assert short["priority"] < long["priority"] and "priority" not in unmeasured
    external = JobSettings.from_options(PipelineOptions(LAUNCHER_ARGS + ["--server_url=http://vllm:8000"]))
    assert external.engine.priority_boundaries is None


DATAFLOW = LAUNCHER_ARGS + ["--runner=DataflowRunner", "--project=my-project", "--region=us-central1",
                            "--temp_location=gs://my-bucket/tmp"]
IMAGE = "--sdk_container_image=us-central1-docker.pkg.dev/my-project/dataflow/streaming-llm:latest"
GPU = "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver"


def launch(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The entry point as the Flex Template launcher calls it; a refused launch never reaches Google Cloud."""
    return subprocess.run([sys.executable, "-m", "template.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_a_dataflow_launch_without_the_template_image_is_refused_with_the_fix():
    result = launch(DATAFLOW + [GPU])
    assert result.returncode == 2
    assert "This launch would fail" in result.stderr
    assert "add sdk_container_image=<the worker image> to the parameters" in result.stderr
    assert "no GPU is requested" not in result.stderr


def test_a_dataflow_launch_without_a_gpu_is_warned_about_loudly():
    result = launch(DATAFLOW)  # refused for the image; the GPU warning comes first
    assert result.returncode == 2 and "WARNING" in result.stderr and "no GPU is requested" in result.stderr
    assert "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver" in result.stderr


def test_launch_checks_ask_no_gpu_of_an_external_server_and_nothing_of_local_runs():
    from pipeline.config.launch_checks import dataflow_launch_problems

    def checks(args):
        options = PipelineOptions(args)
        return dataflow_launch_problems(options, PipelineConfig.from_options(options))

    assert checks(DATAFLOW + [IMAGE, GPU]) == ([], [])
    assert checks(DATAFLOW + [IMAGE, "--experiments=worker_accelerator=type:nvidia-l4;count:1"]) == ([], [])
    assert checks(DATAFLOW + [IMAGE, "--server_url=http://vllm.internal:8000"]) == ([], [])
    assert checks(DATAFLOW + [IMAGE, "--engine=transformers"]) == ([], [])  # torch picks a GPU if there is one
    problems, _ = checks(DATAFLOW + ["--engine=transformers"])
    assert "sdk_container_image is not set" in problems[0]
    problems, warnings = checks(DATAFLOW + ["--server_url=http://vllm.internal:8000", "--setup_file=./setup.py"])
    assert problems == [] and warnings == []
    assert checks(LAUNCHER_ARGS) == ([], [])  # the DirectRunner: nothing to check


def test_the_launcher_image_supplies_its_worker_image_and_a_boot_disk_when_a_launch_sets_neither():
    from apache_beam.options.pipeline_options import WorkerOptions

    from pipeline.config.launch_checks import WORKER_IMAGE_ENV, apply_launch_defaults

    worker_image = "us-central1-docker.pkg.dev/my-project/dataflow/streaming-llm-worker:0123456789ab"
    options = PipelineOptions(DATAFLOW + [GPU])
    apply_launch_defaults(options, {WORKER_IMAGE_ENV: worker_image})
    assert options.view_as(WorkerOptions).sdk_container_image == worker_image
    assert options.view_as(WorkerOptions).disk_size_gb == 200
    # What the launch names wins.
    named = PipelineOptions(DATAFLOW + [IMAGE, GPU, "--disk_size_gb=500"])
    apply_launch_defaults(named, {WORKER_IMAGE_ENV: worker_image})
    assert named.view_as(WorkerOptions).sdk_container_image == IMAGE.split("=", 1)[1]
    assert named.view_as(WorkerOptions).disk_size_gb == 500
    local = PipelineOptions(LAUNCHER_ARGS)  # nothing is set for a local run
    apply_launch_defaults(local, {WORKER_IMAGE_ENV: worker_image})
    assert local.view_as(WorkerOptions).sdk_container_image is None and not local.view_as(WorkerOptions).disk_size_gb
    # Launched as the console does, with the launcher image's environment: the image check passes.
    result = launch(DATAFLOW + [GPU, "--dry_run=True"], env={WORKER_IMAGE_ENV: worker_image})
    assert "sdk_container_image is not set" not in result.stderr and f"Workers run {worker_image}" in result.stderr


def test_a_gated_model_without_a_token_and_gemma_on_a_t4_are_warned_about():
    from pipeline.config.launch_checks import dataflow_launch_problems

    def warnings(args):
        options = PipelineOptions(DATAFLOW + [IMAGE, *args])
        return dataflow_launch_problems(options, PipelineConfig.from_options(options))[1]

    gemma = "--model=google/gemma-2-2b-it"
    assert any("gated on Hugging Face" in w and "hf_token_secret" in w for w in warnings([GPU, gemma]))
    assert warnings([GPU, gemma, "--hf_token_secret=projects/my-project/secrets/hf-token/versions/latest"]) == []
    assert warnings([GPU, gemma, "--model_gcs_folder=gs://my-bucket/models/gemma"]) == []
    assert warnings([GPU]) == []  # the default model is ungated
    t4 = "--dataflow_service_options=worker_accelerator=type:nvidia-tesla-t4;count:1;install-nvidia-driver:latest"
    t4_warnings = warnings([t4, gemma, "--hf_token_secret=projects/my-project/secrets/hf-token/versions/1"])
    assert len(t4_warnings) == 1 and "has no bfloat16" in t4_warnings[0]
    assert warnings([t4]) == []  # Qwen is safe in float16


def test_a_console_launch_with_only_the_marked_fields_is_refused_with_what_the_form_says_first():
    """The console marks only input_subscription required (metadata.json), since it cannot mark one-of-several
    fields so; its help text, the form's first field, names the outputs a launch also needs, and the launcher's
    refusal says the same sentence."""
    import json

    from pipeline.contract.parameters import ALSO_REQUIRED

    metadata = json.loads((REPO / "metadata.json").read_text())
    required = [p for p in metadata["parameters"] if not p.get("isOptional")]
    assert [p["name"] for p in required] == ["input_subscription"] == [metadata["parameters"][0]["name"]]
    assert ALSO_REQUIRED in metadata["parameters"][0]["helpText"]
    args = [f"--{p['name']}=projects/my-project/subscriptions/prompts-sub" for p in required]
    result = subprocess.run([sys.executable, "-m", "template.main", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and ALSO_REQUIRED in result.stderr, result.stderr
    complete = args + ["--output_completions_topic=projects/my-project/topics/done",
                       "--dead_letter_topic=projects/my-project/topics/dead"]
    JobSettings.from_options(PipelineOptions(complete))  # the two outputs the sentence names are enough
