"""One process's puller of one subscription: long pulls on a thread of its own, never more than its places allow.

The job's reader (:mod:`pipeline.flow.subscription_reader`) must not hold a harness thread on Pub/Sub. The real
service answers a unary pull as it gathers messages, up to the call's deadline ("we may hang up until the max rpc
deadline": googleapis/google-cloud-java#3168), so a short deadline ends in ``DeadlineExceeded`` with messages
waiting (googleapis/python-pubsub#343), and the client's maintainers name 60 s as the pull's deadline
(googleapis/python-pubsub#1414; Pub/Sub's pull guide: https://cloud.google.com/pubsub/docs/pull). So the pulling
happens here, on one daemon thread per SDK process, runtime and subscription, which may wait as long as Pub/Sub
takes; a reader's round only takes what this thread has pulled, under a lock, and never waits
(:meth:`SubscriptionFeed.take`).

Each pull asks for no more messages than the places the feed took in the worker's hold first
(:mod:`pipeline.worker.read_places`), so nothing is pulled past the bound. Its places are named by the feed and its
pull's number, so a call to the runtime carried out after its bound and made again takes the same places; every way
out of a pull, an exception included, gives back the places it did not fill. A filled place counts from the pull's
end, and the places of what the feed holds are renewed every ``RENEW_S``, so only a place the feed lost lapses,
after ``AdmissionSettings.place_open_s``. The ack deadline of what it holds is extended to ``ack_deadline_s`` (make
setup gives the job's subscriptions the same 120 s); a round's bundle finalizer acknowledges what it took, and its
end gives back the places of its dead letters, each on a thread of the feed's. A message no round takes within
``HELD_MOST_S`` goes back to Pub/Sub, for a process whose readers run, and no round takes it. What Pub/Sub's errors
mean for it is :mod:`pipeline.flow.pubsub_trouble`'s.

A feed no round has taken from for ``IDLE_S`` (its readers moved away) gives back what it holds, its messages at
once (an ack deadline of 0), and stops pulling until a round asks again; it pulls only while its rounds come (one
asked within ``ASKED_WITHIN_S``), so a process whose readers run rarely (a worker runs an SDK process per vCPU)
keeps no places from those whose readers run. Beam's counters count only within a bundle, so the feed keeps its
counts and every round in its process, of any reader and lane, adds them (:meth:`counts`); after a drain no round
runs, and the last counts stay uncounted.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.contract.call_outcome import Call
from pipeline.flow.feed_acks import FeedAcks
from pipeline.flow.pubsub_trouble import CALL_DEADLINE_S, PubSubTrouble, call_retry
from pipeline.flow.subscription_backlog import SubscriptionBacklog
from pipeline.worker import read_places
from pipeline.worker.load import LOAD_NAMESPACE
from pipeline.worker.runtime import RuntimeSource
from pipeline.worker.runtime_client import RuntimeClient

LOGGER = logging.getLogger(__name__)

# The most messages one pull asks for, and the most a feed holds pulled and not yet taken by a round.
PULL_MOST = 32
# What a pull asks for after one that came back empty; each pull that gets all it asked for asks twice as many next,
# up to PULL_MOST. An idle feed's open pull so keeps few places, and a worker's feeds (one an SDK process) all pull.
PULL_FIRST = 4
# How long a pull may wait for messages: long enough for Pub/Sub to gather a backlog's messages, short enough that
# what the feed holds is renewed (RENEW_S, after the pull) well within AdmissionSettings.place_open_s.
PULL_DEADLINE_S = 20.0
# The least time between two pulls after one that got nothing: a service that answers an empty pull at once waits.
PULL_EVERY_S = 0.5
# How long the feed waits before it asks for places again when the worker had none to give.
FULL_WAIT_S = 0.2
# How often the places and ack deadlines of what the feed holds are renewed.
RENEW_S = 10.0
# A feed no round has taken from for this long gives back what it holds and stops pulling.
IDLE_S = 30.0
# A feed pulls only if a round asked within this long: a few of an idle reader's intervals (EMPTY_DELAY_S, 1 s).
ASKED_WITHIN_S = 3.0
# A message a feed has held this long (or half place_open_s, if less: its place lapses then) without a round taking
# it goes back to Pub/Sub, for a feed whose rounds come to take it, and no round takes it (it would pass the bound).
HELD_MOST_S = 5.0
# How long the feed waits after a refusal (PermissionDenied, NotFound, unreachable) before it pulls again.
REFUSED_WAIT_S = 10.0
# Backoff for errors worth trying again at once: the first wait, doubled up to the most.
RETRY_FIRST_S, RETRY_MOST_S = 0.1, 10.0
# A taken message whose finalizer has not acknowledged it this long after the round took it is counted once.
FINALIZE_LATE_S = 120.0

# How a feed's call reaches the worker's runtime: (what, call) -> (outcome, answer), as RuntimeClient.call.
RuntimeCall = Callable[[str, Callable[[Any], Any]], tuple[Call, Any]]
# Per process: the feeds, by (runtime tag, subscription, lane).
_FEEDS: dict[tuple[str, str, bool], SubscriptionFeed] = {}
_FEEDS_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Pulled:
    """A message the feed pulled, with the place it holds in the worker's hold."""

    received: Any  # the ReceivedMessage
    place: str
    size: int
    pulled_at: float


