"""Writing results from the pipeline: JSON records to Pub/Sub, with ordering keys if asked.

The template publishes completions and dead letters here (its chunks leave
from the engine: :mod:`pipeline.sinks.chunk_publisher`); a pipeline of your own can
publish ``StreamingGenerate``'s chunks with the request id as ordering key.
Beam's ``WriteToPubSub`` cannot set ordering keys on every runner, so records
are published with the Pub/Sub client directly. Each bundle waits for its
publishes before it commits: a failed publish fails the bundle, which Beam
retries, so nothing is dropped (at-least-once; consumers de-duplicate).

A record Pub/Sub would refuse for what it is (over the 10 MB message limit,
or an ordering key over 1 KB) is not sent: retrying its bundle would never
succeed, so it leaves through the ``dead_letters`` output instead, with the
reason. The template bounds request fields so that this does not happen to
the records it makes; the guard is for records built elsewhere.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.metrics import Metrics

from pipeline.contract.element_guard import TAG_DEAD_LETTERS, dead_letter_for, guarded
from pipeline.contract.messages import STAGE_SINK

LOGGER = logging.getLogger(__name__)
# Pub/Sub's limits: 10 MB a message (data and attributes), 1 KB an ordering key.
MAX_MESSAGE_BYTES = 10_000_000
MAX_ORDERING_KEY_BYTES = 1024


class _PublishJsonFn(beam.DoFn):
    def __init__(self, topic: str, ordering_key: Callable[[dict[str, Any]], str] | None,
                 max_latency_s: float) -> None:
        self._topic = topic
        self._ordering_key = ordering_key
        self._max_latency_s = max_latency_s
        self._publisher: Any = None  # the process's shared client, from setup
        self._futures: list[tuple[Any, str]] = []
        self.published = Metrics.counter("sinks", "published_" + topic.rsplit("/", 1)[-1])
        self.refused = Metrics.counter("sinks", "refused_" + topic.rsplit("/", 1)[-1])

    def setup(self) -> None:
        self._publisher = _publisher(self._ordering_key is not None, self._max_latency_s)

    def start_bundle(self) -> None:
        self._futures = []

    def process(self, record: dict[str, Any]) -> Any:
        return guarded(STAGE_SINK, record, lambda: self._publish(record))

    def _publish(self, record: dict[str, Any]) -> Any:
        data = json.dumps(record, separators=(",", ":")).encode("utf-8")
        key = self._ordering_key(record) if self._ordering_key else ""
        refusal = None
        if len(data) > MAX_MESSAGE_BYTES:
            refusal = f"the record is {len(data)} bytes as JSON; Pub/Sub's limit is {MAX_MESSAGE_BYTES}"
        elif len(key.encode("utf-8")) > MAX_ORDERING_KEY_BYTES:
            refusal = f"its ordering key is over Pub/Sub's limit of {MAX_ORDERING_KEY_BYTES} bytes"
        if refusal:
            self.refused.inc()
            yield pvalue.TaggedOutput(TAG_DEAD_LETTERS, dead_letter_for(
                STAGE_SINK, record, f"not published to {self._topic}: {refusal}"))
            return
        self._futures.append((self._publisher.publish(self._topic, data, ordering_key=key), key))

    def finish_bundle(self) -> None:
        futures, self._futures = self._futures, []
        errors = []
        for future, key in futures:
            try:
                future.result(timeout=120)
                self.published.inc()
            except Exception as exc:
                errors.append(exc)
                if key:
                    self._publisher.resume_publish(self._topic, key)
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(futures)} publishes to {self._topic} failed; "
                               f"the bundle will be retried. First error: {errors[0]}")



# Runners may set up a DoFn per bundle (the DirectRunner does), and a client per bundle is costly:
# per process, publisher clients are shared and kept for its life.
_PUBLISHERS: dict[tuple[bool, float], Any] = {}
_PUBLISHERS_LOCK = threading.Lock()


def _publisher(ordering: bool, max_latency_s: float) -> Any:
    import google.cloud.pubsub_v1 as pubsub_v1

    with _PUBLISHERS_LOCK:
        key = (ordering, max_latency_s)
        if key not in _PUBLISHERS:
            publisher = pubsub_v1.PublisherClient(
                batch_settings=pubsub_v1.types.BatchSettings(max_latency=max_latency_s),
                publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=ordering))
            atexit.register(publisher.stop)
            _PUBLISHERS[key] = publisher
        return _PUBLISHERS[key]


class PublishJson(beam.PTransform):
    """Publishes each dict as a JSON message to ``topic``; returns the records it could not, as dead letters.

    ``ordering_key`` maps a record to its Pub/Sub ordering key (for example the
    request id, so a subscriber with ordering enabled sees one request's chunks
    in order).
    """

    def __init__(self, topic: str, *, ordering_key: Callable[[dict[str, Any]], str] | None = None,
                 max_latency_s: float = 0.005) -> None:
        super().__init__()
        self._topic = topic
        self._ordering_key = ordering_key
        self._max_latency_s = max_latency_s

    def expand(self, records):
        return (records | beam.ParDo(_PublishJsonFn(self._topic, self._ordering_key, self._max_latency_s))
                .with_outputs(TAG_DEAD_LETTERS, main="published"))[TAG_DEAD_LETTERS]
