"""Reading requests: Pub/Sub messages in, valid requests and dead letters out."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.metrics import Metrics

from pipeline.contract.element_guard import TAG_DEAD_LETTERS, guarded
from pipeline.contract.messages import STAGE_PARSE, DeadLetter
from pipeline.contract.parameters import default
from pipeline.contract.request_parsing import Defaults, RequestLimits, parse_request


class ParseFn(beam.DoFn):
    """The parse step's DoFn (:class:`ParseRequests`): each message, guarded, to a request or a dead letter."""

    def __init__(self, limits: RequestLimits, id_attribute: str, defaults: Defaults | None) -> None:
        self._limits = limits
        self._id_attribute = id_attribute
        self._defaults = defaults
        self.accepted = Metrics.counter("parse", "accepted")
        self.rejected = Metrics.counter("parse", "rejected")

    def process(self, message: PubsubMessage | bytes) -> Iterator[Any]:
        return guarded(STAGE_PARSE, message, lambda: self._parse(message))

    def _parse(self, message: PubsubMessage | bytes) -> Iterator[Any]:
        if isinstance(message, PubsubMessage):
            data, attributes, message_id = message.data, message.attributes, message.message_id
        else:
            data, attributes, message_id = message, {}, None
        parsed = parse_request(data or b"", attributes, message_id, limits=self._limits,
                               id_attribute=self._id_attribute, defaults=self._defaults)
        if isinstance(parsed, DeadLetter):
            self.rejected.inc()
            yield pvalue.TaggedOutput(TAG_DEAD_LETTERS, parsed.to_record())
        else:
            self.accepted.inc()
            yield parsed


class ParseRequests(beam.PTransform):
    """``PubsubMessage`` (or raw bytes) in; ``requests`` and ``dead_letters`` out.

    ``requests`` holds :class:`~pipeline.contract.messages.InferenceRequest` objects;
    ``dead_letters`` holds dead-letter dicts with the raw payload and the reason.
    ``defaults`` (a :class:`~pipeline.intake.request_defaults.RequestDefaults`) applies a
    system prompt, prompt template and response schema to every message.
    """

    def __init__(self, limits: RequestLimits = RequestLimits(), id_attribute: str = default("id_attribute"),
                 defaults: Defaults | None = None) -> None:
        super().__init__()
        self._limits = limits
        self._id_attribute = id_attribute
        self._defaults = defaults

    def expand(self, messages):
        parse = ParseFn(self._limits, self._id_attribute, self._defaults)
        return messages | "Parse" >> beam.ParDo(parse).with_outputs(
            TAG_DEAD_LETTERS, main="requests")
