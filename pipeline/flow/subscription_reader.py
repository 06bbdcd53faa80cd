"""The job's reader of its input subscription on Dataflow: it pulls only what its worker has room for.

Design (b) of docs/architecture.md ("Backpressure"). Dataflow's own Pub/Sub source reads whatever the
subscription holds and acknowledges it once the first fused stage commits; holding a backlog back then takes a
step that waits (a harness thread per read bundle) or fails its work item. This reader asks first: it is a
splittable DoFn (`Beam programming guide: splittable DoFns
<https://beam.apache.org/documentation/programming-guide/#splittable-dofns>`_) run as independent restrictions
(:func:`readers_for`) that Dataflow spreads over the job's workers like keys. The pulling itself is done by one
feed per SDK process and subscription (:mod:`pipeline.flow.subscription_feed`): a thread of its own that takes
places in the worker's hold first and long-pulls no more messages than it got places for. Every round of a reader

1. takes up to ``PULL_MOST`` of what its process's feed has pulled, under a lock: it waits on neither Pub/Sub nor
   the worker's runtime (the feed's thread gives back the places of its dead letters, once it ends; the
   admission step fused after it admits each request with a call bounded by ``CallSettings.bound_s``, the
   :mod:`~pipeline.worker.runtime_client` policy). When there is nothing, it **defers the rest of its restriction**
   (``tracker.defer_remainder``): its work item ends, the runner resumes it ``EMPTY_DELAY_S`` later if the
   subscription had nothing, ``FULL_DELAY_S`` later otherwise (the worker is full, or a pull is under way), and no
   thread waits and nothing fails meanwhile ("self-checkpointing" in the guide);
2. queues the messages' places for the admission step, which takes each over for its request
   (:mod:`pipeline.worker.read_places`);
3. outputs them as the native source does (``PubsubMessage`` with attributes, id and publish time, timestamped
   by their publish time), and registers a **bundle finalizer** that acknowledges them: the runner calls it only
   once the bundle's output is committed ("Bundle finalization" in the guide), so a bundle that fails leaves its
   messages unacknowledged, and Pub/Sub delivers them again once their deadline passes; the places of its
   messages lapse within ``AdmissionSettings.place_open_s``;
4. ends its work item (``defer_remainder``), so its output commits and is acknowledged, and resumes at once.

What the native source did that this one does for itself, or gives up:

* **Deduplication by message id** goes; a message delivered again (a bundle that failed, a finalizer that did
  not run before the deadline: counted, ``finalize_late``) is a request the generate step has seen, and its dedupe
  by request id (``dedupe_window_s``) serves it once.
* **Its watermark**: this reader's follows the oldest publish time of what it took, and the clock while the
  subscription is empty (Beam's ``ManualWatermarkEstimator``); while the worker is full, a pull is under way or
  Pub/Sub refuses, it does not advance, so the job's data freshness shows the backlog waiting.
* **Its backlog**, which Dataflow's autoscaler reads for the native source: a reader's restriction reports its
  share of the subscription's backlog bytes as Cloud Monitoring has them (:mod:`pipeline.flow.subscription_backlog`;
  the size Beam's own unbounded ``PeriodicSequence`` reports as backlog bytes "as some runners scale based upon
  bytes", and the estimate Dataflow's Horizontal Autoscaling page asks a custom source for:
  https://cloud.google.com/dataflow/docs/horizontal-autoscaling), read by the feed's thread, never here.
* **Splits**: Dataflow does not split an unbounded splittable DoFn's restriction today; a split other than a
  checkpoint would make two readers of one subscription out of one, so the tracker refuses it
  (:class:`CheckpointsOnly`).
* **Drain**: ``truncate`` returns nothing, so a drained job stops taking and lets what it took finish; what its
  feeds hold is given back to Pub/Sub once no round asks (``subscription_feed.IDLE_S``).

A job with a ``bulk_subscription`` runs a second set of readers for it, whose feeds take places only while the
worker holds fewer than ``bulk_held`` (``live_reserve`` keeps the rest for live reads) and fewer than its running
streams and the lane's next wave (:class:`~pipeline.worker.admission_ledger.AdmissionLedger`), and mark what they
pull as the bulk lane's (``LANE_ATTRIBUTE``).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.metrics import Metrics
from apache_beam.transforms.core import RestrictionProvider
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp

from pipeline.contract.messages import LANE_ATTRIBUTE, LANE_BULK
from pipeline.flow import subscription_feed
from pipeline.worker import read_places
from pipeline.worker.load import LOAD_NAMESPACE
from pipeline.worker.runtime import RuntimeSource, process_record

LOGGER = logging.getLogger(__name__)

# The fewest readers a job runs (readers_for): independent restrictions, which Dataflow spreads over its workers
# like keys. A round costs a lock and a work item, not a pull: a worker needs one reader to be read, and more only
# to be read by several threads at once.
READERS = 16
# How many workers a job may grow to when its launch names none: taken as 100, what Dataflow's service has
# allowed a streaming job on Streaming Engine (its pipeline options reference says only that the service
# chooses: https://cloud.google.com/dataflow/docs/reference/pipeline-options), so name MAX_WORKERS to be sure.
DEFAULT_MAX_WORKERS = 100
# The most messages one round takes.
PULL_MOST = subscription_feed.PULL_MOST
# When a reader that found its worker full asks again: its work item ends, and the runner resumes it this much
# later. While it waits, the worker's queue (worker_queue) keeps its model busy.
FULL_DELAY_S = 0.2
# When a reader that found nothing pulled asks again.
EMPTY_DELAY_S = 1.0
# How long a pulled message may wait for its bundle to commit before Pub/Sub delivers it again.
ACK_DEADLINE_S = 120
# How often a reader that finds its worker full says so.
FULL_LOG_INTERVAL_S = 60.0

class CheckpointsOnly(OffsetRestrictionTracker):
    """A reader's tracker: it splits only to checkpoint (``defer_remainder``), never a part of its rounds off to a
    second reader of the same subscription (module docstring)."""

    def try_split(self, fraction_of_remainder: float) -> Any:
        if fraction_of_remainder != 0:
            return None
        return super().try_split(0)


class PullWithinRoomFn(beam.DoFn, RestrictionProvider):
    """Subscription path in, its messages out, never more than the worker has room for (module docstring). Its own
    restriction provider: the restriction is the rounds it has left, one claimed per round, unbounded for a job's
    stream (``rounds`` bounds it where a test runs the reader to its end). ``readers``: how many share the
    subscription, each reporting its share of the backlog."""

    def __init__(self, runtime: RuntimeSource, rounds: int = sys.maxsize,
                 ack_deadline_s: int = ACK_DEADLINE_S, bulk: bool = False, readers: int = READERS) -> None:
        self._source = runtime
        self._rounds = rounds
        self._ack_deadline_s = ack_deadline_s
        self._bulk = bulk
        self._readers = readers
        self._counters = {  # each by its name, as the dashboard and the alerts query them
            "read_messages": Metrics.counter(LOAD_NAMESPACE, "read_messages"),
            "read_deferred": Metrics.counter(LOAD_NAMESPACE, "read_deferred"),
            "acked": Metrics.counter(LOAD_NAMESPACE, "acked"),
            "ack_failed": Metrics.counter(LOAD_NAMESPACE, "ack_failed"),
            "ack_late": Metrics.counter(LOAD_NAMESPACE, "ack_late"),
            "modify_failed": Metrics.counter(LOAD_NAMESPACE, "modify_failed"),
            "finalize_late": Metrics.counter(LOAD_NAMESPACE, "finalize_late"),
            "pull_retried": Metrics.counter(LOAD_NAMESPACE, "pull_retried"),
            "pull_refused": Metrics.counter(LOAD_NAMESPACE, "pull_refused"),
            "pubsub_unreachable": Metrics.counter(LOAD_NAMESPACE, "pubsub_unreachable"),
            "given_back": Metrics.counter(LOAD_NAMESPACE, "given_back"),
            "runtime_unreachable": Metrics.counter(LOAD_NAMESPACE, "runtime_unreachable"),
            "engine_call_failures": Metrics.counter(LOAD_NAMESPACE, "engine_call_failures"),
        }

    def start_bundle(self) -> None:
        self._bundle_places: list[str] = []
        self._bundle_feed: subscription_feed.SubscriptionFeed | None = None

    def finish_bundle(self) -> None:
        """What the bundle read has gone down the fused stage, each request admitted in a place: a place left (its
        message was a dead letter of parsing or measuring) is no longer for taking, and goes back to the worker."""
        places, self._bundle_places = self._bundle_places, []
        if places and self._bundle_feed is not None:
            end_read_bundle(self._bundle_feed, self._source.tag, places)

    def initial_restriction(self, element: tuple[str, int]) -> OffsetRange:
        return OffsetRange(0, self._rounds)

    def create_tracker(self, restriction: OffsetRange) -> OffsetRestrictionTracker:
        return CheckpointsOnly(restriction)

    def restriction_size(self, element: tuple[str, int], restriction: OffsetRange) -> int:
        """This reader's share of its subscription's backlog in bytes (module docstring): Cloud Monitoring's figure
        while a fresh one is known, else the bytes this process's feed holds; zero before a feed is started."""
        feed = subscription_feed.existing_feed(element[0], self._source.tag, self._bulk)
        if feed is None:
            return 0
        backlog = feed.backlog.bytes()
        total = backlog if backlog is not None else feed.held_bytes()
        return math.ceil(total / max(self._readers, 1))

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
        feed = subscription_feed.feed_for(subscription, self._source, self._bulk, self._ack_deadline_s)
        taken = take_round(feed, self._source.tag)
        for each in subscription_feed.feeds_of(self._source.tag):  # a feed whose readers left counts on too
            for name, value in each.counts().items():
                if name in self._counters:  # the feed counts by these names
                    self._counters[name].inc(value)
        if not taken.messages:
            if feed.full:
                self._log_full()
            elif feed.empty:  # not while a pull is under way over a backlog, nor while Pub/Sub refuses
                _advance(watermark, Timestamp.now())
            tracker.defer_remainder(Duration.of(taken.again_s))
            return
        self._bundle_places.extend(taken.places)
        self._bundle_feed = feed
        finalizer.register(lambda: feed.acknowledge(taken.ack_ids))
        oldest = None
        for pulled in taken.messages:
            message = PubsubMessage._from_message(pulled.received.message)  # as the native source makes it
            if self._bulk:
                message = marked_bulk(message)
            published = Timestamp.from_utc_datetime(message.publish_time)
            oldest = published if oldest is None else min(oldest, published)
            yield TimestampedValue(message, published)
        if oldest is not None:
            _advance(watermark, oldest)
        tracker.defer_remainder(Duration.of(0))

    def _log_full(self) -> None:
        """At most once a minute in each process, however many readers and threads find the worker full."""
        record, now = process_record(self._source.tag), time.monotonic()
        with record.lock:
            if now - record.full_logged_at < FULL_LOG_INTERVAL_S:
                return
            record.full_logged_at = now
        LOGGER.info("Worker full: its readers pull nothing and ask again every %g s; the backlog stays in the "
                    "subscription (counter read_deferred)", FULL_DELAY_S)


