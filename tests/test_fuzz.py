"""Fuzzing the input stages: any message ends as exactly one request or one dead letter, and nothing raises.

The pure parser is fuzzed with thousands of examples; the real stages
(``ParseRequests`` → ``MeasurePromptLength`` with the model's own tokenizer →
``BatchRequests``) are fuzzed in a Beam pipeline, where an exception would fail
the pipeline.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict

import apache_beam as beam
import pytest
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.contract.messages import DeadLetter, InferenceRequest
from pipeline.contract.request_parsing import RequestLimits, parse_request
from pipeline.flow.batching import BatchingConfig, BatchRequests
from pipeline.intake.parsing import ParseRequests
from pipeline.intake.prompt_length import MeasurePromptLength, PromptLength
from tests.hostile_inputs import attributes, hostile_corpus, payloads

LIMITS = RequestLimits(default_max_tokens=64, max_model_len=2048, adapters=("support", "extract"))


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=payloads, attrs=attributes)
def test_the_parser_answers_every_payload_with_a_request_or_a_dead_letter(data, attrs):
    result = parse_request(data, attrs, "m-1", limits=LIMITS)
    assert isinstance(result, (InferenceRequest, DeadLetter))
    if isinstance(result, DeadLetter):
        assert result.stage in ("parse", "validate") and result.reason
        record = json.loads(result.to_json())  # publishable as it stands
        assert record["payload"] or not data.strip()
    else:
        # Whatever was accepted can be serialised, published and encoded as valid UTF-8.
        result.to_json().encode("utf-8")
        assert InferenceRequest.from_json(result.to_json()) == result
        assert len(result.id.encode("utf-8")) <= 512
        assert result.adapter in (None, *LIMITS.adapters)


_OUTCOMES: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))


class _Record(beam.DoFn):
    def __init__(self, run_id: str, kind: str) -> None:
        self._run_id, self._kind = run_id, kind

    def process(self, element):
        _OUTCOMES[self._run_id][self._kind].append(element)


def run_input_stages(messages: list[PubsubMessage], model_dir: str) -> dict[str, list]:
    """The template's input stages, as assembled, over ``messages`` in a batch pipeline."""
    run_id = uuid.uuid4().hex
    with beam.Pipeline(options=PipelineOptions(flags=[], runner="BundleBasedDirectRunner")) as pipeline:
        parsed = pipeline | beam.Create(messages, reshuffle=False) | ParseRequests(LIMITS)
        measured = parsed.requests | MeasurePromptLength(PromptLength(
            estimator="tokenizer", model=model_dir, max_model_len=LIMITS.max_model_len))
        batched = measured.requests | BatchRequests(BatchingConfig(boundaries=(16, 64, 256), num_shards=4))
        batched.batches | beam.FlatMap(lambda batch: batch[1]) | "Requests" >> beam.ParDo(_Record(run_id, "requests"))
        ((parsed.dead_letters, measured.dead_letters, batched.dead_letters) | beam.Flatten()
         | "DeadLetters" >> beam.ParDo(_Record(run_id, "dead_letters")))
    return _OUTCOMES.pop(run_id, {"requests": [], "dead_letters": []})


def assert_one_outcome_each(messages: list[PubsubMessage], outcomes: dict[str, list]) -> None:
    requests, letters = outcomes.get("requests", []), outcomes.get("dead_letters", [])
    assert len(requests) + len(letters) == len(messages), (len(requests), len(letters), len(messages))
    for letter in letters:
        assert letter["stage"] in ("parse", "validate", "measure", "batch") and letter["reason"]
        json.dumps(letter)  # publishable
    # Parse-stage dead letters carry their message's attributes: each message at most once.
    seqs = [letter["attributes"]["fuzz_seq"] for letter in letters if "fuzz_seq" in letter["attributes"]]
    assert len(seqs) == len(set(seqs))


def as_messages(drawn: list[tuple[bytes, dict[str, str]]]) -> list[PubsubMessage]:
    return [PubsubMessage(data, {**attrs, "fuzz_seq": str(i)}, message_id=f"fuzz-{i}")
            for i, (data, attrs) in enumerate(drawn)]


@pytest.mark.engine  # needs the model's tokenizer (the converted local checkpoint)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(st.tuples(payloads, attributes), min_size=1, max_size=40))
def test_the_input_stages_in_a_pipeline_never_fail_and_answer_each_message_once(drawn, checkpoint):
    messages = as_messages(drawn)
    assert_one_outcome_each(messages, run_input_stages(messages, str(checkpoint)))


@pytest.mark.engine
def test_the_seeded_hostile_corpus_through_the_input_stages(checkpoint):
    messages = as_messages(hostile_corpus(seed=7, size=300))
    outcomes = run_input_stages(messages, str(checkpoint))
    assert_one_outcome_each(messages, outcomes)
    assert outcomes["dead_letters"], "the corpus is meant to be mostly refused"
