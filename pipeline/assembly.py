"""Pipeline assembly: read → parse → measure → admit → batch → generate (streaming) → write.

:func:`build` wires the reusable transforms from a job's :class:`~pipeline.config.settings.JobSettings`
(every component's settings, built in one room); :func:`run` is what the Flex Template entry point and
``make smoke`` call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import apache_beam as beam
from apache_beam.io.gcp.pubsub import ReadFromPubSub
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions, WorkerOptions
from apache_beam.runners.runner import PipelineResult

from pipeline.config.launch_checks import apply_launch_defaults, image_cuda_major, launch_problems
from pipeline.config.options import ConfigError, PipelineConfig
from pipeline.config.settings import JobSettings
from pipeline.flow.admission import AdmitRequests, GenerateKeys
from pipeline.flow.batching import BatchRequests
from pipeline.flow.subscription_reader import ReadWithinRoom, marked_bulk, readers_for
from pipeline.generation.generate import StreamingGenerate
from pipeline.intake.parsing import ParseRequests
from pipeline.intake.prompt_length import MeasurePromptLength
from pipeline.sinks.bigquery_sink import (
    KIND_CHUNKS,
    KIND_COMPLETIONS,
    KIND_DEAD_LETTERS,
    TableError,
    WriteToBigQueryTable,
    ensure_table,
)
from pipeline.sinks.dead_letter_count import CountDeadLetters
from pipeline.sinks.pubsub_sink import PublishJson
from pipeline.worker.runtime import SharedRuntime, new_runtime_tag

LOGGER = logging.getLogger(__name__)
LOCAL_RUNNERS = ("DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")

@dataclass
class PipelineOutputs:
    chunks: beam.PCollection
    completions: beam.PCollection
    dead_letters: beam.PCollection


def build(pipeline: beam.Pipeline, settings: JobSettings) -> PipelineOutputs:
    """Adds the whole streaming inference graph to ``pipeline``."""
    config, local = settings.config, is_local(pipeline.options)
    # The reader, the admission step and the generate step share the worker's runtime: its engine and admission
    # ledger. The reader pulls only what the ledger has room for; the local runner cannot run it (an unbounded
    # splittable DoFn), so there its own read of the subscription takes places the same way (local/direct_runner.py).
    runtime = SharedRuntime(settings.runtime, new_runtime_tag(settings.runtime))
    messages = _read(pipeline, config, runtime, local)
    parsed = messages | "ParseRequests" >> ParseRequests(settings.limits, config.id_attribute,
                                                         settings.request_defaults)
    measured = parsed.requests | "MeasurePromptLength" >> MeasurePromptLength(settings.prompt_length)
    # Last before the first shuffle, in the reader's fused stage: each request takes the place its read took.
    generate_step = settings.generate_step(local=local)
    admitted = measured.requests | "AdmitRequests" >> AdmitRequests(
        runtime, GenerateKeys(settings.batching, generate_step.generate_shards))
    batches = admitted | "BatchRequests" >> BatchRequests(settings.batching)
    generated = batches.batches | "StreamingGenerate" >> StreamingGenerate(
        settings.runtime, generate_step, runtime=runtime)
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
    dead_letters = failures | "AllDeadLetters" >> beam.Flatten() | "CountDeadLetters" >> beam.ParDo(CountDeadLetters())
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


def _read(pipeline: beam.Pipeline, config: PipelineConfig, runtime: SharedRuntime, local: bool) -> beam.PCollection:
    """The job's messages: its input subscription's (the live lane), and with a ``bulk_subscription`` the bulk
    lane's, marked as such (docs/operations.md#the-bulk-lane)."""
    lanes = [("ReadPrompts", config.input_subscription, False)]
    if config.bulk_subscription:
        lanes.append(("ReadBulkPrompts", config.bulk_subscription, True))
    workers = pipeline.options.view_as(WorkerOptions)
    readers = readers_for(workers.max_num_workers)
    reads = []
    for name, subscription, bulk in lanes:
        if local:
            read = pipeline | name >> ReadFromPubSub(subscription=subscription, with_attributes=True)
            if bulk:
                read = read | "MarkBulk" >> beam.Map(marked_bulk)
        else:
            read = pipeline | name >> ReadWithinRoom(subscription, runtime, readers=readers, bulk=bulk)
        reads.append(read)
    return reads[0] if len(reads) == 1 else reads | "BothLanes" >> beam.Flatten()


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
    settings = JobSettings.from_options(options)  # raises ConfigError before any job exists
    config = settings.config
    apply_launch_defaults(options)
    settings = settings.running(options.view_as(WorkerOptions).sdk_container_image)  # as the launch settled it
    problems, warnings = launch_problems(options, settings, image_cuda_major())
    for warning in warnings:
        LOGGER.warning("Launch check: %s", warning)
    if problems:
        raise ConfigError("This launch would fail:\n  - " + "\n  - ".join(problems))
    options.view_as(StandardOptions).streaming = True
    prepare_tables(config)
    pipeline = beam.Pipeline(options=options)
    build(pipeline, settings)
    return pipeline.run()
