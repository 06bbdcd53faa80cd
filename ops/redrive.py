"""Republishes dead letters to an input topic: a redrive, as queue systems offer.

A drain (``gcloud dataflow jobs drain``) turns the requests a job could not
finish within ``drain_timeout_s`` into dead letters with stage ``drain``, each
carrying its request as the template had prepared it and the attribute that
tells the next job not to apply its defaults again. This command pulls such
dead letters from a subscription of the dead-letter topic, publishes each
payload (with its attributes) to the input topic, and acknowledges a dead
letter only once Pub/Sub has confirmed its republication: run it twice, or
kill it half-way, and nothing is lost (a request may arrive twice, which the
template's de-duplication by id absorbs within ``dedupe_window_s``).

A bulk lane's letter (``lane`` bulk: docs/operations.md#the-bulk-lane) goes to ``--bulk_topic`` when one is
given, and in any case carries the lane's mark, so the next job serves it as bulk again.

Dead letters of other stages are left in the subscription, unacknowledged,
unless ``--stage`` names them too (a ``parse`` dead letter would fail the same
way again). Example::

    python -m ops.redrive --dead_letter_subscription projects/P/subscriptions/llm-dead-letters-sub \\
        --input_topic projects/P/topics/prompts
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

import google.cloud.pubsub_v1 as pubsub_v1
from google.api_core import exceptions as api_exceptions

from pipeline.contract.messages import LANE_ATTRIBUTE, LANE_BULK, DeadLetter

LOGGER = logging.getLogger("ops.redrive")
PULL_BATCH = 100


@dataclass
class Tally:
    redriven: int = 0
    other_stage: int = 0
    not_redrivable: int = 0  # not a dead letter record, or its payload was truncated


def redrive(dead_letter_subscription: str, input_topic: str, stages: tuple[str, ...] = ("drain",),
            max_messages: int | None = None, dry_run: bool = False, pull_timeout_s: float = 10.0,
            bulk_topic: str | None = None) -> Tally:
    """Moves the matching dead letters to the input topic (the bulk lane's to ``bulk_topic``, if given); returns
    what it did."""
    subscriber = pubsub_v1.SubscriberClient()
    publisher = pubsub_v1.PublisherClient()
    tally, left_alone = Tally(), set()
    try:
        while max_messages is None or tally.redriven < max_messages:
            try:
                response = subscriber.pull(subscription=dead_letter_subscription, max_messages=PULL_BATCH,
                                           timeout=pull_timeout_s)
            except api_exceptions.DeadlineExceeded:
                break
            fresh = [m for m in response.received_messages if m.message.message_id not in left_alone]
            if not fresh:
                _release(subscriber, dead_letter_subscription, response.received_messages)
                break
            done, skip = [], []
            for received in fresh:
                try:
                    letter = DeadLetter.from_json(received.message.data)
                except ValueError:
                    letter = None
                if letter is None or letter.payload_truncated:
                    tally.not_redrivable += 1
                elif letter.stage not in stages:
                    tally.other_stage += 1
                elif max_messages is not None and tally.redriven >= max_messages:
                    pass  # left for a later run
                else:
                    if not dry_run:
                        topic, attributes = input_topic, dict(letter.attributes)
                        if letter.lane == LANE_BULK:
                            topic, attributes[LANE_ATTRIBUTE] = bulk_topic or input_topic, LANE_BULK
                        publisher.publish(topic, letter.original_bytes(), **attributes).result(timeout=60)
                    tally.redriven += 1
                    if not dry_run:
                        done.append(received)
                        continue
                left_alone.add(received.message.message_id)
                skip.append(received)
            if done:
                subscriber.acknowledge(subscription=dead_letter_subscription, ack_ids=[m.ack_id for m in done])
            _release(subscriber, dead_letter_subscription, skip)
            LOGGER.info("Redriven %d so far (%d of other stages left in place, %d not redrivable)",
                        tally.redriven, tally.other_stage, tally.not_redrivable)
    finally:
        subscriber.close()
    return tally


def _release(subscriber: pubsub_v1.SubscriberClient, subscription: str, messages: list) -> None:
    """Hands messages back to the subscription at once (they stay unacknowledged)."""
    if messages:
        subscriber.modify_ack_deadline(subscription=subscription, ack_ids=[m.ack_id for m in messages],
                                       ack_deadline_seconds=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--dead_letter_subscription", required=True,
                        help="A subscription of the job's dead_letter_topic: projects/P/subscriptions/S")
    parser.add_argument("--input_topic", required=True,
                        help="The topic the next job's input_subscription reads: projects/P/topics/T")
    parser.add_argument("--bulk_topic", help="The topic the next job's bulk_subscription reads, for the bulk lane's "
                                             "letters (default: the input topic, marked bulk)")
    parser.add_argument("--stage", action="append", dest="stages",
                        help="Dead-letter stage to redrive (repeatable; default: drain)")
    parser.add_argument("--max_messages", type=int, default=None, help="Stop after this many (default: all)")
    parser.add_argument("--dry_run", action="store_true", help="Count what would be redriven; change nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tally = redrive(args.dead_letter_subscription, args.input_topic, tuple(args.stages or ("drain",)),
                    args.max_messages, args.dry_run, bulk_topic=args.bulk_topic)
    verb = "would be republished" if args.dry_run else "republished"
    LOGGER.info("%d dead letter(s) %s to %s; %d of other stages and %d not redrivable left in %s",
                tally.redriven, verb, args.input_topic, tally.other_stage, tally.not_redrivable,
                args.dead_letter_subscription)
    return 0


if __name__ == "__main__":
    sys.exit(main())
