"""Pipeline assembly: parse → measure → admit → batch → generate (streaming) → write.

:func:`build` wires the reusable transforms from a validated
:class:`~pipeline.config.options.PipelineConfig`; :func:`run` is what the Flex
Template entry point and ``make smoke`` call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import apache_beam as beam
from apache_beam.io.gcp.pubsub import ReadFromPubSub
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.runner import PipelineResult

from pipeline.config.launch_checks import apply_launch_defaults, dataflow_launch_problems
from pipeline.config.options import ConfigError, PipelineConfig
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import RequestLimits
from pipeline.engines.engine import EngineSettings
from pipeline.engines.engine_host import new_engine_tag
from pipeline.flow.admission import AdmitRequests
from pipeline.flow.batching import BatchRequests
from pipeline.generation.generate import StreamingGenerate
from pipeline.intake.parsing import ParseRequests
from pipeline.intake.prompt_length import MeasurePromptLength
from pipeline.serving.lora_adapters import launch_problems as adapter_launch_problems
from pipeline.serving.vllm_server import ServerSpec
from pipeline.sinks.bigquery_sink import (KIND_CHUNKS, KIND_COMPLETIONS, KIND_DEAD_LETTERS, TableError,
                                          WriteToBigQueryTable, ensure_table)
from pipeline.sinks.pubsub_sink import PublishJson

LOGGER = logging.getLogger(__name__)
LOCAL_RUNNERS = ("DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")

# Structured answers as compact JSON: the grammar allows no whitespace between JSON tokens, so a small model cannot
# spend its budget on newlines. vLLM reads this server-wide, and only for a named backend (it refuses it with its
# default "auto"): xgrammar is the one "auto" picks for JSON schemas.
COMPACT_JSON_ARGS = ("--structured-outputs-config.backend", "xgrammar",
                     "--structured-outputs-config.disable_any_whitespace", "true")


def compact_json_by_default(vllm_args: tuple[str, ...]) -> bool:
    """Whether the template adds :data:`COMPACT_JSON_ARGS`: unless ``vllm_args`` sets the structured-output config.

    vLLM merges dotted config flags, but a whole ``--structured-outputs-config JSON`` would replace ours
    (or ours it), so a user who sets any of it decides all of it.
    """
    return not any(arg.startswith("--structured-outputs-config") for arg in vllm_args)


def engine_settings(config: PipelineConfig) -> EngineSettings:
    policy = ChunkPolicy(config.chunk_tokens, float(config.chunk_interval_ms))
    # The chunks topic is published by the engine itself (pipeline.engines.chunk_publisher); chunks pass
    # through the pipeline only when a BigQuery chunks table wants them too.
    common = dict(engine=config.engine, served_model_name=config.served_model_name, prompt_format=config.prompt_format,
                  max_in_flight=config.max_in_flight, request_timeout_s=float(config.request_timeout_s),
                  stream_lease_s=float(config.stream_lease_s), worker_queue=config.worker_queue,
                  # An admitted request reaches the generate step after the shuffle and its batch's wait.
                  admission_transit_s=1.0 + config.max_batch_delay_ms / 1000.0, chunk_policy=policy,
                  priority_boundaries=config.priority_boundaries,
                  chunk_topic=config.output_chunks_topic,
                  chunks_to_pipeline=not config.output_chunks_topic or bool(config.output_chunks_table))
    if config.server_url:
        return EngineSettings(server=None, server_url=config.server_url, **common)
    extra_args = tuple(config.extra_vllm_args)
    if config.priority_boundaries is not None and "--scheduling-policy" not in extra_args:
        extra_args += ("--scheduling-policy", "priority")
    extra_args = COMPACT_JSON_ARGS + extra_args if compact_json_by_default(extra_args) else extra_args
    spec = ServerSpec(
        model=config.effective_model, max_model_len=config.max_model_len, dtype=config.dtype,
        gpu_memory_utilization=config.gpu_memory_utilization, extra_args=extra_args,
        served_model_name=config.served_model_name, start_timeout_s=float(config.server_start_timeout_s),
        adapters=config.adapters(), max_lora_rank=config.max_lora_rank, max_loras=config.max_loras,
        hf_token_secret=config.hf_token_secret)
    return EngineSettings(server=spec, **common)


@dataclass
class PipelineOutputs:
    chunks: beam.PCollection
    completions: beam.PCollection
    dead_letters: beam.PCollection


def build(pipeline: beam.Pipeline, config: PipelineConfig) -> PipelineOutputs:
    """Adds the whole streaming inference graph to ``pipeline``.

    On a local runner the admission step does not wait (the local source admits, see
    :mod:`pipeline.flow.admission`).
    """
    # A server_url server decides which adapters it serves; the model manager's serves lora_adapters.
    adapters = None if config.server_url else tuple(adapter.name for adapter in config.adapters())
    limits = RequestLimits(default_max_tokens=config.default_max_tokens, max_model_len=config.max_model_len,
                           adapters=adapters)
    messages = pipeline | "ReadPrompts" >> ReadFromPubSub(subscription=config.input_subscription,
                                                          with_attributes=True)
    parsed = messages | "ParseRequests" >> ParseRequests(limits, config.id_attribute, config.request_defaults())
    measured = parsed.requests | "MeasurePromptLength" >> MeasurePromptLength(
        estimator=config.effective_length_estimator, model=config.effective_model, prompt_format=config.prompt_format,
        max_model_len=config.max_model_len, hf_token_secret=config.hf_token_secret)
    settings, local = engine_settings(config), is_local(pipeline.options)
    shared_tag = new_engine_tag(settings)  # the admission step and the generate step share the worker's engine
    # Last before the first shuffle: what it holds back is still unacknowledged in Pub/Sub.
    admitted = measured.requests | "AdmitRequests" >> AdmitRequests(settings, shared_tag, wait=not local)
    batches = admitted | "BatchRequests" >> BatchRequests(config.batching())
    generate_shards = config.effective_generate_shards(local=local)
    generated = batches.batches | "StreamingGenerate" >> StreamingGenerate(
        settings, shared_tag=shared_tag, dedupe_window_s=float(config.dedupe_window_s),
        drain_timeout_s=float(config.drain_timeout_s),
        # The batcher's shard already is hash(id) mod num_shards: re-keying to the same keys would only
        # add a step (a hop on the DirectRunner, which fuses nothing).
        # A static batch is the transformers engine's unit of work: it stays whole, on its batcher key.
        generate_shards=None if generate_shards == config.num_shards or config.engine != "vllm" else generate_shards)
    failures = [parsed.dead_letters, measured.dead_letters, batches.dead_letters, generated.dead_letters]
    if config.output_completions_topic:
        failures.append(generated.completions | "PublishCompletions" >> PublishJson(
            config.output_completions_topic))
    if config.output_completions_table:
        failures.append(generated.completions | "WriteCompletionsTable" >> WriteToBigQueryTable(
            config.output_completions_table, KIND_COMPLETIONS))
    if config.output_chunks_table:
        failures.append(generated.chunks | "WriteChunksTable" >> WriteToBigQueryTable(
            config.output_chunks_table, KIND_CHUNKS))
    dead_letters = failures | "AllDeadLetters" >> beam.Flatten()
    lost = []
    if config.dead_letter_topic:
        lost.append(dead_letters | "PublishDeadLetters" >> PublishJson(config.dead_letter_topic))
    if config.dead_letter_table:
        rejected = dead_letters | "WriteDeadLetterTable" >> WriteToBigQueryTable(
            config.dead_letter_table, KIND_DEAD_LETTERS)
        if config.dead_letter_topic:
            lost.append(rejected | "PublishRejectedDeadLetters" >> PublishJson(config.dead_letter_topic))
        else:
            lost.append(rejected)
    # Dead letters are cut to fit every sink, so this is the last resort: say so loudly.
    (lost | "LostDeadLetters" >> beam.Flatten() | "LogLostDeadLetters" >> beam.Map(
        lambda letter: LOGGER.error("Dead letter for request %s could not be written anywhere: %s",
                                    letter.get("id"), letter.get("reason"))))
    return PipelineOutputs(generated.chunks, generated.completions, dead_letters)


def is_local(options: PipelineOptions) -> bool:
    """Whether the pipeline runs on a local runner (the default one included)."""
    return (options.view_as(StandardOptions).runner or "DirectRunner").split(".")[-1] in LOCAL_RUNNERS


def prepare_tables(config: PipelineConfig) -> None:
    """Creates (or checks) the configured BigQuery tables before any job exists."""
    tables = ((config.output_completions_table, KIND_COMPLETIONS), (config.output_chunks_table, KIND_CHUNKS),
              (config.dead_letter_table, KIND_DEAD_LETTERS))
    for table, kind in tables:
        if table:
            try:
                ensure_table(table, kind, create=config.bigquery_create_tables)
            except TableError as exc:
                raise ConfigError(str(exc)) from exc


def run(argv: Sequence[str] | None = None) -> PipelineResult:
    """Parses launcher-style arguments, validates them, builds the pipeline and starts it; returns at once.

    On Dataflow the job then runs on its own; the local launcher (``local/direct_runner.py``)
    waits on the result.
    """
    options = PipelineOptions(argv)
    config = PipelineConfig.from_options(options)  # raises ConfigError before any job exists
    apply_launch_defaults(options)
    problems, warnings = dataflow_launch_problems(options, config)
    for warning in warnings:
        LOGGER.warning("Launch check: %s", warning)
    if problems:
        raise ConfigError("This launch would fail on Dataflow:\n  - " + "\n  - ".join(problems))
    problems = adapter_launch_problems(config.adapters(), config.max_lora_rank)
    if problems:
        raise ConfigError("The LoRA adapters cannot be served:\n  - " + "\n  - ".join(problems))
    options.view_as(StandardOptions).streaming = True
    prepare_tables(config)
    pipeline = beam.Pipeline(options=options)
    build(pipeline, config)
    return pipeline.run()
