"""The Flex Template entry point, as the launcher calls it (every value a string)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.assembly import build, engine_settings
from pipeline.model_manager import ServerSpec
from pipeline.options import PipelineConfig

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
    config = PipelineConfig.from_options(options)
    pipeline = beam.Pipeline(options=options)
    build(pipeline, config)
    labels = {t.full_label for t in pipeline.transforms_stack[0].parts}
    assert {"ReadPrompts", "ParseRequests", "MeasurePromptLength", "BatchRequests", "StreamingGenerate",
            "PublishChunks", "PublishCompletions", "PublishDeadLetters"} <= labels
    assert config.batching().boundaries[0] == 32 and config.max_batch_delay_ms == 25


def test_gpu_settings_travel_to_the_workers_whatever_the_launcher_has():
    # The launcher VM has no GPU; the worker decides at spawn time what its platform accepts.
    spec = engine_settings(PipelineConfig.from_options(PipelineOptions(LAUNCHER_ARGS))).server
    assert spec.gpu_memory_utilization == 0.85 and spec.extra_args == ("--max-num-seqs", "64")
    gpu_command = spec.command("/models/m", 8000, on_cpu=False)
    assert gpu_command[gpu_command.index("--gpu-memory-utilization") + 1] == "0.85"
    assert "--gpu-memory-utilization" not in ServerSpec(model="m").command("m", 8000, on_cpu=True)