@dataclass(frozen=True)
class Round:
    """What one round of a reader took, and when its reader asks again."""

    messages: tuple[subscription_feed.Pulled, ...]
    again_s: float

    @property
    def places(self) -> list[str]:
        return [pulled.place for pulled in self.messages]

    @property
    def ack_ids(self) -> list[str]:
        return [pulled.received.ack_id for pulled in self.messages]


def take_round(feed: subscription_feed.SubscriptionFeed, tag: str, most: int = PULL_MOST) -> Round:
    """One round's take, as :class:`PullWithinRoomFn` and the worker's simulator (``tests/vm_sim.py``) both run it:
    up to ``most`` of what the feed pulled, their places queued for this bundle's admission step; with
    nothing, the reader asks again ``EMPTY_DELAY_S`` later if the subscription was empty (or cannot be pulled),
    else ``FULL_DELAY_S`` (the worker is full, or a pull is under way). Never waits. The caller acknowledges
    :attr:`Round.ack_ids` once its bundle committed."""
    messages = tuple(feed.take(most))
    if not messages:
        return Round((), EMPTY_DELAY_S if (feed.empty or feed.refused) and not feed.full else FULL_DELAY_S)
    taken = Round(messages, 0.0)
    read_places.queue(tag, taken.places, read_places.this_bundle())
    return taken