def feed_for(subscription: str, source: RuntimeSource, bulk: bool, ack_deadline_s: int,
             client: Callable[[], Any] | None = None) -> SubscriptionFeed:
    """This process's feed of ``subscription`` for the runtime ``source`` names (started on first use)."""
    key = (source.tag, subscription, bulk)
    with _FEEDS_LOCK:
        feed = _FEEDS.get(key)
        if feed is None or not feed.alive():
            feed = _FEEDS[key] = SubscriptionFeed(subscription, source, bulk, ack_deadline_s, client)
        return feed


def existing_feed(subscription: str, tag: str, bulk: bool) -> SubscriptionFeed | None:
    """This process's feed of ``subscription``, if a round started one (never starts one)."""
    with _FEEDS_LOCK:
        return _FEEDS.get((tag, subscription, bulk))


def feeds_of(tag: str) -> list[SubscriptionFeed]:
    """This process's feeds for the runtime ``tag`` names, every subscription and lane."""
    with _FEEDS_LOCK:
        return [feed for (feed_tag, _, _), feed in _FEEDS.items() if feed_tag == tag]


class SubscriptionFeed:
    """See the module docstring. ``client`` makes the Pub/Sub ``SubscriberClient`` (by default the library's)."""

    def __init__(self, subscription: str, source: RuntimeSource | None, bulk: bool, ack_deadline_s: int,
                 client: Callable[[], Any] | None = None, *, clock: Callable[[], float] = time.monotonic,
                 runtime_call: RuntimeCall | None = None, backlog: SubscriptionBacklog | None = None,
                 start: bool = True) -> None:
        """``clock``, ``runtime_call`` (how a call reaches the worker's runtime: by default the one call policy,
        :class:`RuntimeClient`), ``backlog`` (by default Cloud Monitoring's) and ``start=False`` (no thread: the
        caller runs :meth:`step`) let the worker's simulator (``tests/vm_sim.py``) run this feed on its own clock."""
        self.subscription = subscription
        self._source = source
        self._bulk = bulk
        self._ack_deadline_s = ack_deadline_s
        self._make_client = client
        self._clock = clock
        self._call = runtime_call or self._client_call
        self._name = f"{uuid.uuid4().hex[:12]}"
        self._pulls = itertools.count()
        self._name_of_pull: tuple[str, int] | None = None  # a reserve not answered: the next asks for it again
        self._runtime: RuntimeClient | None = None
        self._held: collections.deque[Pulled] = collections.deque()
        self._taken: dict[str, float] = {}  # ack id -> when a round took it, until acknowledged
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Condition()
        self._asked_at = clock()  # when a round last asked
        self._renewed_at = clock()
        self._retry_wait = RETRY_FIRST_S
        self._held_most_s = min(HELD_MOST_S, source.settings.admission.place_open_s / 2) if source else HELD_MOST_S
        self._want = PULL_FIRST  # how many the next pull asks for (at most the room)
        # What the last turn found, for the rounds (read-only to them): the worker had no room for this feed at its
        # last ask (the round defers as a full one); the last pull found the subscription empty (the reader's
        # watermark may follow the clock); the last pull was refused, or Pub/Sub could not be reached (logged).
        self.full = self.empty = self.refused = False
        self.trouble = PubSubTrouble(subscription, self._count, self._client, clock)
        self.backlog = backlog or SubscriptionBacklog(subscription)
        self._stopped = False
        self._not_before = 0.0  # a pause the feed keeps, whatever wakes it
        self._thread = threading.Thread(target=self._run, name=f"pubsub-feed-{subscription.rsplit('/', 1)[-1]}",
                                        daemon=True)
        self._acks = FeedAcks(subscription, ack_deadline_s, self._client, self._count, self.trouble.warn, start=start)
        self._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="feed-dispatch") if start else None
        if start:
            self._thread.start()

    # What a round calls (never waits on Pub/Sub or the runtime) -----------------------------------------------

    def take(self, most: int) -> list[Pulled]:
        """Up to ``most`` of the messages pulled, oldest first, none held too long; their places and acks are theirs."""
        now = self._clock()
        with self._lock:
            self._asked_at = now
            held = list(self._held)  # oldest first: those held too long are a prefix
            n = next((n for n, pulled in enumerate(held) if now - pulled.pulled_at < self._held_most_s), len(held))
            taken, self._held = held[n:n + most], collections.deque(held[:n] + held[n + most:])
            for pulled in taken:
                self._taken[pulled.received.ack_id] = now
            self._lock.notify_all()
        return taken

    def acknowledge(self, ack_ids: list[str]) -> None:
        """A bundle's finalizer: its messages' output committed. Beam runs finalizers on a harness thread, so this
        only queues them for the feed's acknowledgements (:mod:`pipeline.flow.feed_acks`) and returns at once."""
        now = self._clock()
        with self._lock:
            taken_at = min((self._taken.pop(ack_id, now) for ack_id in ack_ids), default=now)
        self._acks.submit(ack_ids, taken_at)

    def left_over(self, places: list[str]) -> None:
        """A read bundle ended, and the admission step fused after it took over none of these places: their
        messages became dead letters (of the parse or measure step), which go nowhere near the generate step, so the
        places go back to the worker's room, told to the runtime on a feed's thread: a bundle's end waits on nothing."""
        if not places:
            return
        try:
            if self._dispatcher is not None:
                self._dispatcher.submit(self._call, "give back places", lambda runtime: runtime.withdraw(places))
                return
        except RuntimeError:  # the feed stopped: told from here
            pass
        self._call("give back places", lambda runtime: runtime.withdraw(places))

    def counts(self) -> dict[str, int]:
        """What the feed counted since the last call (for a round to add to Beam's counters)."""
        with self._lock:
            found, self._counts = dict(self._counts), collections.Counter()
        return found

    def held_bytes(self) -> int:
        with self._lock:
            return sum(pulled.size for pulled in self._held)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def stop(self) -> None:
        """Gives back what it holds and ends its thread (tests, and a process's end)."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout=PULL_DEADLINE_S + 5)
        else:  # never started (start=False): closed here
            self._close()

    # The feed's own thread ----------------------------------------------------------------------------------

    def _client(self) -> Any:
        """The Pub/Sub client, made on first use outside the lock (it may wait for the worker's credentials, and a
        round's take must not)."""
        client = getattr(self, "_subscriber", None)
        if client is not None:
            return client
        if self._make_client is not None:
            made = self._make_client()
        else:
            from google.cloud import pubsub_v1
            made = pubsub_v1.SubscriberClient()
        with self._lock:  # the feed's thread and the acknowledging thread may both have made one
            if getattr(self, "_subscriber", None) is None:
                self._subscriber = made
            return self._subscriber

    def _count(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def _client_call(self, what: str, call: Callable[[Any], Any]) -> tuple[Call, Any]:
        """The one call policy; what it counts on this thread Beam drops (no bundle), so the feed counts it."""
        assert self._source is not None, "a feed without a runtime source is given runtime_call"
        if self._runtime is None:
            self._runtime = RuntimeClient(self._source, LOAD_NAMESPACE)
        outcome, answer = self._runtime.call(what, call)
        if outcome is Call.UNREACHABLE:
            self._count("runtime_unreachable")
        elif outcome is Call.FAILED:
            self._count("engine_call_failures")
        return outcome, answer

    def _run(self) -> None:
        self.backlog.refresh_soon()
        while True:
            with self._lock:
                if self._stopped:
                    break
            try:
                wait = self.step()
            except Exception:  # noqa: BLE001 - a feed's thread must outlive what goes wrong in one turn
                LOGGER.exception("A turn of the feed of %s failed; it goes on in a second", self.subscription)
                wait = 1.0
            self._pause(wait)
        self._close()

    def _close(self) -> None:
        self._give_back()
        self._acks.stop()  # what finalizers asked for is sent before the client closes
        if self._dispatcher is not None:
            self._dispatcher.shutdown(wait=True)
        client = getattr(self, "_subscriber", None)
        if client is not None:
            client.close()

    def step(self) -> float:
        """One turn of the feed: give back what no round asked for, renew what it holds, or pull as much as it has
        places for. Returns how long to wait before the next turn (a round's take ends a wait for room early)."""
        now = self._clock()
        with self._lock:
            idle = now - self._asked_at > IDLE_S
            unasked = now - self._asked_at > ASKED_WITHIN_S
            room = PULL_MOST - len(self._held)
            give_back = bool(self._held) and (idle or now - self._held[0].pulled_at >= self._held_most_s)
        if give_back:
            self._give_back(older_than_s=0.0 if idle else self._held_most_s)
            return 0.0
        if now - self._renewed_at >= RENEW_S:
            self._renew()
            self._renewed_at = now
        if unasked or room <= 0:
            self._not_before = now  # a round's take ends this wait
            return 1.0
        after = self._pull_once(room)
        self.empty, self.refused = after == "empty", after == "refused"
        if after == "retry":
            wait, self._retry_wait = self._retry_wait, min(self._retry_wait * 2, RETRY_MOST_S)
        elif after == "pulled":
            self._retry_wait, wait = RETRY_FIRST_S, 0.0  # more may be waiting: pull again while there are places
        else:
            self._retry_wait = RETRY_FIRST_S
            pause = {"full": FULL_WAIT_S, "refused": REFUSED_WAIT_S}.get(after, 0.0)
            wait = max(pause, PULL_EVERY_S - (self._clock() - now))
        self._not_before = self._clock() + wait  # a backoff no round's take cuts short
        return wait

    def _pause(self, seconds: float) -> None:
        """Waits, unless stopped meanwhile: a backoff or a refusal's wait for all of it; a wait for room (the feed
        holds all it may) until a round takes."""
        deadline = time.monotonic() + seconds
        with self._lock:
            while not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._lock.wait(timeout=left)
                if self._clock() >= self._not_before and len(self._held) < PULL_MOST:
                    return

    def _pull_once(self, most: int) -> str:
        """One pull for up to ``most`` messages, then: ``pulled``, ``empty``, ``full``, ``retry``, ``refused``."""
        # A reserve left unanswered is asked again under its name and for as many: one carried out late took those
        # places, which this one then finds its own, not more.
        self._name_of_pull = self._name_of_pull or (f"{self._name}-{next(self._pulls)}", min(most, self._want))
        name, want = self._name_of_pull
        outcome, places = self._call(
            "take places", lambda runtime: read_places.reserve(runtime, want, self._bulk, name))
        if outcome is not Call.ANSWERED:  # silent or gone: the client recovers; a late answer's places lapse
            self.full = False  # not full: unasked (counted runtime_unreachable), and nothing is pulled
            return "refused"
        self._name_of_pull = None
        if len(places) > most:  # asked again for as many as before, more than the feed has room for now
            extra, places = places[most:], places[:most]
            self._call("give back places", lambda runtime: runtime.withdraw(extra))
        if not places:
            outcome, full = self._call("ask if full", lambda runtime: runtime.full(self._bulk))
            self.full = outcome is Call.ANSWERED and bool(full)  # unasked is not full (runtime_unreachable)
            if self.full:
                self._count("read_deferred")
            return "full"
        self.full = False
        received: list[Any] = []
        began, deadline_s = self._clock(), self._pull_deadline()
        try:
            received = self._pull(len(places), deadline_s)
            # Slow start: twice as many after a pull that filled all its places; after one that did not, half (the
            # real service often answers a unary pull with fewer messages than it holds), never below what came.
            self._want = min(PULL_MOST, 2 * self._want) if len(received) == len(places) else \
                max(PULL_FIRST, len(received), self._want // 2)
            return "pulled" if received else "empty"
        except Exception as exc:  # noqa: BLE001 - classified below
            after = self.trouble.after(exc, ran_s=self._clock() - began, deadline_s=deadline_s)
            if after == "empty":  # the real service ends an empty long pull with DeadlineExceeded
                self._want = PULL_FIRST
            return after
        finally:
            self._keep(received, places)

    def _pull(self, most: int, deadline_s: float) -> list[Any]:
        """One long pull of at most ``deadline_s`` (:meth:`_pull_deadline`)."""
        response = self._client().pull(subscription=self.subscription, max_messages=most, timeout=deadline_s,
                                       retry=None)
        self.trouble.reached()
        return list(response.received_messages)

    def _pull_deadline(self) -> float:
        """How long a pull may wait: while the feed holds messages, no longer than they may stay (``HELD_MOST_S``)."""
        with self._lock:
            holding = bool(self._held)
        return self._held_most_s if holding else PULL_DEADLINE_S

    def _keep(self, received: list[Any], places: list[str]) -> None:
        """What a pull got joins what the feed holds, each with a place; the places it did not fill go back."""
        now = self._clock()
        unused = places[len(received):]
        with self._lock:
            self._held.extend(Pulled(message, place, len(message.message.data), now)
                              for message, place in zip(received, places, strict=False))
        filled = places[:len(received)]  # work now, no longer room a pull keeps (the worker's full)
        self._call("give back places", lambda runtime: runtime.settled(filled, unused))
        if received:  # after the places: an extension Pub/Sub is slow to take holds no room meanwhile
            self._count("read_messages", len(received))
            self._extend([m.ack_id for m in received], self._ack_deadline_s)

    def _extend(self, ack_ids: list[str], seconds: int) -> None:
        if not ack_ids:
            return
        try:
            self._client().modify_ack_deadline(subscription=self.subscription, ack_ids=ack_ids,
                                               ack_deadline_seconds=seconds, timeout=CALL_DEADLINE_S,
                                               retry=call_retry())
        except Exception as exc:  # noqa: BLE001 - Pub/Sub may deliver them again sooner; the dedupe serves once
            self._count("modify_failed", len(ack_ids))
            self.trouble.warn("modify", "Extending the ack deadline of %d messages of %s failed (%s): they may be "
                              "delivered again (counter modify_failed)", len(ack_ids), self.subscription, exc)

    def _renew(self) -> None:
        """What the feed holds keeps its places and its ack deadlines; taken messages not acknowledged long after
        are counted (their finalizer did not run: Pub/Sub delivers them again)."""
        now = self._clock()
        with self._lock:
            held = list(self._held)
            late = [ack_id for ack_id, at in self._taken.items() if now - at > FINALIZE_LATE_S]
            for ack_id in late:
                del self._taken[ack_id]
        if late:
            self._count("finalize_late", len(late))
            self.trouble.warn("finalize", "%d messages of %s were handed on %g s ago and not acknowledged: their "
                              "bundles' finalizers did not run (counter finalize_late); Pub/Sub delivers them again",
                              len(late), self.subscription, FINALIZE_LATE_S)
        self.backlog.refresh_soon()
        if held:
            places = [pulled.place for pulled in held]
            outcome, missed = self._call("renew places", lambda runtime: read_places.renew(runtime, places))
            with self._lock:  # a place a round took meanwhile, and the admission step took over, is not lost
                lost = set(missed or ()) & {pulled.place for pulled in self._held}
            if outcome is Call.ANSWERED and lost:
                # Places the worker no longer counts (a rebuilt runtime's new ledger, places that lapsed while the
                # feed could not renew them): their messages would pass uncounted, so they go back and are pulled
                # again in places that count.
                LOGGER.info("%d of the %d places this feed of %s holds no longer count in the worker's hold; their "
                            "messages go back to Pub/Sub", len(lost), len(places), self.subscription)
                self._give_back(places=lost)
            self._extend([pulled.received.ack_id for pulled in held if pulled.place not in lost], self._ack_deadline_s)

    def _give_back(self, older_than_s: float = 0.0, places: set[str] | None = None) -> None:
        """Returns what the feed has held longer than ``older_than_s`` (all of it by default; with ``places``, only
        those in them): its messages to Pub/Sub at once, its places to the worker."""
        now = self._clock()
        with self._lock:
            going = [now - pulled.pulled_at >= older_than_s and (places is None or pulled.place in places)
                     for pulled in self._held]
            held = [pulled for pulled, goes in zip(self._held, going, strict=True) if goes]
            self._held = collections.deque(pulled for pulled, goes in zip(self._held, going, strict=True) if not goes)
        if not held:
            return
        self._extend([pulled.received.ack_id for pulled in held], 0)
        returned = [pulled.place for pulled in held]
        self._call("give back places", lambda runtime: runtime.withdraw(returned))
        self._count("given_back", len(held))

