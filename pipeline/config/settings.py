"""The one room that turns a :class:`~pipeline.config.options.PipelineConfig` into every component's settings.

Each stage takes one settings record, and each is built here, once: the request limits and template defaults
(intake), the prompt-length measure, the batching (flow), the engine's settings with the vLLM server's spec
(engines, serving), the worker runtime's admission and call settings (worker) and the generate step's. The LoRA
adapters are parsed here, once. A parameter goes forward through the house: declared in
:mod:`pipeline.contract.parameters`, converted by :class:`PipelineConfig`, turned into a component's settings here,
checked once (by the record that owns it, else by the config), acted on by the component; :mod:`pipeline.assembly`
only wires transforms from a :class:`JobSettings`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from apache_beam.options.pipeline_options import DebugOptions, PipelineOptions

from pipeline.config.options import ConfigError, PipelineConfig, StreamingLLMOptions
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.parameter_checks import ParameterProblems
from pipeline.contract.parameters import DATAFLOW_GENERATE_SHARDS, WORKER_OPTIONS_BY_NAME
from pipeline.contract.request_parsing import RequestLimits
from pipeline.engines.engine_settings import EngineSettings, priority_scheduling
from pipeline.flow.batching import BatchingConfig, default_boundaries, parse_boundaries
from pipeline.generation.generate_settings import GenerateSettings
from pipeline.intake.prompt_length import PromptLength
from pipeline.intake.request_defaults import RequestDefaults
from pipeline.serving.adapter_root import AdapterRoot
from pipeline.serving.lora_adapters import Adapter, parse_adapters
from pipeline.serving.vllm_server import ServerSpec
from pipeline.worker.runtime_settings import AdmissionSettings, CallSettings, RuntimeSettings

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


@dataclass(frozen=True)
class JobSettings:
    """Every component's settings for one job, built once from its configuration."""

    config: PipelineConfig  # the input and outputs (subscription, topics, tables), which assembly wires as named
    limits: RequestLimits
    request_defaults: RequestDefaults
    prompt_length: PromptLength
    batching: BatchingConfig
    engine: EngineSettings
    admission: AdmissionSettings
    calls: CallSettings
    generate: GenerateSettings  # generate_shards as set; None: by runner (generate_step)
    adapters: tuple[Adapter, ...]
    adapter_root: AdapterRoot | None

    @property
    def runtime(self) -> RuntimeSettings:
        """What each worker's runtime is built from: the engine's, admission's and the call settings."""
        return RuntimeSettings(self.engine, self.admission, self.calls)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> JobSettings:
        """Reads the values and builds every record; raises :class:`ConfigError` with every problem found, before any
        job exists.

        ``number_of_worker_harness_threads``, Beam's option, as the launch sets it (None: the template's default,
        which the launch then sets, :mod:`pipeline.config.launch_checks`). The worker image is set once the launch
        has settled it (:meth:`running`).
        """
        config, problems = PipelineConfig.read(values)
        return cls._build(config, values.get("number_of_worker_harness_threads"), problems)

    @classmethod
    def from_options(cls, options: PipelineOptions) -> JobSettings:
        values = options.view_as(StreamingLLMOptions).get_all_options()
        config, problems = PipelineConfig.read(values)
        return cls._build(config, options.view_as(DebugOptions).number_of_worker_harness_threads, problems)

    @classmethod
    def _build(cls, config: PipelineConfig, harness_threads: Any, problems: list[str]) -> JobSettings:
        """Each record checks the values it owns as it is built (``CHECKED_BY_RECORDS``, in
        :mod:`pipeline.contract.parameter_checks`); their problems join the config's in one error."""
        problems = list(problems)
        parts: dict[str, Any] = {}

        def build(name: str, make: Callable[[], Any]) -> None:
            try:
                parts[name] = make()
            except ParameterProblems as exc:
                problems.extend(exc.args)
            except ValueError as exc:
                problems.extend(str(exc).split("; "))

        for name, make in (("batching", _batching), ("request_defaults", _request_defaults),
                           ("adapters", _adapters), ("adapter_root", _adapter_root), ("admission", _admission),
                           ("generate", _generate)):
            build(name, partial(make, config))
        build("calls", partial(_calls, harness_threads))
        # Built even when a part it reads was refused (with that part's defaults), so its own problems are listed too.
        build("engine", partial(_engine, config, parts.get("batching", BatchingConfig()), parts.get("adapters", ()),
                                parts.get("adapter_root")))
        if problems:
            raise ConfigError("Invalid pipeline configuration:\n  - " + "\n  - ".join(problems))
        # A server_url server decides which adapters it serves; the model manager's serves lora_adapters.
        names = None if config.server_url else tuple(adapter.name for adapter in parts["adapters"])
        limits = RequestLimits(default_max_tokens=config.default_max_tokens, max_model_len=config.max_model_len,
                               adapters=names, adapter_root=parts["adapter_root"] is not None)
        estimator = config.length_estimator
        if estimator == "auto":
            estimator = "chars" if config.server_url else "tokenizer"
        prompt_length = PromptLength(estimator, config.effective_model, config.prompt_format,
                                     config.max_model_len, config.hf_token_secret)
        return cls(config=config, limits=limits, prompt_length=prompt_length, **parts)

    def running(self, image: str | None) -> JobSettings:
        """These settings for workers that run ``image`` (named in every completion's lineage)."""
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, image=image))

    def generate_step(self, local: bool) -> GenerateSettings:
        """The generate step's settings as this runner runs it: ``generate_shards`` is what it re-keys batches to
        (:meth:`rekey_shards`)."""
        return dataclasses.replace(self.generate, generate_shards=self.rekey_shards(local))

    def generate_keys(self, local: bool) -> int:
        """The generate step's key count: as set, else by runner (see the ``generate_shards`` parameter's help)."""
        return self.generate.generate_shards or (self.batching.num_shards if local else DATAFLOW_GENERATE_SHARDS)

    def rekey_shards(self, local: bool) -> int | None:
        """How many generate shards the generate step re-keys batches to; None to keep the batcher's keys.

        The batcher's shard already is hash(id) mod num_shards, so with as many generate keys re-keying would only
        add a step (a hop on the DirectRunner, which fuses nothing); and a static batch is the transformers
        engine's unit of work: it stays whole, on its batcher key.
        """
        keys = self.generate_keys(local)
        return None if keys == self.batching.num_shards or self.config.engine != "vllm" else keys


