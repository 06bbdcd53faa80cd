"""The reader's feed (pipeline/flow/subscription_feed.py) against a Pub/Sub that misbehaves as the real one does.

Each test runs the real feed thread, the real Pub/Sub client and the real admission ledger (what the worker's
runtime holds its places in), with the Pub/Sub emulator behind the fault proxy (tests/pubsub_fault_proxy.py):
short and empty pulls, UNAVAILABLE / INTERNAL / DEADLINE_EXCEEDED, late answers, failed acknowledgements and
deadline changes, and delivery again after the ack deadline. A round is played as the reader's DoFn plays it
(take, hand each place to its request, acknowledge once the bundle "committed"), and as the admission step does
(the request in place of its place), so the ledger's count is the real one.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time

import grpc
import pytest
from google.cloud import pubsub_v1

from pipeline.contract.call_outcome import Call
from pipeline.flow import pubsub_trouble, subscription_backlog, subscription_feed
from pipeline.flow.feed_acks import FeedAcks
from pipeline.flow.subscription_reader import CheckpointsOnly, PullWithinRoomFn
from tests.conftest import wait_until
from tests.feed_harness import (
    ACK_DEADLINE_S,
    BOUND,
    a_feed,
    a_worker,
    held,
    publish,
    serve_rounds,
    short_deadline_subscription,
    through,
)
from tests.observability_stand_in import ObservabilityStandIn
from tests.pubsub_fault_proxy import FaultProxy, Faults


@pytest.fixture()
def subscription(emulator):
    """A topic and a subscription whose ack deadline is Pub/Sub's least, 10 s: what nobody acknowledged comes
    back that soon."""
    return short_deadline_subscription(emulator, f"feed-{time.monotonic_ns()}")


@pytest.fixture()
def proxy(emulator, monkeypatch):
    """The fault proxy in front of the emulator; the feed's client (and only it) reaches Pub/Sub through it."""
    found = FaultProxy(os.environ["PUBSUB_EMULATOR_HOST"], seed=int(os.environ.get("FEED_SEED", "7")))
    yield found
    found.close()


def test_a_backlog_ten_times_the_bound_ends_each_request_once_through_faults(subscription, proxy, monkeypatch):
    """Fifty requests, ten times the worker's bound, through a Pub/Sub that shortens a third of the pulls, refuses a
    fifth of the calls, answers a fifth of the pulls after their deadline, loses a fifth of the answers after
    carrying them out and fails a tenth of the acknowledgements; one bundle in seven fails. Every request ends, no
    request is admitted without a place (nothing was pulled past the bound), and once the lost places' time is up
    the ledger is at zero."""
    monkeypatch.setattr(subscription_feed, "PULL_DEADLINE_S", 2.0)  # so that a slow answer comes too late
    topic, path = subscription
    expected = set(publish(topic, 10 * BOUND))
    proxy.faults = Faults(short=0.3, error=0.2, slow=0.2, slow_s=3.0, lost=0.2, ack_error=0.1)
    source = a_worker(place_open_s=3.0)
    feed = a_feed(path, source, proxy)
    try:
        served = serve_rounds(feed, source, expected, timeout_s=240, fail_every=7)
    finally:
        feed.stop()
    assert set(served.ended) == expected, f"{len(expected - set(served.ended))} never ended; {dict(proxy.done)}"
    assert served.uncounted == 0 and served.most <= BOUND, (served.uncounted, served.most)
    assert served.failed > 0 and {"Pull slow", "Pull lost", "Pull short"} <= set(proxy.done), proxy.done
    time.sleep(source.settings.admission.place_open_s + 0.5)
    assert held(source) == 0, "every place given back, taken over or lapsed"


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                  grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.PERMISSION_DENIED,
                                  grpc.StatusCode.NOT_FOUND])
