"""Chunks published by the engine's publisher: in order, confirmed, and published again after a real failure."""

from __future__ import annotations

import json
import threading
import time
import uuid

from google.cloud import pubsub_v1

from pipeline.contract.messages import Chunk
from pipeline.sinks.chunk_publisher import ChunkPublisher
from tests.conftest import wait_until


def _chunks(request_id: str, count: int, attempt: int = 1) -> list[Chunk]:
    return [Chunk(id=request_id, attempt=attempt, stream=f"{request_id}-{attempt}", seq=seq, text=f"t{seq} ", tokens=seq + 1, final=seq == count - 1,
                  finish_reason="stop" if seq == count - 1 else None, time_to_first_token_ms=5.0,
                  elapsed_ms=float(seq), emitted_at=time.time()) for seq in range(count)]


class _Received:
    def __init__(self, subscription: str) -> None:
        self.items: list[dict] = []
        self._lock = threading.Lock()
        self._subscriber = pubsub_v1.SubscriberClient()
        self._future = self._subscriber.subscribe(subscription, callback=self._on_message)

    def _on_message(self, message) -> None:
        with self._lock:
            self.items.append(json.loads(message.data))
        message.ack()

    def of(self, request_id: str) -> list[dict]:
        with self._lock:
            return [item for item in self.items if item["id"] == request_id]

    def stop(self) -> None:
        self._future.cancel()
        self._subscriber.close()


def _settle(publisher: ChunkPublisher, keys: list[str], timeout_s: float = 60) -> bool:
    return wait_until(lambda: all(publisher.settled(key) for key in keys), timeout_s, interval_s=0.05)


def test_every_request_gets_its_chunks_in_order_and_each_is_confirmed(emulator):
    name = f"chunks-{uuid.uuid4().hex[:8]}"
    topic = emulator.create_topic(name, subscription=f"{name}-sub", ordering=True)
    received = _Received(emulator.subscription(f"{name}-sub"))
    publisher = ChunkPublisher(topic)
    try:
        streams = {f"req-{i}": _chunks(f"req-{i}", 12) for i in range(5)}
        for seq in range(12):  # interleaved across requests, as the engine cuts them
            for request_id, chunks in streams.items():
                publisher.publish(f"{request_id}#fp#1", chunks[seq])
        assert _settle(publisher, [f"{r}#fp#1" for r in streams])
        assert wait_until(lambda: all(len(received.of(r)) >= 12 for r in streams), 30)
        for request_id in streams:
            assert [c["seq"] for c in received.of(request_id)] == list(range(12))
        assert publisher.published == 60 and publisher.republished == 0
    finally:
        received.stop()


def test_a_failed_publish_is_published_again_in_order_once_pubsub_takes_it(emulator):
    """The topic does not exist at first (NotFound): nothing is confirmed, and once it exists every chunk arrives."""
    name = f"late-{uuid.uuid4().hex[:8]}"
    publisher = ChunkPublisher(emulator.topic(name))
    chunks = _chunks("late-request", 6)
    for chunk in chunks:
        publisher.publish("late-request#fp#1", chunk)
    time.sleep(2.0)
    assert not publisher.settled("late-request#fp#1")  # failed, and published again (to fail again)
    assert publisher.failing_since("late-request#fp#1") is not None and publisher.republished >= 6
    time.sleep(2.0)  # let those publishes fail too: one landing between topic and subscription would be lost
    emulator.create_topic(name, subscription=f"{name}-sub", ordering=True)
    received = _Received(emulator.subscription(f"{name}-sub"))
    try:
        assert _settle(publisher, ["late-request#fp#1"])
        assert wait_until(lambda: len(received.of("late-request")) >= 6, 30)
        assert [c["seq"] for c in received.of("late-request")] == list(range(6))
        assert publisher.failing_since("late-request#fp#1") is None  # confirmed and forgotten
    finally:
        received.stop()
