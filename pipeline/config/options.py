"""The template's parameters as Beam options and as one validated, typed :class:`PipelineConfig`.

Both are generated from :data:`~pipeline.contract.parameters.PARAMETERS`. Plain Beam/Dataflow options (runner,
machine type, sdk_container_image, ...) are not redeclared: they pass through to Beam. Each value is converted and
checked on its own, then the combinations; :class:`~pipeline.config.settings.JobSettings` turns the result into
every component's settings. A value that a settings record owns is checked by that record instead, when it is
built, so each value is checked once.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.contract.parameter_checks import (
    CHECKED_BY_RECORDS,
    ENGINE_RECORDS,
    NOT_WITH_TRANSFORMERS,
    not_with_transformers,
)
from pipeline.contract.parameters import ALSO_REQUIRED, DEAD_LETTER_PARAMETERS, OUTPUT_PARAMETERS, PARAMETERS
from pipeline.serving.lora_adapters import VLLM_LORA_RANKS

# vLLM server flags that a template parameter (or the model manager) sets: inside vllm_args they would silently
# override it while the pipeline went on using the parameter's value (checking prompts against max_model_len, say).
VLLM_FLAGS_OWNED = {
    "--model": "--model or --model_gcs_folder", "--served-model-name": "--served_model_name",
    "--max-model-len": "--max_model_len", "--dtype": "--dtype",
    "--gpu-memory-utilization": "--gpu_memory_utilization",
    "--host": "nothing: the model manager serves on loopback", "--port": "nothing: the model manager picks a free port",
    "--enable-lora": "--lora_adapters", "--lora-modules": "--lora_adapters", "--max-lora-rank": "--max_lora_rank",
    "--max-loras": "--max_loras",
}


class ConfigError(ValueError):
    """Invalid pipeline configuration; the message says what to change."""


class StreamingLLMOptions(PipelineOptions):
    """Beam options generated from :data:`PARAMETERS`."""

    @classmethod
    def _add_argparse_args(cls, parser: argparse.ArgumentParser) -> None:
        for param in PARAMETERS:
            choices = param.enum_options or None
            parser.add_argument(f"--{param.name}", type=param.convert, default=param.default,
                                choices=choices, help=f"{param.help_text} Example: {param.example}")


@dataclass(frozen=True)
class PipelineConfig:
    """Validated, typed parameter values: what :class:`~pipeline.config.settings.JobSettings` is built from."""

    input_subscription: str
    bulk_subscription: str | None
    live_reserve: float
    max_bulk_streams: int
    live_first_token_slo_ms: int
    live_inter_token_slo_ms: int
    id_attribute: str
    dedupe_window_s: int
    output_chunks_topic: str | None
    output_completions_topic: str | None
    output_completions_table: str | None
    output_chunks_table: str | None
    dead_letter_topic: str | None
    dead_letter_table: str | None
    bigquery_create_tables: bool
    model: str
    hf_token_secret: str | None
    engine: str
    model_gcs_folder: str | None
    server_url: str | None
    served_model_name: str | None
    prompt_format: str
    max_model_len: int
    dtype: str
    gpu_memory_utilization: float
    vllm_args: str
    lora_adapters: str | None
    lora_adapter_root: str | None
    lora_base_model_check: bool
    lora_base_model: str
    lora_adapter_disk_gb: int
    max_lora_rank: int
    max_loras: int
    server_start_timeout_s: int
    default_max_tokens: int
    max_in_flight: int
    request_timeout_s: int
    stream_lease_s: int
    worker_queue: int
    drain_timeout_s: int
    system_prompt: str | None
    prompt_template: str | None
    response_schema: str | None
    length_bucketing: bool
    bucket_boundaries: str
    answer_bucket_boundaries: str
    length_estimator: str
    prioritize_short_prompts: bool
    max_batch_delay_ms: int
    batch_size_target: int
    batch_token_budget: int | None
    num_shards: int
    generate_shards: int | None
    chunk_tokens: int
    chunk_interval_ms: int

    @classmethod
    def from_options(cls, options: PipelineOptions) -> PipelineConfig:
        values = options.view_as(StreamingLLMOptions).get_all_options()
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> PipelineConfig:
        """Converts (string or typed) values, fills defaults and validates them all at once; the values a settings
        record checks (:data:`~pipeline.contract.parameter_checks.CHECKED_BY_RECORDS`) are checked when
        :class:`~pipeline.config.settings.JobSettings` builds it."""
        config, problems = cls.read(values)
        if problems:
            raise ConfigError("Invalid pipeline configuration:\n  - " + "\n  - ".join(problems))
        return config

    @classmethod
    def read(cls, values: dict[str, Any]) -> tuple[PipelineConfig, list[str]]:
        """The config and what is wrong with it, for a caller that reports its own problems with these: a value
        that is missing or cannot be converted is left at its default."""
        problems: list[str] = []
        fields: dict[str, Any] = {}
        unread: set[str] = set()  # not converted, or refused on its own: left out of the combinations
        for param in PARAMETERS:
            raw = values.get(param.name)
            fields[param.name] = param.default  # unset: the default, already typed (and tested against its regex)
            if raw is None or raw == "":
                if param.required:
                    problems.append(f"--{param.name} is required ({param.label}), e.g. --{param.name}={param.example}")
                continue
            try:
                fields[param.name] = param.convert(raw)
            except argparse.ArgumentTypeError as exc:
                problems.append(f"--{param.name}: {exc}")
                unread.add(param.name)
                continue
            own = [] if param.name in CHECKED_BY_RECORDS else param.problems(fields[param.name])
            problems.extend(own)
            if own:
                unread.add(param.name)
        problems.extend(_check_combinations({name: value for name, value in fields.items() if name not in unread}))
        return cls(**fields), problems

    @property
    def extra_vllm_args(self) -> list[str]:
        return shlex.split(self.vllm_args or "")

    @property
    def effective_model(self) -> str:
        """What the model manager loads: the Cloud Storage folder if one is given."""
        return self.model_gcs_folder or self.model


def _check_combinations(fields: dict[str, Any]) -> list[str]:
    problems = []
    missing = [what for what, names in (("no output is configured", OUTPUT_PARAMETERS),
                                        ("no dead-letter output is configured", DEAD_LETTER_PARAMETERS))
               if not any(fields.get(name) for name in names)]
    if missing:
        problems.append(f"{' and '.join(missing)}. {ALSO_REQUIRED}")
    if fields.get("bulk_subscription") and fields.get("bulk_subscription") == fields.get("input_subscription"):
        problems.append("--bulk_subscription is the input_subscription: give the bulk lane a subscription of its own "
                        "(to a topic of its own), or leave it empty for one lane")
    if fields.get("engine") == "transformers":
        problems.extend(not_with_transformers(name) for name in NOT_WITH_TRANSFORMERS
                        if fields.get(name) and CHECKED_BY_RECORDS.get(name) not in ENGINE_RECORDS)
        if (fields.get("batch_size_target") or 0) > (fields.get("max_in_flight") or 0):
            problems.append(f"--batch_size_target ({fields['batch_size_target']}) must be at most --max_in_flight "
                            f"({fields['max_in_flight']}) with --engine=transformers: it generates each batch whole, "
                            "so a larger batch would run more requests at once than max_in_flight allows")
    for name in ("lora_adapters", "lora_adapter_root"):
        if fields.get("server_url") and fields.get(name):
            problems.append(f"--{name} does not go with --server_url: the server you run loads its own adapters "
                            "(vLLM: --lora-modules), and each request's 'adapter' is sent to it as the model")
    if fields.get("lora_adapter_root") and fields.get("max_loras") is not None:
        static = len([item for item in (fields.get("lora_adapters") or "").split(",") if item.strip()])
        if fields["max_loras"] <= static:
            problems.append(f"--lora_adapter_root needs --max_loras above the number of --lora_adapters ({static}): "
                            "a worker keeps max_loras adapters loaded, those of lora_adapters first; raise it to "
                            f"{static + 1} or more")
    if fields.get("max_lora_rank") is not None and fields["max_lora_rank"] not in VLLM_LORA_RANKS:
        problems.append(f"--max_lora_rank must be one of {', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's choices), "
                        f"got {fields['max_lora_rank']}")
    problems.extend(_vllm_args_problems(fields.get("vllm_args") or ""))
    problems.extend(_scheduling_problems(fields))
    if "default_max_tokens" in fields and "max_model_len" in fields and \
            fields["default_max_tokens"] >= fields["max_model_len"]:
        problems.append(f"--default_max_tokens ({fields['default_max_tokens']}) must be below "
                        f"--max_model_len ({fields['max_model_len']})")
    return problems


def _scheduling_problems(fields: dict[str, Any]) -> list[str]:
    """A ``--scheduling-policy`` in ``vllm_args`` other than ``priority`` on a worker whose requests carry vLLM
    priorities (a bulk lane, shorter prompts first): vLLM refuses every request with a priority its policy does not
    use, so every one would be a dead letter."""
    if fields.get("engine", "vllm") != "vllm" or fields.get("server_url"):
        return []
    why = [what for name, what in (("bulk_subscription", "a bulk_subscription"),
                                   ("prioritize_short_prompts", "prioritize_short_prompts"))
           if fields.get(name)]
    try:
        args = shlex.split(fields.get("vllm_args") or "")
    except ValueError:
        return []  # said by _vllm_args_problems
    policy = None
    for n, arg in enumerate(args):  # the last one counts, as vLLM's argument parser takes it
        flag, equals, value = arg.partition("=")
        if flag.replace("_", "-") == "--scheduling-policy":
            policy = value if equals else (args[n + 1] if n + 1 < len(args) else "")
    if policy is not None and policy != "priority" and why:
        return [f"--vllm_args sets --scheduling-policy {policy}, but with {' and with '.join(why)} the template "
                "sends each request a vLLM priority, which vLLM refuses under any policy but priority (every "
                "request would be a dead letter): drop the flag (the template sets priority) or set it to "
                "priority"]
    return []


def _vllm_args_problems(vllm_args: str) -> list[str]:
    """Flags in ``vllm_args`` that a template parameter owns (vLLM reads '_' and '-' alike in flag names)."""
    try:
        args = shlex.split(vllm_args)
    except ValueError as exc:
        return [f"--vllm_args cannot be split into flags: {exc}"]
    problems = []
    for arg in args:
        flag = arg.split("=", 1)[0].replace("_", "-")
        if flag in VLLM_FLAGS_OWNED:
            problems.append(f"--vllm_args sets {arg.split('=', 1)[0]}, which the template sets itself; "
                            f"use {VLLM_FLAGS_OWNED[flag]} instead")
    return problems
