"""Who checks each template parameter's value, and how: once, by the settings record that owns it, or by the options.

:mod:`pipeline.contract.parameters` declares each parameter's choices and bounds (``Parameter.problems``); this
module says which record applies them to which value (:data:`CHECKED_BY_RECORDS`), which parameters the
transformers engine refuses, and the error a record raises, one sentence per problem, so that a launch lists them
with the options' (:mod:`pipeline.config.settings`).
"""

from __future__ import annotations

from typing import Any

from pipeline.contract.parameters import PARAMETERS_BY_NAME, WORKER_OPTIONS_BY_NAME

# The template's parameters and Beam's worker options that the console's form shows, each by name.
_DECLARED = {**PARAMETERS_BY_NAME, **WORKER_OPTIONS_BY_NAME}

# Parameters that do not go with engine=transformers, and why: the options (or, for those in CHECKED_BY_RECORDS, the
# record that owns the value) refuse them in these words.
NOT_WITH_TRANSFORMERS: dict[str, str] = {
    "server_url": "it loads the model in the workers, so there is no server to call",
    "response_schema": "it cannot constrain answers to a schema",
    "generate_shards": "it generates each batch whole, on its batching key",
    "lora_adapters": "it serves the model alone, without adapters",
    "lora_adapter_root": "it serves the model alone, without adapters",
    "bulk_subscription": "it generates each batch whole, in the order batches come, so a backfill's batches would "
                         "hold live requests back",
}


# The settings record that checks each of these values as it is built, against its declared choices and bounds (and,
# where the record knows the engine, ENGINE_RECORDS, whether it goes with it: NOT_WITH_TRANSFORMERS). A pipeline of
# one's own that builds the record gets the same errors, and a launch gets them from the same line: the options check
# every other value, so each is checked once (pipeline.config.options, pipeline.config.settings).
CHECKED_BY_RECORDS: dict[str, str] = {
    **dict.fromkeys(("engine", "server_url", "max_in_flight", "stream_lease_s", "live_reserve"), "EngineSettings"),
    **dict.fromkeys(("max_batch_delay_ms", "batch_size_target", "batch_token_budget", "num_shards"), "BatchingConfig"),
    "worker_queue": "AdmissionSettings",
    **dict.fromkeys(("dedupe_window_s", "drain_timeout_s", "generate_shards"), "GenerateSettings"),
    "lora_adapter_root": "AdapterRoot",
}
ENGINE_RECORDS = ("EngineSettings", "GenerateSettings")


def not_with_transformers(name: str) -> str:
    """Why parameter ``name`` is refused with engine=transformers, and what to do instead."""
    return f"--{name} does not go with --engine=transformers: {NOT_WITH_TRANSFORMERS[name]}; use --engine=vllm"


class ParameterProblems(ValueError):
    """What is wrong with a settings record's values, one sentence each (``args``), so that the job's settings list
    them with every other problem of a launch."""

    def __str__(self) -> str:
        return "; ".join(map(str, self.args))


def check_parameters(values: dict[str, Any]) -> None:
    """Raises :class:`ParameterProblems` naming every value outside its parameter's (or worker option's) declared
    choices and bounds."""
    problems = [problem for name, value in values.items() for problem in _DECLARED[name].problems(value)]
    if problems:
        raise ParameterProblems(*problems)