def test_a_pull_that_fails_gives_back_its_places(subscription, proxy, code, caplog):
    """Whatever a pull fails with, the places it took are back in the worker's room once it ends; a refusal is
    said in the log with its cause and counted, never taken for an empty subscription."""
    topic, path = subscription
    publish(topic, 3)
    proxy.faults = Faults(error=1.0, codes=(code,), only=frozenset({"Pull"}))
    source = a_worker()
    with caplog.at_level(logging.WARNING, logger="pipeline.flow.subscription_feed"):
        feed = a_feed(path, source, proxy)
        try:
            time.sleep(1.5)
            counts, empty = feed.counts(), feed.empty
        finally:
            feed.stop()
    assert held(source) == 0
    assert not counts.get("read_messages")
    assert not empty, "a pull answered at once with an error says nothing of the subscription's backlog"
    kind = pubsub_trouble.classify(_error(code))
    if kind == "refused":
        assert counts.get("pull_refused") and "refuses to let this worker pull" in caplog.text
    else:  # retried: DEADLINE_EXCEEDED too, answered long before the pull's deadline (cut off, not an empty pull)
        assert counts.get("pull_retried", 0) >= 2, counts  # tried again, with backoff


def _error(code: grpc.StatusCode) -> Exception:
    from google.api_core import exceptions

    return exceptions.from_grpc_status(code, "x")


def test_places_a_late_call_took_lapse_within_place_open_s(subscription, proxy):
    """The worker's runtime answers each call only after the call's bound (a paused host): the feed counts it
    unreachable and pulls nothing, and the places the late calls took, owned by nobody, stop counting within
    place_open_s."""
    topic, path = subscription
    publish(topic, 3)
    source = a_worker(place_open_s=2.0, pause_s=6.0)  # the call bound is 5 s
    feed = a_feed(path, source, proxy)
    most = 0
    try:
        deadline = time.monotonic() + 14
        while time.monotonic() < deadline:
            most = max(most, held(source))
            time.sleep(0.1)
        counts = feed.counts()
        assert feed.refused and not feed.full, "unasked is not full: the reader says nothing of a full worker"
        assert counts.get("runtime_unreachable") and not counts.get("read_messages"), counts
    finally:
        feed.stop()
    assert 0 < most <= BOUND, "the late calls took places, no more than the worker had"
    time.sleep(source.pause_s + source.settings.admission.place_open_s + 0.5)  # the last call lands, then lapses
    assert held(source) == 0, "a lost place lapses in place_open_s, not in request_timeout_s"


def test_an_idle_feed_gives_its_messages_back_to_pubsub_and_its_places_to_the_worker(subscription, proxy,
                                                                                      monkeypatch):
    """No round asks (the readers moved to another worker): the feed returns what it holds, at once."""
    monkeypatch.setattr(subscription_feed, "IDLE_S", 2.0)
    topic, path = subscription
    publish(topic, 4)
    source = a_worker()
    feed = a_feed(path, source, proxy)
    try:
        given_back = counted(feed, "given_back", 4, within_s=20)
        assert given_back == 4 and held(source) == 0
        assert len(PullTaker(path).take()) == 4, "back in the subscription before their ack deadline"
    finally:
        feed.stop()


def counted(feed: subscription_feed.SubscriptionFeed, name: str, wanted: int, within_s: float,
            asking: bool = False) -> int:
    """What the feed counts of ``name`` until it reaches ``wanted`` or ``within_s`` pass (``asking``: a round's
    take of nothing each time, as a reader that finds nothing keeps asking)."""
    found, deadline = 0, time.monotonic() + within_s
    while found < wanted and time.monotonic() < deadline:
        if asking:
            feed.take(0)
        found += feed.counts().get(name, 0)
        time.sleep(0.1)
    return found


class PullTaker:
    """Pulls a subscription directly (not through the proxy), acknowledging nothing."""

    def __init__(self, path: str) -> None:
        self.path = path

    def take(self) -> list[bytes]:
        """What the subscription holds now, each message once (a pull may return fewer than there are)."""
        client = pubsub_v1.SubscriberClient()
        found: dict[bytes, None] = {}
        try:
            for _ in range(3):  # what it pulls comes back after the ack deadline, so a few pulls, not until empty
                try:
                    got = client.pull(subscription=self.path, max_messages=100, timeout=3).received_messages
                except Exception:  # noqa: BLE001 - an empty pull the emulator held to its deadline
                    got = []
                found.update((m.message.data, None) for m in got)
            return list(found)
        finally:
            client.close()


