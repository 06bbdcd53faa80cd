"""Driving the reader's feed (pipeline/flow/subscription_feed.py) as the job does, for tests and the benchmark.

A round is played as the reader's DoFn plays it (take, hand each place to its request, acknowledge once the bundle
"committed") and as the admission step does (the request in place of its place), against the real admission
ledger, the worker's runtime as far as the feed asks anything of it: so the ledger's count is the real one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import grpc
from google.cloud import pubsub_v1

from pipeline.engines.engine_settings import EngineSettings
from pipeline.flow import subscription_feed
from pipeline.worker.admission_ledger import AdmissionLedger
from pipeline.worker.runtime_settings import AdmissionSettings, RuntimeSettings
from tests.pubsub_fault_proxy import FaultProxy

ACK_DEADLINE_S = 10  # Pub/Sub's least: what a round took and did not acknowledge comes back this soon
BOUND = 5


@dataclass(frozen=True)
class LedgerSource:
    """A runtime source (pipeline.worker.runtime.RuntimeSource) whose runtime is the real admission ledger alone:
    the feed asks nothing else of it. ``pause_s`` holds each call that long first, as a paused host would."""

    tag: str
    settings: RuntimeSettings
    ledger: AdmissionLedger
    pause_s: float = 0.0

    def acquire(self, *, fresh: bool = False) -> AdmissionLedger:
        if self.pause_s:
            time.sleep(self.pause_s)
        return self.ledger


def a_worker(place_open_s: float = 60.0, pause_s: float = 0.0, bound: int = BOUND) -> LedgerSource:
    settings = RuntimeSettings(EngineSettings(server=None, server_url="http://127.0.0.1:9", served_model_name="m",
                                              max_in_flight=2),
                               AdmissionSettings(worker_queue=bound - 2, transit_s=0.5, place_open_s=place_open_s))
    return LedgerSource(f"feed-test-{time.monotonic_ns()}", settings, AdmissionLedger(settings, lambda: 0), pause_s)


def held(source: LedgerSource) -> int:
    return sum(source.ledger.counts())


def publish(topic: str, count: int, start: int = 0) -> list[str]:
    publisher = pubsub_v1.PublisherClient()
    ids = [f"req-{i}" for i in range(start, start + count)]
    for request_id in ids:
        publisher.publish(topic, json.dumps({"id": request_id, "prompt": "hi"}).encode()).result()
    return ids


def through(proxy: FaultProxy):
    """A SubscriberClient that reaches the emulator through the proxy."""
    def make() -> pubsub_v1.SubscriberClient:
        channel = grpc.insecure_channel(proxy.host)
        from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport
        return pubsub_v1.SubscriberClient(transport=SubscriberGrpcTransport(channel=channel))
    return make


def a_feed(subscription_path: str, source: LedgerSource, proxy: FaultProxy) -> subscription_feed.SubscriptionFeed:
    return subscription_feed.SubscriptionFeed(subscription_path, source, False, ACK_DEADLINE_S, through(proxy))


def serve_rounds(feed: subscription_feed.SubscriptionFeed, source: LedgerSource, expected: set[str],
                 timeout_s: float, fail_every: int = 0) -> Served:
    """Rounds as the reader's DoFn and the admission step play them until every expected request has ended:
    each request admitted in its place, then "generated" (it arrives: its room is free again) and its message
    acknowledged once its bundle commits; every ``fail_every``-th bundle fails (nothing acknowledged, nothing
    dispatched: its places and requests lapse in ``place_open_s``, its messages come back after their deadline)."""
    served = Served()
    bundles = 0
    deadline = time.monotonic() + timeout_s
    while set(served.ended) != expected and time.monotonic() < deadline:
        served.most = max(served.most, held(source))
        taken = feed.take(32)
        if not taken:
            time.sleep(0.05)
            continue
        bundles += 1
        ids = [json.loads(p.received.message.data)["id"] for p in taken]
        for request_id, pulled in zip(ids, taken):
            if not source.ledger.admit([request_id], in_place_of=[pulled.place]):
                served.uncounted += 1  # its place had lapsed and the worker had no room: pulled past the bound
        served.most = max(served.most, held(source))
        if fail_every and bundles % fail_every == 0:
            served.failed += len(ids)
            continue
        source.ledger.dispatched(ids)
        source.ledger.report_waiting("key", 0, arrived=ids)
        for request_id in ids:  # one delivered again is served once, by its id
            served.ended[request_id] = served.ended.get(request_id, 0) + 1
        feed.acknowledge([p.received.ack_id for p in taken])
    return served


@dataclass
class Served:
    """What :func:`serve_rounds` saw: how often each request was delivered to a bundle that committed (the generate
    step's dedupe serves one delivered again once), requests admitted without a place, requests in failed bundles,
    and the most the ledger held at any time."""

    ended: dict[str, int] = field(default_factory=dict)
    uncounted: int = 0
    failed: int = 0
    most: int = 0


def short_deadline_subscription(emulator, name: str) -> tuple[str, str]:
    """A topic of the emulator and a subscription to it with Pub/Sub's least ack deadline (``ACK_DEADLINE_S``):
    what nobody acknowledged comes back that soon. Returns (topic, subscription) paths."""
    topic = emulator.create_topic(name)
    client = pubsub_v1.SubscriberClient()
    try:
        client.create_subscription(request={"name": emulator.subscription(f"{name}-sub"), "topic": topic,
                                            "ack_deadline_seconds": ACK_DEADLINE_S})
    finally:
        client.close()
    return topic, emulator.subscription(f"{name}-sub")