def _batching(config: PipelineConfig) -> BatchingConfig:
    boundaries: tuple[int, ...] = ()
    answer_boundaries: tuple[int, ...] = ()
    if config.length_bucketing:
        boundaries = (parse_boundaries(config.bucket_boundaries) if config.bucket_boundaries.strip()
                      else default_boundaries(config.max_model_len))
        answers = config.answer_bucket_boundaries.strip()
        if answers and answers != "none":
            answer_boundaries = parse_boundaries(answers)
        elif not answers and config.engine == "transformers":
            answer_boundaries = default_boundaries(config.max_model_len, smallest=16)
    return BatchingConfig(max_batch_delay_ms=float(config.max_batch_delay_ms),
                          batch_size_target=config.batch_size_target, token_budget=config.batch_token_budget,
                          boundaries=boundaries, num_shards=config.num_shards, answer_boundaries=answer_boundaries,
                          default_max_tokens=config.default_max_tokens)


def _admission(config: PipelineConfig) -> AdmissionSettings:
    # An admitted request reaches the generate step after the shuffle and its batch's wait.
    return AdmissionSettings(worker_queue=config.worker_queue, transit_s=1.0 + config.max_batch_delay_ms / 1000.0)


def _generate(config: PipelineConfig) -> GenerateSettings:
    return GenerateSettings(dedupe_window_s=float(config.dedupe_window_s),
                            drain_timeout_s=float(config.drain_timeout_s), generate_shards=config.generate_shards,
                            engine=config.engine)


