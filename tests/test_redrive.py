"""The redrive command against the Pub/Sub emulator: drain dead letters go back to the input, nothing else moves."""

from __future__ import annotations

import json
import time
import uuid

from google.cloud import pubsub_v1

from ops.redrive import redrive
from pipeline.contract.messages import (
    PREPARED_ATTRIBUTE,
    STAGE_DRAIN,
    STAGE_PARSE,
    DeadLetter,
    InferenceRequest,
)
from pipeline.contract.request_parsing import parse_request


def pull_all(subscription: str, *, ack: bool, wait_s: float = 5.0) -> list:
    subscriber = pubsub_v1.SubscriberClient()
    got, deadline = {}, time.monotonic() + wait_s
    while time.monotonic() < deadline:
        response = subscriber.pull(subscription=subscription, max_messages=100, timeout=5)
        for received in response.received_messages:
            got[received.message.message_id] = received.message
        if response.received_messages and ack:
            subscriber.acknowledge(subscription=subscription, ack_ids=[m.ack_id for m in response.received_messages])
        elif response.received_messages:
            subscriber.modify_ack_deadline(subscription=subscription, ack_deadline_seconds=0,
                                           ack_ids=[m.ack_id for m in response.received_messages])
        if not response.received_messages and got:
            break
    subscriber.close()
    return list(got.values())


def test_drain_dead_letters_are_republished_with_their_attributes_and_the_rest_stay(emulator):
    name = f"redrive-{uuid.uuid4().hex[:6]}"
    letters_topic = emulator.create_topic(f"{name}-letters", subscription=f"{name}-letters-sub")
    input_topic = emulator.create_topic(f"{name}-input", subscription=f"{name}-input-sub")
    request = InferenceRequest(id="r1", prompt="Say hi.", max_tokens=4, received_at=time.time())
    drained = [DeadLetter(STAGE_DRAIN, "drained", request.to_payload(), id="r1", attributes={PREPARED_ATTRIBUTE: "1"}),
               DeadLetter.from_bytes(STAGE_DRAIN, "drained", b"\xff\xfe not text", id="r2")]
    kept = [DeadLetter(STAGE_PARSE, "bad JSON", "{oops", id="r3").to_json(),
            json.dumps({**json.loads(drained[0].to_json()), "payload_truncated": True}),
            "not a dead letter record"]
    publisher = pubsub_v1.PublisherClient()
    for text in [d.to_json() for d in drained] + kept:
        publisher.publish(letters_topic, text.encode()).result(timeout=30)

    assert redrive(emulator.subscription(f"{name}-letters-sub"), input_topic, dry_run=True).redriven == 2
    tally = redrive(emulator.subscription(f"{name}-letters-sub"), input_topic)
    assert (tally.redriven, tally.other_stage, tally.not_redrivable) == (2, 1, 2)

    republished = pull_all(emulator.subscription(f"{name}-input-sub"), ack=True)
    assert sorted(m.data for m in republished) == sorted([request.to_payload().encode(), b"\xff\xfe not text"])
    assert next(m for m in republished if m.data.startswith(b"{")).attributes[PREPARED_ATTRIBUTE] == "1"
    assert sorted(m.data.decode() for m in pull_all(emulator.subscription(f"{name}-letters-sub"), ack=False)) \
        == sorted(kept)
    again = redrive(emulator.subscription(f"{name}-letters-sub"), input_topic)
    assert again.redriven == 0  # what was redriven was acknowledged; nothing is republished twice


def test_a_bulk_requests_drain_letter_goes_back_to_its_lane(emulator):
    """To the bulk topic when one is named, else to the input topic; either way the next job parses it as bulk."""
    name = f"redrive-lane-{uuid.uuid4().hex[:6]}"
    letters_topic = emulator.create_topic(f"{name}-letters", subscription=f"{name}-letters-sub")
    input_topic = emulator.create_topic(f"{name}-input", subscription=f"{name}-input-sub")
    bulk_topic = emulator.create_topic(f"{name}-bulk", subscription=f"{name}-bulk-sub")
    publisher = pubsub_v1.PublisherClient()
    for n in range(2):
        for lane in (None, "bulk"):
            request = InferenceRequest(id=f"{lane or 'live'}-{n}", prompt="Say hi.", max_tokens=4, lane=lane)
            letter = DeadLetter.of_request(STAGE_DRAIN, "drained", request, payload=request.to_payload(),
                                           attributes={PREPARED_ATTRIBUTE: "1"})
            publisher.publish(letters_topic, letter.to_json().encode()).result(timeout=30)
        if n == 0:
            assert redrive(emulator.subscription(f"{name}-letters-sub"), input_topic, bulk_topic=bulk_topic).redriven == 2
    assert redrive(emulator.subscription(f"{name}-letters-sub"), input_topic).redriven == 2

    def lanes(subscription: str) -> dict[str, str]:
        parsed = [parse_request(m.data, dict(m.attributes)) for m in pull_all(emulator.subscription(subscription), ack=True)]
        return {request.id: request.lane_name() for request in parsed}

    assert lanes(f"{name}-bulk-sub") == {"bulk-0": "bulk"}
    assert lanes(f"{name}-input-sub") == {"live-0": "live", "live-1": "live", "bulk-1": "bulk"}
