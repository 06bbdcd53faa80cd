"""The job's reader of its input subscription on Dataflow: it pulls only what its worker has room for.

Design (b) of docs/architecture.md ("Backpressure"). Dataflow's own Pub/Sub source reads whatever the
subscription holds and acknowledges it once the first fused stage commits; holding a backlog back then takes a
step that waits (a harness thread per read bundle) or fails its work item. This reader asks first: it is a
splittable DoFn (`Beam programming guide: splittable DoFns
<https://beam.apache.org/documentation/programming-guide/#splittable-dofns>`_) run as ``READERS``
independent restrictions that Dataflow spreads over the job's workers like keys, each pulling for the worker it
runs on. Every round of a reader

1. takes places in the worker's hold for at most ``PULL_MOST`` messages (:mod:`pipeline.worker.read_places`:
   the admission ledger grants no more than its room), and when it gets none, **defers the rest of its
   restriction** (``tracker.defer_remainder``): its work item ends, the runner resumes it ``FULL_DELAY_S``
   later, and no thread waits and nothing fails meanwhile ("self-checkpointing" in the guide). A worker's
   readers share its room, so while a few pull the others find none and defer at once;
2. pulls at most that many messages, waiting at most ``PULL_WAIT_S`` (the rest stays in the subscription,
   durable and counted as its backlog), gives back the places the pull did not fill, and extends the pulled
   messages' ack deadline to ``ACK_DEADLINE_S``;
3. outputs them as the native source does (``PubsubMessage`` with attributes, id and publish time, timestamped
   by their publish time), and registers a **bundle finalizer** that acknowledges them: the runner calls it only
   once the bundle's output is committed ("Bundle finalization" in the guide), so a bundle that fails leaves its
   messages unacknowledged, and Pub/Sub delivers them again once their deadline passes;
4. ends its work item (``defer_remainder``), so its output commits and is acknowledged, and resumes at once
   after a pull that got messages, ``EMPTY_DELAY_S`` later after an empty one.

What the native source did that this one does for itself, or gives up:

* **Deduplication by message id** goes; a message delivered again (a bundle that failed, a finalizer that did
  not run before the deadline) is a request the generate step has seen, and its dedupe by request id
  (``dedupe_window_s``) serves it once.
* **Its watermark**: this reader's follows the oldest publish time of what it pulled, and the clock while the
  subscription is empty (Beam's ``ManualWatermarkEstimator``); while the worker is full it does not advance, so
  the job's data freshness shows the backlog waiting.
* **Its backlog**, which Dataflow's autoscaler reads for the native source: what this reader has not pulled is
  the subscription's backlog, which the reader cannot see without pulling it. Its restriction's size
  (``restriction_size``, which Beam's own unbounded ``PeriodicSequence`` reports as backlog bytes "as some
  runners scale based upon bytes") is the bytes of its last pull when that pull filled every place it had, so a
  full worker whose subscription keeps more reports work waiting; how Dataflow's autoscaler weighs a Python
  splittable DoFn's size is not documented (docs/operations.md says what a first job should check).
* **Drain**: ``truncate`` returns nothing, so a drained job stops pulling and lets what it pulled finish.

A job with a ``bulk_subscription`` runs a second set of readers for it, which take places only while the worker
holds fewer than ``bulk_held`` (``live_reserve`` keeps the rest for live reads) and mark what they pull as the
bulk lane's (``LANE_ATTRIBUTE``).

A message stays unacknowledged at most until its bundle commits: ``ACK_DEADLINE_S`` is far above a bundle's
life (one pull and a few steps), and a redelivery after it costs a duplicate, which the dedupe drops.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Iterator

import apache_beam as beam
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.metrics import Metrics
from apache_beam.transforms.core import RestrictionProvider
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp

from pipeline.contract.call_outcome import Call
from pipeline.contract.messages import LANE_ATTRIBUTE, LANE_BULK
from pipeline.worker import read_places
from pipeline.worker.load import LOAD_NAMESPACE
from pipeline.worker.runtime import RuntimeSource, process_record
from pipeline.worker.runtime_client import RuntimeClient

LOGGER = logging.getLogger(__name__)

# The fewest readers a job runs: independent restrictions, which Dataflow spreads over its workers like keys
# (a job runs four for each worker it may have, readers_for). Each pulls for the worker it runs on; a worker's
# readers share its room, so one that finds the room taken by the others' places pulls nothing.
READERS = 16
# The most messages one round pulls: small enough that several of a worker's readers pull at once, so one of them
# is waiting at the subscription when a message comes.
PULL_MOST = 32
# How long a round's pull waits for messages when the subscription is empty.
PULL_WAIT_S = 0.5
# When a reader that found no room asks again: its work item ends, and the runner resumes it this much later.
# While it waits, the worker's queue (worker_queue) keeps its model busy.
FULL_DELAY_S = 0.2
# When a reader whose pull found nothing pulls again.
EMPTY_DELAY_S = 1.0
# How long a pulled message may wait for its bundle to commit before Pub/Sub delivers it again.
ACK_DEADLINE_S = 120
# How often a reader that finds its worker full says so.
FULL_LOG_INTERVAL_S = 60.0


class PullWithinRoomFn(beam.DoFn, RestrictionProvider):
    """Subscription path in, its messages out, never more than the worker has room for (module docstring). Its own
    restriction provider: the restriction is the rounds it has left, one claimed per pull, unbounded for a job's
    stream (``rounds`` bounds it where a test runs the reader to its end)."""

    def __init__(self, runtime: RuntimeSource, rounds: int = sys.maxsize,
                 ack_deadline_s: int = ACK_DEADLINE_S, bulk: bool = False) -> None:
        self._source = runtime
        self._rounds = rounds
        self._ack_deadline_s = ack_deadline_s
        self._bulk = bulk
        self.pulled = Metrics.counter(LOAD_NAMESPACE, "read_messages")
        self.deferred = Metrics.counter(LOAD_NAMESPACE, "read_deferred")

    def setup(self) -> None:
        from google.cloud import pubsub_v1

        self._client = pubsub_v1.SubscriberClient()
        self._runtime = RuntimeClient(self._source, LOAD_NAMESPACE)

    def start_bundle(self) -> None:
        self._bundle_places: list[str] = []

    def finish_bundle(self) -> None:
        """What the bundle read has gone down the stage, each request in its place: a place left (its message was
        a dead letter) is no longer for taking, and counts from now on only as a request on its way."""
        places, self._bundle_places = self._bundle_places, []
        if places:
            read_places.discard(self._source.tag, places)
            # Unanswered, they count, open, in a silent ledger until request_timeout_s, or are gone with a dead one.
            self._runtime.call("dispatch places", lambda runtime: runtime.dispatched(places))

    def teardown(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()

    def initial_restriction(self, element: tuple[str, int]) -> OffsetRange:
        return OffsetRange(0, self._rounds)

    def create_tracker(self, restriction: OffsetRange) -> OffsetRestrictionTracker:
        return OffsetRestrictionTracker(restriction)

    def restriction_size(self, element: tuple[str, int], restriction: OffsetRange) -> int:
        """The backlog this reader reports: the bytes of its last pull when that pull filled every place it had
        (more is likely waiting), else none (module docstring)."""
        return getattr(self, "_backlog_bytes", 0)

    def truncate(self, element: tuple[str, int], restriction: OffsetRange) -> None:
        """A drained job stops pulling (Beam's drain truncates an unbounded restriction)."""
        return None

    @beam.DoFn.unbounded_per_element()
    def process(self, reader: tuple[str, int],
                finalizer: Any = beam.DoFn.BundleFinalizerParam,  # before the two below: Beam passes it by place
                tracker: Any = beam.DoFn.RestrictionParam(),
                watermark: Any = beam.DoFn.WatermarkEstimatorParam(ManualWatermarkEstimator.default_provider())
                ) -> Iterator[Any]:
        subscription = reader[0]
        round_at = tracker.current_restriction().start
        if not tracker.try_claim(round_at):
            return
        places = take_places(self._runtime, PULL_MOST, self._bulk)
        if not places:
            self.deferred.inc()
            self._log_full()
            tracker.defer_remainder(Duration.of(FULL_DELAY_S))
            return
        received = self._pull(subscription, len(places))
        self._settle(places, len(received))
        self._bundle_places.extend(places[:len(received)])
        self._backlog_bytes = sum(len(m.message.data) for m in received) if len(received) == len(places) else 0
        if received:
            ack_ids = [message.ack_id for message in received]
            self._client.modify_ack_deadline(subscription=subscription, ack_ids=ack_ids,
                                             ack_deadline_seconds=self._ack_deadline_s)
            finalizer.register(lambda: self._client.acknowledge(subscription=subscription, ack_ids=ack_ids))
            self.pulled.inc(len(received))
        oldest = None
        for received_message in received:
            message = PubsubMessage._from_message(received_message.message)  # as the native source makes it
            if self._bulk:
                message = marked_bulk(message)
            published = Timestamp.from_utc_datetime(message.publish_time)
            oldest = published if oldest is None else min(oldest, published)
            yield TimestampedValue(message, published)
        _advance(watermark, oldest if oldest is not None else Timestamp.now())
        tracker.defer_remainder(Duration.of(0 if received else EMPTY_DELAY_S))

    def _settle(self, places: list[str], used: int) -> None:
        tag = self._source.tag
        outcome, _ = self._runtime.call("settle places", lambda runtime: read_places.settle(runtime, tag, places, used))
        if outcome is not Call.ANSWERED:
            # Gone with a dead host's ledger, or counted in a silent one until request_timeout_s; this round's
            # requests pass the admission step uncounted if no room is left for them.
            LOGGER.warning("The worker's runtime did not answer as a read settled its places")

    def _pull(self, subscription: str, most: int) -> list[Any]:
        from google.api_core import exceptions

        try:
            response = self._client.pull(subscription=subscription, max_messages=most, timeout=PULL_WAIT_S,
                                         retry=None)
        except (exceptions.DeadlineExceeded, exceptions.ServiceUnavailable):
            return []
        return list(response.received_messages)

    def _log_full(self) -> None:
        """At most once a minute in each process, however many readers and threads find the worker full."""
        record, now = process_record(self._source.tag), time.monotonic()
        with record.lock:
            if now - record.full_logged_at < FULL_LOG_INTERVAL_S:
                return
            record.full_logged_at = now
        LOGGER.info("Worker full: its readers pull nothing and ask again every %g s; the backlog stays in the "
                    "subscription (counter read_deferred)", FULL_DELAY_S)


def take_places(runtime: RuntimeClient, most: int, bulk: bool = False) -> list[str]:
    """A round's places for up to ``most`` messages (:mod:`pipeline.worker.read_places`); none while the runtime
    cannot be asked: silent, or its host gone, which the client starts acquiring anew in the background (a reader
    may be the only step that still calls it). The round then defers like a full one, and nothing is pulled."""
    _, places = runtime.call("take places", lambda worker: read_places.reserve(worker, most, bulk))
    return places or []


def marked_bulk(message: PubsubMessage) -> PubsubMessage:
    """A message of the bulk lane, as parsing tells it (``LANE_ATTRIBUTE``), whatever its publisher set."""
    return PubsubMessage(message.data, {**(message.attributes or {}), LANE_ATTRIBUTE: LANE_BULK},
                         message.message_id, message.publish_time, message.ordering_key)


def readers_for(max_workers: int) -> int:
    """How many readers a job that may run ``max_workers`` workers runs: four for each, at least ``READERS``."""
    return max(READERS, 4 * max_workers)


def _advance(watermark: Any, to: Timestamp) -> None:
    current = watermark.current_watermark()
    if current is None or to > current:
        watermark.set_watermark(to)


class ReadWithinRoom(beam.PTransform):
    """A subscription's messages, as ``ReadFromPubSub(with_attributes=True)`` gives them, pulled only while the
    worker has room for them; with ``bulk``, only while it has more room than the live lane keeps
    (``live_reserve``), and each marked as the bulk lane's. ``rounds`` and ``ack_deadline_s`` are for tests that run
    readers to their end."""

    def __init__(self, subscription: str, runtime: RuntimeSource, *, readers: int = READERS, bulk: bool = False,
                 rounds: int = sys.maxsize, ack_deadline_s: int = ACK_DEADLINE_S) -> None:
        super().__init__()
        self._subscription = subscription
        self._readers = readers
        self._runtime = runtime
        self._bulk = bulk
        self._rounds = rounds
        self._ack_deadline_s = ack_deadline_s

    def expand(self, pipeline: Any) -> Any:
        return (pipeline
                | "Start" >> beam.Impulse()
                | "Readers" >> beam.FlatMap(lambda _, path=self._subscription, count=self._readers:
                                             [(path, n) for n in range(count)])
                | "Pull" >> beam.ParDo(PullWithinRoomFn(self._runtime, self._rounds, self._ack_deadline_s, self._bulk)))