def _calls(harness_threads: Any) -> CallSettings:
    """The runtime calls' settings for Beam's ``number_of_worker_harness_threads`` as the launch sets it (None or
    empty: the template's default)."""
    if harness_threads in (None, ""):
        return CallSettings()
    parameter = WORKER_OPTIONS_BY_NAME["number_of_worker_harness_threads"]
    try:
        return CallSettings(harness_threads=parameter.convert(harness_threads))
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--{parameter.name}: {exc}") from exc


def _request_defaults(config: PipelineConfig) -> RequestDefaults:
    return RequestDefaults(system_prompt=config.system_prompt or None, prompt_template=config.prompt_template or None,
                           response_schema=config.response_schema or None, prompt_format=config.prompt_format)


def _adapters(config: PipelineConfig) -> tuple[Adapter, ...]:
    if not config.lora_adapters:
        return ()
    adapters = parse_adapters(config.lora_adapters)
    base = config.served_model_name or config.effective_model
    if any(adapter.name == base for adapter in adapters):
        raise ValueError(f"--lora_adapters: an adapter is named {base!r}, the model's own name; rename it")
    return adapters


def _adapter_root(config: PipelineConfig) -> AdapterRoot | None:
    return AdapterRoot(config.lora_adapter_root) if config.lora_adapter_root else None


def _priority_boundaries(config: PipelineConfig, batching: BatchingConfig) -> tuple[int, ...] | None:
    """Length-bucket bounds that set each request's priority, or None for no priorities."""
    if not config.prioritize_short_prompts or config.server_url or config.engine != "vllm":
        return None
    return batching.boundaries or default_boundaries(config.max_model_len)


def _engine(config: PipelineConfig, batching: BatchingConfig, adapters: tuple[Adapter, ...],
            adapter_root: AdapterRoot | None) -> EngineSettings:
    priority_boundaries = _priority_boundaries(config, batching)
    # The chunks topic is published by the engine itself (pipeline.sinks.chunk_publisher); chunks pass
    # through the pipeline only when a BigQuery chunks table wants them too.
    common: dict[str, Any] = dict(
                  engine=config.engine, served_model_name=config.served_model_name, prompt_format=config.prompt_format,
                  max_in_flight=config.max_in_flight, request_timeout_s=float(config.request_timeout_s),
                  stream_lease_s=float(config.stream_lease_s),
                  chunk_policy=ChunkPolicy(config.chunk_tokens, float(config.chunk_interval_ms)),
                  priority_boundaries=priority_boundaries, bulk_lane=bool(config.bulk_subscription),
                  live_reserve=config.live_reserve, max_bulk_streams=config.max_bulk_streams,
                  live_first_token_slo_ms=float(config.live_first_token_slo_ms),
                  live_inter_token_slo_ms=float(config.live_inter_token_slo_ms),
                  chunk_topic=config.output_chunks_topic,
                  chunks_to_pipeline=not config.output_chunks_topic or bool(config.output_chunks_table))
    if config.server_url:
        return EngineSettings(server=None, server_url=config.server_url, **common)
    extra_args = tuple(config.extra_vllm_args)
    if priority_scheduling(config.engine, True, priority_boundaries, bool(config.bulk_subscription)) \
            and "--scheduling-policy" not in extra_args:
        extra_args += ("--scheduling-policy", "priority")
    extra_args = COMPACT_JSON_ARGS + extra_args if compact_json_by_default(extra_args) else extra_args
    spec = ServerSpec(
        model=config.effective_model, max_model_len=config.max_model_len, dtype=config.dtype,
        gpu_memory_utilization=config.gpu_memory_utilization, extra_args=extra_args,
        served_model_name=config.served_model_name, start_timeout_s=float(config.server_start_timeout_s),
        adapters=adapters, adapter_root=adapter_root, lora_base_model_check=config.lora_base_model_check,
        lora_base_model=config.lora_base_model or None,
        adapter_disk_gb=float(config.lora_adapter_disk_gb),
        max_lora_rank=config.max_lora_rank, max_loras=config.max_loras,
        hf_token_secret=config.hf_token_secret)
    return EngineSettings(server=spec, **common)