def test_a_bundle_whose_finalizer_never_runs_is_counted_and_its_messages_come_back(subscription, proxy,
                                                                                    monkeypatch):
    monkeypatch.setattr(subscription_feed, "FINALIZE_LATE_S", 1.0)
    monkeypatch.setattr(subscription_feed, "RENEW_S", 0.5)
    topic, path = subscription
    publish(topic, 2)
    source = a_worker()
    feed = a_feed(path, source, proxy)
    try:
        deadline = time.monotonic() + 20
        taken: list = []
        while len(taken) < 2 and time.monotonic() < deadline:
            taken += feed.take(32)
            time.sleep(0.1)
        # A round that finds nothing keeps the feed from going idle meanwhile.
        late = counted(feed, "finalize_late", 2, within_s=deadline - time.monotonic(), asking=True)
    finally:
        feed.stop()
    assert late == 2
    time.sleep(ACK_DEADLINE_S + 1)
    assert len(PullTaker(path).take()) == 2, "never acknowledged: delivered again"


def test_failed_acknowledgements_are_counted(subscription, proxy):
    topic, path = subscription
    publish(topic, 3)
    proxy.faults = Faults(ack_error=1.0, only=frozenset({"Acknowledge"}))
    source = a_worker()
    feed = a_feed(path, source, proxy)
    try:
        expected = {f"req-{i}" for i in range(3)}
        serve_rounds(feed, source, expected, timeout_s=20)
        # Acknowledged on the feed's own thread, after the client's retries of UNAVAILABLE.
        assert counted(feed, "ack_failed", 3, within_s=3 * pubsub_trouble.CALL_DEADLINE_S) == 3
    finally:
        feed.stop()


