"""Do structured answers come back whole? Compact JSON (the template's default) against free whitespace.

Each record set of :mod:`benchmarks.structured_records` (reviews to classify,
order notes to extract from) goes through the template's own request parsing
(system prompt, prompt template and response schema applied as template
parameters, the default answer budget) and the real streaming engine, against
two managed vLLM servers built by the template's option path: one with the
template's default (``disable_any_whitespace``), one with vLLM's default (free
whitespace between JSON tokens, what the template did before). Sets alternate
between the servers in one run. Printed per set and server: answers that parse
and validate against the schema, answers cut at ``max_tokens``, and output
tokens per answer. Figures only; nothing is asserted.

    python -m benchmarks.structured_output
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics

from benchmarks.structured_records import RECORD_SETS, RecordSet
from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from local.engine_driver import drive_to_end
from pipeline.config.settings import JobSettings
from pipeline.contract.messages import DeadLetter, InferenceRequest
from pipeline.contract.request_parsing import parse_request
from pipeline.engines.engine import Engine
from pipeline.engines.vllm_engine import vllm_engine

SERVED = "smollm2"
FREE_WHITESPACE = "--structured-outputs-config.disable_any_whitespace false"
SETTINGS = {"free whitespace (vLLM's default)": FREE_WHITESPACE, "compact JSON (the template's default)": ""}


def config(record_set: RecordSet | None, vllm_args: str) -> JobSettings:
    values = {"input_subscription": "projects/local-project/subscriptions/unused",
              "output_completions_topic": "projects/local-project/topics/unused",
              "dead_letter_topic": "projects/local-project/topics/unused",
              "model": str(ensure_local_checkpoint()), "served_model_name": SERVED, "dtype": LOCAL_SERVER.dtype,
              "vllm_args": " ".join([*LOCAL_SERVER.vllm_args, vllm_args]), "max_in_flight": 16}
    if record_set is not None:
        values.update(system_prompt=record_set.system_prompt, prompt_template=record_set.prompt_template,
                      response_schema=json.dumps(record_set.schema))
    return JobSettings.from_mapping(values)


def requests(record_set: RecordSet, job: JobSettings) -> list[InferenceRequest]:
    parsed = [parse_request(record.encode(), {"id": f"r{i}"}, limits=job.limits, defaults=job.request_defaults)
              for i, record in enumerate(record_set.records)]
    rejected = [p for p in parsed if isinstance(p, DeadLetter)]
    if rejected:
        raise RuntimeError(f"records the template refuses: {rejected}")
    return parsed


def run(engine: Engine, batch: list[InferenceRequest], timeout_s: float = 900) -> list[dict]:
    """Every request's completion, submitted as the pipeline does (again when the engine is full)."""
    drive = drive_to_end(engine, batch, timeout_s=timeout_s)
    if drive.dead_letters():
        raise RuntimeError(f"a request became a dead letter: {drive.dead_letters()[0]}")
    return drive.completions()


def describe(completions: list[dict]) -> str:
    valid = sum(c["output_json"] is not None for c in completions)
    cut = sum(c["finish_reason"] == "length" for c in completions)
    tokens = [c["usage"]["completion_tokens"] for c in completions]
    return (f"{valid:3}/{len(completions)} valid  {cut:3}/{len(completions)} cut at max_tokens  "
            f"tokens per answer: median {statistics.median(tokens):5.1f}, mean {statistics.mean(tokens):5.1f}, "
            f"max {max(tokens)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    apply_server_environment()
    engines = {label: vllm_engine(config(None, args).engine) for label, args in SETTINGS.items()}
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        for index, record_set in enumerate(RECORD_SETS):
            order = list(engines) if index % 2 == 0 else list(reversed(engines))
            for label in order:
                cfg = config(record_set, SETTINGS[label])
                results[(record_set.name, label)] = run(engines[label], requests(record_set, cfg))
                print(f"  {record_set.name}, {label}: done", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    cfg = config(None, "")
    print(f"\nEmbedded model (SmolLM2-135M-Instruct, {LOCAL_SERVER.label}), the server's default sampling, "
          f"the template's default answer budget {cfg.config.default_max_tokens} tokens:")
    for (name, label), completions in results.items():
        print(f"{name:18} {label:38} {describe(completions)}")
    for label in SETTINGS:
        every = [c for (_, lab), cs in results.items() if lab == label for c in cs]
        print(f"{'all records':18} {label:38} {describe(every)}")


if __name__ == "__main__":
    main()