def end_read_bundle(feed: subscription_feed.SubscriptionFeed, tag: str, places: list[str]) -> None:
    """A read bundle's end, as :class:`PullWithinRoomFn` and the worker's simulator both run it: the places its
    rounds queued and no admission took over (their messages were dead letters) are no longer for taking, and go
    back to the worker's room on the feed's thread (the bundle's end waits on nothing)."""
    read_places.discard(tag, places, read_places.this_bundle())
    feed.left_over(places)


def marked_bulk(message: PubsubMessage) -> PubsubMessage:
    """A message of the bulk lane, as parsing tells it (``LANE_ATTRIBUTE``), whatever its publisher set."""
    return PubsubMessage(message.data, {**(message.attributes or {}), LANE_ATTRIBUTE: LANE_BULK},
                         message.message_id, message.publish_time, message.ordering_key)


def readers_for(max_workers: int | None) -> int:
    """How many readers a job that may run ``max_workers`` workers runs (Dataflow's default ceiling when the launch
    names none): two for each, at least ``READERS``. They are fixed when the job is launched (an update keeps the
    readers it has): docs/operations.md#autoscaling-with-the-jobs-reader."""
    return max(READERS, 2 * (max_workers or DEFAULT_MAX_WORKERS))


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
                | "Pull" >> beam.ParDo(PullWithinRoomFn(self._runtime, self._rounds, self._ack_deadline_s, self._bulk,
                                                       self._readers)))
