"""Chunks straight from the engine to Pub/Sub: no Beam hop between a token and its consumer.

Through Beam, a chunk cut by the engine waited for the generate step's next
poll timer, then for the publish step's bundle: two commits (on Streaming
Engine, two paid round trips) before a consumer saw the first token. Here the
worker's engine publishes each chunk the moment it is cut, with one client per
worker, the request id as ordering key and a 1 ms batching latency.

Nothing is weaker than through Beam:

* Order: chunks of a request are published in ``seq`` order, under the
  engine's lock, with ordering enabled; each request is its own ordering key,
  so a slow or failing request never holds up another's chunks.
* Nothing lost: each chunk's publish future is kept until Pub/Sub confirms
  it. A failed publish pauses its ordering key; the key is resumed and every
  unconfirmed chunk from the failed one on is published again, in order.
  The engine hands a request's completion to the pipeline only once all its
  chunks are confirmed, so a consumer that has a completion can find every
  chunk of that attempt in Pub/Sub.
* At least once, as before: a chunk published again may arrive twice;
  consumers de-duplicate by ``(stream, seq)``. A stream lost with its worker
  (or left behind by a moved key) is generated again as a new stream, and the
  completion names the stream whose chunks add up to it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from pipeline.contract.messages import Chunk

LOGGER = logging.getLogger(__name__)
MAX_LATENCY_S = 0.001  # how long the client may hold a chunk to batch it with others


@dataclass
class _Pending:
    """A request's chunks not yet confirmed by Pub/Sub, oldest first."""

    ordering_key: str
    chunks: list[tuple[bytes, Future]] = field(default_factory=list)
    first_failure_at: float | None = None


class ChunkPublisher:
    """Publishes chunks in order per request and tracks each until Pub/Sub confirms it."""

    def __init__(self, topic: str) -> None:
        import google.cloud.pubsub_v1 as pubsub_v1

        self.topic = topic
        self._client = pubsub_v1.PublisherClient(
            batch_settings=pubsub_v1.types.BatchSettings(max_latency=MAX_LATENCY_S),
            publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True))
        atexit.register(self._client.stop)
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self.published = 0
        self.republished = 0

    def publish(self, stream_key: str, chunk: Chunk) -> None:
        """Publishes ``chunk`` now; call in ``seq`` order for each stream."""
        data = chunk.to_json().encode("utf-8")
        with self._lock:
            pending = self._pending.setdefault(stream_key, _Pending(chunk.id))
            pending.chunks.append((data, self._client.publish(self.topic, data, ordering_key=chunk.id)))
            self.published += 1

    def settled(self, stream_key: str) -> bool:
        """Whether every chunk of the stream is confirmed; publishes failed ones again, in order.

        Never blocks: it looks at futures that are done and leaves the others.
        """
        with self._lock:
            pending = self._pending.get(stream_key)
            if pending is None:
                return True
            while pending.chunks and pending.chunks[0][1].done() and pending.chunks[0][1].exception() is None:
                pending.chunks.pop(0)
            failed = next((i for i, (_, future) in enumerate(pending.chunks)
                           if future.done() and future.exception() is not None), None)
            if failed is not None and all(future.done() for _, future in pending.chunks[failed:]):
                # Ordering paused the key at the failure: every later publish failed too.
                error = pending.chunks[failed][1].exception()
                pending.first_failure_at = pending.first_failure_at or time.time()
                LOGGER.warning("Publishing chunks of %s failed (%s: %s); publishing %d again",
                               pending.ordering_key, type(error).__name__, error, len(pending.chunks) - failed)
                self._resume(pending.ordering_key)
                pending.chunks[failed:] = [
                    (data, self._client.publish(self.topic, data, ordering_key=pending.ordering_key))
                    for data, _ in pending.chunks[failed:]]
                self.republished += len(pending.chunks) - failed
            if not pending.chunks:
                del self._pending[stream_key]
                return True
            return False

    def failing_since(self, stream_key: str) -> float | None:
        """When publishing the stream's chunks first failed, if it has and they are not all confirmed yet."""
        with self._lock:
            pending = self._pending.get(stream_key)
            return pending.first_failure_at if pending else None

    def unconfirmed(self) -> int:
        """Chunks published and not yet confirmed, over every stream."""
        with self._lock:
            return sum(len(pending.chunks) for pending in self._pending.values())

    def forget(self, stream_key: str) -> None:
        """Stops tracking a stream that has ended without a completion, or whose chunks could not be confirmed.

        Its ordering key is resumed if a failure paused it, so that a later attempt can publish.
        """
        with self._lock:
            pending = self._pending.pop(stream_key, None)
            if pending is not None and any(f.done() and f.exception() is not None for _, f in pending.chunks):
                self._resume(pending.ordering_key)

    def _resume(self, ordering_key: str) -> None:
        with contextlib.suppress(RuntimeError, ValueError):  # not paused (another attempt resumed it), never used
            self._client.resume_publish(self.topic, ordering_key)