def test_the_backlog_a_reader_reports_follows_the_subscriptions_and_is_shared(monkeypatch):
    """Cloud Monitoring's backlog bytes of three subscriptions (empty, 33 messages of 200 bytes, 100,000 of them),
    through the stand-in of its timeSeries.list: each reader reports its share, zero for the empty one, in the
    backlogs' order; with no figure (Monitoring refuses), what the feed itself holds."""
    stand_in = ObservabilityStandIn("proj-feed")
    try:
        for name, messages in (("empty", 0), ("some", 33), ("many", 100_000)):
            stand_in.gauge("pubsub.googleapis.com/subscription/backlog_bytes", "pubsub_subscription", {},
                           {"subscription_id": name, "project_id": "proj-feed"},
                           lambda s, total=200 * messages: total)
        monkeypatch.setenv(subscription_backlog.ENDPOINT_VARIABLE, stand_in.env()[
            subscription_backlog.ENDPOINT_VARIABLE])
        sizes = {}
        for name in ("empty", "some", "many"):
            backlog = subscription_backlog.SubscriptionBacklog(f"projects/proj-feed/subscriptions/{name}")
            backlog.refresh()
            sizes[name] = backlog.bytes()
        assert sizes == {"empty": 0, "some": 6_600, "many": 20_000_000}
        worker = a_worker()
        fn = PullWithinRoomFn(worker, readers=8)
        assert fn.restriction_size(("projects/proj-feed/subscriptions/many", 0), None) == 0, "no feed: nothing"
        for name, backlog_bytes in sizes.items():  # a feed of this process (not started: no pulls here)
            path = f"projects/proj-feed/subscriptions/{name}"
            feed = subscription_feed.SubscriptionFeed(path, worker, False, ACK_DEADLINE_S, start=False)
            feed.backlog.refresh()
            subscription_feed._FEEDS[(worker.tag, path, False)] = feed
            assert fn.restriction_size((path, 3), None) == -(-backlog_bytes // 8), "each of 8 readers its share"
        stand_in.denied.add("monitoring")
        refused = subscription_backlog.SubscriptionBacklog("projects/proj-feed/subscriptions/many")
        refused.refresh()
        assert refused.bytes() is None
    finally:
        stand_in.close()


def test_a_reader_splits_only_to_checkpoint():
    """Dataflow does not split an unbounded restriction today; a split that would make two readers of one
    subscription is refused, a checkpoint is not."""
    from apache_beam.io.restriction_trackers import OffsetRange

    tracker = CheckpointsOnly(OffsetRange(0, 1_000))
    assert tracker.try_claim(0)
    assert tracker.try_split(0.5) is None
    primary, residual = tracker.try_split(0)
    assert (primary.stop, residual.start) == (1, 1)


def test_a_feed_whose_places_no_longer_count_gives_its_messages_back(subscription, proxy, monkeypatch):
    """The worker's runtime was rebuilt (its new ledger knows none of the feed's places) while the feed held pulled
    messages: they would pass on uncounted, past the worker's bound, so the feed's next renewal gives them back to
    Pub/Sub, and it pulls again in places that count."""
    monkeypatch.setattr(subscription_feed, "RENEW_S", 0.01)  # each turn renews
    monkeypatch.setattr(subscription_feed, "HELD_MOST_S", 120.0)  # held messages would not go back on their own
    topic, path = subscription
    publish(topic, BOUND)
    source = a_worker()
    feed = a_feed(path, source, proxy)
    try:
        assert wait_until(lambda: (feed.take(0), held(source))[1] == BOUND, 20), "the feed holds the worker's bound"
        source.ledger.withdraw(list(source.ledger._hold._ids))  # as a rebuilt runtime's new ledger knows none
        assert held(source) == 0
        assert counted(feed, "given_back", BOUND, within_s=20, asking=True) == BOUND
        assert wait_until(lambda: (feed.take(0), held(source))[1] == BOUND, 20), "pulled again, counted"
    finally:
        feed.stop()


def test_a_renewal_that_crosses_a_round_gives_back_none_of_what_the_feed_still_holds(subscription, proxy):
    """A renewal copies the places the feed holds, then asks the worker; a round takes one of those messages
    meanwhile and the admission step takes over its place, so the worker no longer has that place to renew. That
    one was handed on, not lost: the feed keeps the rest, and their deadlines are extended, nothing given back.
    The interleaving is made exact by running the round inside the renewal's call to the real ledger."""
    topic, path = subscription
    publish(topic, 3)
    source = a_worker()

    def runtime_call(what: str, call):
        if what == "renew places":  # the round and its admission, between the feed's copy and the worker's answer
            taken = feed.take(1)
            assert source.ledger.admit([f"req-of-{taken[0].place}"], in_place_of=[taken[0].place]) == 1
        return Call.ANSWERED, call(source.ledger)

    feed = subscription_feed.SubscriptionFeed(path, source, False, ACK_DEADLINE_S, through(proxy),
                                              runtime_call=runtime_call, start=False)
    try:
        assert wait_until(lambda: (feed.step(), len(feed._held))[1] == 3, 20), "the feed pulled all three"
        feed._renew()
        assert len(feed._held) == 2 and not feed.counts().get("given_back"), "nothing it still holds went back"
        assert held(source) == 3, "two places renewed and one request in the place it took"
    finally:
        feed.stop()


def test_a_round_that_comes_after_the_feeds_thread_stalled_takes_no_message_whose_place_may_have_lapsed(
        subscription, proxy):
    """The feed's thread gives back what it held too long, but a thread held up (a stalled call, a starved process)
    gives back nothing: a round that comes then must not take a message whose place lapsed, or the worker admits it
    uncounted, past its bound, and pulls more in the lapsed place's room. A round takes only what was pulled within
    half place_open_s (HELD_MOST_S, if less); the rest goes back at the thread's next turn."""
    topic, path = subscription
    publish(topic, 3)
    source = a_worker(place_open_s=3.0)
    now = [time.monotonic()]
    feed = subscription_feed.SubscriptionFeed(path, source, False, ACK_DEADLINE_S, through(proxy),
                                              clock=lambda: now[0], start=False)
    try:
        assert wait_until(lambda: (feed.step(), len(feed._held))[1] == 3, 20), "the feed pulled all three"
        now[0] += 1.0
        assert len(feed.take(1)) == 1, "within half place_open_s: taken"
        now[0] += 0.6  # 1.6 s after the pull: past half of the 3 s, with no turn of the feed's thread between
        assert feed.take(2) == [] and len(feed._held) == 2, "held too long: not taken"
        feed.step()
        assert not feed._held and feed.counts().get("given_back") == 2, "the next turn gave them back"
    finally:
        feed.stop()


def test_acknowledgements_that_wait_on_a_slow_pubsub_go_together_and_late_ones_are_counted(subscription, proxy):
    """Pub/Sub answers every acknowledgement after 1.5 s. Six bundles' finalizers each hand over their ack ids at
    once; the first call goes alone, the five that waited behind it go in one more call (not five), and every
    message is acknowledged at the emulator while its lease runs. With an ack deadline of 1 s (the stand-in's
    leases are the subscription's 10 s), the ones that waited past it are counted late."""
    topic, path = subscription
    publish(topic, 6)
    puller = through(proxy)()  # through the proxy, which so knows each message's lease
    try:
        received = list(puller.pull(subscription=path, max_messages=6, timeout=10).received_messages)
        while len(received) < 6:
            received += puller.pull(subscription=path, max_messages=6, timeout=10).received_messages
    finally:
        puller.close()
    proxy.faults = Faults(slow=1.0, slow_s=1.5, only=frozenset({"Acknowledge"}))
    counts: collections.Counter[str] = collections.Counter()
    client = through(proxy)()
    acks = FeedAcks(path, 1.0, lambda: client, lambda name, value: counts.update({name: value}), lambda *args: None)
    try:
        taken_at = time.monotonic()
        acks.submit([received[0].ack_id], taken_at)
        assert wait_until(lambda: not acks._queue, 5)  # the thread took it
        time.sleep(0.3)  # and its call is under way at the proxy
        for message in received[1:]:
            acks.submit([message.ack_id], taken_at)
    finally:
        acks.stop()
    assert proxy.counts()["Acknowledge slow"] == 2, proxy.counts()
    assert counts["acked"] == 6 and counts["ack_late"] == 5, counts
    assert {json.loads(data)["id"] for data in proxy.acknowledged()} == {f"req-{i}" for i in range(6)}


def test_a_monitoring_endpoint_override_keeps_the_workers_credentials_unless_it_is_a_loopback_stand_in():
    """Found by review: gcloud's override variable also names private endpoints; every override was called with
    anonymous credentials, so a job pointed at one would be refused. Only a loopback http:// stand-in goes
    without."""
    assert subscription_backlog._loopback("http://127.0.0.1:8123")
    assert subscription_backlog._loopback("http://localhost:9000/")
    assert not subscription_backlog._loopback("https://monitoring.p.googleapis.com/")
    assert not subscription_backlog._loopback("https://127.0.0.1:8443")
    assert not subscription_backlog._loopback("http://monitoring.internal.example:80")


def test_deadline_changes_that_always_fail_cost_redeliveries_not_room(subscription, proxy):
    """Every ModifyAckDeadline refused (PERMISSION_DENIED: the job's account lost pubsub.subscriber mid-job, say):
    the feed counts it and says so, every request still ends, nothing is admitted past the bound, and once the
    lost places' time is up the ledger is at zero: a failed extension touches no place."""
    topic, path = subscription
    expected = set(publish(topic, 3 * BOUND))
    proxy.faults = Faults(ack_error=1.0, ack_codes=(grpc.StatusCode.PERMISSION_DENIED,),
                          only=frozenset({"ModifyAckDeadline"}))
    source = a_worker(place_open_s=3.0)
    feed = a_feed(path, source, proxy)
    try:
        served = serve_rounds(feed, source, expected, timeout_s=120)
        counts = feed.counts()
    finally:
        feed.stop()
    assert set(served.ended) == expected
    assert served.uncounted == 0 and served.most <= BOUND, (served.uncounted, served.most)
    assert counts.get("modify_failed", 0) >= 1, counts
    time.sleep(source.settings.admission.place_open_s + 0.5)
    assert held(source) == 0
