"""The job's reader on Dataflow (pipeline/flow/subscription_reader.py), run by Beam's own portable runner.

Beam's ``FnApiRunner`` runs the real splittable DoFn as Dataflow's Runner v2 does, through the Fn API: it claims
rounds, takes the residual of ``defer_remainder`` and runs it again, and calls the bundle finalizer once a bundle
succeeded (the capability matrix: https://beam.apache.org/documentation/runners/capability-matrix/). It is not a
streaming runner, so each reader runs a bounded number of rounds, and it resumes a deferred residual at once
rather than after its delay. Around it: the Pub/Sub emulator, the real parse and admission steps, and a worker
runtime with the template's vLLM engine, whose admission ledger the reader asks for room. Reading asks the model
server nothing, so the engine's server is an address nobody answers, and these tests run where vLLM does not.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from google.cloud import pubsub_v1

from local.emulators import PubSubEmulator
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.request_parsing import RequestLimits
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.flow import admission, subscription_feed, subscription_reader
from pipeline.flow.admission import AdmitRequests
from pipeline.flow.subscription_reader import ReadWithinRoom
from pipeline.intake.parsing import ParseRequests
from pipeline.worker.runtime import WorkerRuntime
from pipeline.worker.runtime_settings import AdmissionSettings, RuntimeSettings
from tests import vm_sim
from tests.conftest import SERVED_NAME
from tests.feed_harness import short_deadline_subscription, through
from tests.pubsub_fault_proxy import FaultProxy, Faults

# The runtimes the runner's DoFns reach, by tag: the runner pickles its DoFns, and these are found by reference.
_RUNTIMES: dict[str, WorkerRuntime] = {}
ACK_DEADLINE_S = 10  # Pub/Sub's least


@dataclass(frozen=True)
class Registered:
    """A runtime source (pipeline.worker.runtime.RuntimeSource) for a runtime of this process, found by tag."""

    tag: str

    @property
    def settings(self) -> RuntimeSettings:
        return _RUNTIMES[self.tag].settings

    def acquire(self, *, fresh: bool = False) -> WorkerRuntime:
        return _RUNTIMES[self.tag]


@dataclass(frozen=True)
class Gone:
    """A runtime source whose host is gone: every call finds it unreachable."""

    tag: str
    settings: RuntimeSettings

    def acquire(self, *, fresh: bool = False) -> WorkerRuntime:
        raise ConnectionError("the runtime's host died")


@pytest.fixture()
def worker():
    """A worker runtime of bound 5 (2 in flight, 3 waiting) whose admissions, once their bundle ended, stay counted
    for the whole test; a bundle that never ends frees its room after Pub/Sub's least ack deadline."""
    settings = EngineSettings(server=None, server_url="http://127.0.0.1:9", served_model_name=SERVED_NAME,
                              max_in_flight=2, chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100))
    tag = f"reader-test-{time.monotonic_ns()}"
    _RUNTIMES[tag] = WorkerRuntime(vllm_engine(settings), AdmissionSettings(worker_queue=3, transit_s=600.0,
                                                                                 place_open_s=ACK_DEADLINE_S))
    yield Registered(tag)
    _RUNTIMES.pop(tag).close()


@pytest.fixture()
def backlog(emulator):
    """A subscription holding 50 requests, ten times the worker's bound."""
    name = f"reader-{time.monotonic_ns()}"
    emulator.create_topic(name, subscription=f"{name}-sub")
    publisher = pubsub_v1.PublisherClient()
    for i in range(50):
        publisher.publish(emulator.topic(name), json.dumps({"prompt": f"question {i}"}).encode(),
                          id=f"req-{i}").result()
    return emulator.subscription(f"{name}-sub")


@pytest.fixture(autouse=True)
def feeds_hold_through_a_runner_start(monkeypatch):
    """The portable runner takes seconds to start a pipeline, where Dataflow's rounds come every second: the feed
    keeps what it pulled for the first rounds instead of handing it back to Pub/Sub."""
    monkeypatch.setattr(subscription_feed, "HELD_MOST_S", 120.0)


def read(subscription: str, source, out: Path, *, readers: int = 3, rounds: int = 6, fail: bool = False,
         client=None, bulk: bool = False) -> None:
    """Reads ``rounds`` rounds of ``readers`` readers into parse and admission, as the job's first stage does,
    writing each admitted request's id to ``out`` (and its lane to ``out``.lanes); ``fail``: a step after admission
    raises, failing the bundle; ``client``: how the process's feed makes its Pub/Sub client (through the fault
    proxy); ``bulk``: the bulk lane's readers (a ``bulk_subscription``)."""

    def record(request, path=str(out), fail=fail):
        if fail:
            raise RuntimeError("the bundle fails after admission")
        with open(path, "a") as ids:
            ids.write(request.id + "\n")
        with open(path + ".lanes", "a") as lanes:
            lanes.write(request.lane_name() + "\n")

    feed = warmed_feed(subscription, source, client=client, bulk=bulk)
    try:
        with beam.Pipeline(runner=FnApiRunner()) as pipeline:
            messages = pipeline | ReadWithinRoom(subscription, source, readers=readers, rounds=rounds,
                                                 ack_deadline_s=ACK_DEADLINE_S, bulk=bulk)
            parsed = messages | ParseRequests(RequestLimits(default_max_tokens=16), "id")
            _ = parsed.requests | AdmitRequests(source) | beam.Map(record)
    finally:
        feed.stop()


def warmed_feed(subscription: str, source, settle_s: float = 1.0, client=None,
                bulk: bool = False) -> subscription_feed.SubscriptionFeed:
    """The process's feed of ``subscription``, started before the readers' rounds and given ``settle_s`` to pull
    what the worker has room for: the portable runner resumes a deferred round at once, where Dataflow resumes it
    after its delay, by which time the feed has pulled."""
    feed = subscription_feed.feed_for(subscription, source, bulk, ACK_DEADLINE_S, client)
    time.sleep(settle_s)
    return feed


def ids_in(out: Path) -> list[str]:
    return out.read_text().split() if out.exists() else []


def test_a_backlog_ten_times_the_bound_is_read_no_faster_than_the_worker_has_room(worker, backlog, tmp_path):
    """Eighteen rounds over a backlog of 50 against a bound of 5: the readers take exactly the worker's room, each
    request counts once in the hold by its own id (it took its read's place), the rest stays in the subscription,
    and what was read is acknowledged (it is not delivered again once its deadline has passed). Once the
    generate step reports the requests arrived, the next rounds take as many again."""
    out = tmp_path / "ids"
    read(backlog, worker, out)
    taken = ids_in(out)
    runtime = worker.acquire()
    assert len(taken) == 5 and len(set(taken)) == 5, taken
    assert runtime.admission.counts() == (0, 0, 5), "each request in its read's place: counted once, by id"

    runtime.report_waiting("key-1", 0, arrived=taken)  # the generate step has them: room for 5 more
    read(backlog, worker, out)
    assert len(set(ids_in(out))) == 10

    time.sleep(ACK_DEADLINE_S + 1)
    assert len(PubSubEmulator.take(backlog)) == 40, \
        "the ten read were acknowledged once their bundles committed, and only they"


def test_the_bulk_lanes_readers_stop_where_the_live_reserve_begins_and_mark_what_they_read(worker, emulator,
                                                                                              tmp_path):
    """A job with a bulk_subscription runs a second set of readers on it. Over a backlog of 50 on each lane, the
    bulk readers take places only while the worker holds fewer than bulk_held, so they read exactly that many and
    mark each the bulk lane's (whatever its publisher set); the live readers then take the room live_reserve kept,
    and no more."""
    settings_ = worker.settings
    assert 0 < settings_.bulk_held < settings_.max_held, "the premise: live_reserve keeps room"
    subscriptions = {}
    publisher = pubsub_v1.PublisherClient()
    for lane in ("bulk", "live"):
        name = f"reader-{lane}-{time.monotonic_ns()}"
        emulator.create_topic(name, subscription=f"{name}-sub")
        for i in range(50):  # a live mark on a bulk message changes nothing: the bulk read marks it its own
            publisher.publish(emulator.topic(name), json.dumps({"prompt": f"question {i}"}).encode(),
                              id=f"{lane}-{i}", llm_template_lane="live").result()
        subscriptions[lane] = emulator.subscription(f"{name}-sub")
    bulk_out, live_out = tmp_path / "bulk", tmp_path / "live"
    read(subscriptions["bulk"], worker, bulk_out, bulk=True)
    assert len(set(ids_in(bulk_out))) == settings_.bulk_held, ids_in(bulk_out)
    assert set(ids_in(Path(f"{bulk_out}.lanes"))) == {"bulk"}
    read(subscriptions["bulk"], worker, bulk_out, bulk=True)
    assert len(set(ids_in(bulk_out))) == settings_.bulk_held, "at bulk_held, the bulk readers read nothing more"
    read(subscriptions["live"], worker, live_out)
    assert len(set(ids_in(live_out))) == settings_.max_held - settings_.bulk_held, ids_in(live_out)
    assert set(ids_in(Path(f"{live_out}.lanes"))) == {"live"}
    assert sum(worker.acquire().admission.counts()) == settings_.max_held


def test_the_reader_dofn_and_the_vm_simulator_run_the_one_round(worker, backlog, tmp_path, monkeypatch):
    """The reader's round is four functions, each looked up where it is defined, which PullWithinRoomFn, AdmitFn and
    the VM simulator all call (#80): the round's take and its bundle's end, a request's admission in a place and
    the admission bundle's end. A change to any is run by both, so what the simulator proves under its schedules is
    the round that ships, not a copy."""
    calls: Counter[tuple[str, str]] = Counter()
    runner = ["dofn"]
    shared = [(subscription_reader, "take_round"), (subscription_reader, "end_read_bundle"),
              (admission, "admit_in_place"), (admission, "end_admit_bundle")]

    def seen(name, real):
        def changed(*args, **kwargs):
            calls[runner[0], name] += 1
            return real(*args, **kwargs)
        return changed

    for module, name in shared:
        monkeypatch.setattr(module, name, seen(name, getattr(module, name)))
    read(backlog, worker, tmp_path / "out", rounds=2)
    runner[0] = "simulator"
    vm_sim.check(vm_sim.run(0, vm_sim.POLICIES[0]))
    assert all(calls[who, name] for who in ("dofn", "simulator") for _, name in shared), calls


def test_a_bundle_that_fails_leaves_its_messages_in_the_subscription(worker, backlog, tmp_path):
    """A step after admission raises: the runner fails the bundle, so its finalizer never runs and what it read
    is delivered again once its ack deadline passes; the places it took and the requests admitted in them stop
    counting within place_open_s, so the worker's room is whole again."""
    with pytest.raises(Exception, match="the bundle fails after admission"):
        read(backlog, worker, tmp_path / "ids", readers=1, rounds=1, fail=True)
    assert sum(worker.acquire().admission.counts()) > 0, "the failed bundle's requests held the worker's room"
    time.sleep(ACK_DEADLINE_S + 1)
    assert worker.acquire().admission.counts() == (0, 0, 0)
    assert len(PubSubEmulator.take(backlog)) == 50


def test_a_reader_whose_runtime_cannot_be_asked_pulls_nothing(worker, backlog, tmp_path):
    """While the worker's runtime is gone (its host died, a rebuild under way), a reader takes no place, so it pulls
    nothing and defers: no work item fails, and the backlog stays whole in the subscription."""
    out = tmp_path / "messages"

    def record(message, path=str(out)):
        with open(path, "a") as messages:
            messages.write(message.message_id + "\n")

    gone = Gone(worker.tag, worker.settings)
    feed = warmed_feed(backlog, gone)
    try:
        with beam.Pipeline(runner=FnApiRunner()) as pipeline:
            _ = pipeline | ReadWithinRoom(backlog, gone, readers=3, rounds=6) | beam.Map(record)
    finally:
        feed.stop()
    assert ids_in(out) == []
    assert len(PubSubEmulator.take(backlog)) == 50


def test_a_backlog_through_a_misbehaving_pubsub_is_read_once_and_within_the_bound(worker, emulator, tmp_path):
    """The real DoFn under the portable runner, the real runtime on vLLM, and a Pub/Sub that shortens a third of
    the pulls, refuses a fifth of the calls, loses a tenth of its answers after leasing their messages and refuses
    a tenth of the acknowledgements (tests/pubsub_fault_proxy.py). Reading a backlog ten times the bound, round
    after round as the generate step reports what reached it: every request is read, the worker never holds more
    than its bound, and once everything arrived and the lost places' time is up, the ledger is at zero."""
    topic, path = short_deadline_subscription(emulator, f"reader-faults-{time.monotonic_ns()}")
    publisher = pubsub_v1.PublisherClient()
    for i in range(50):
        publisher.publish(topic, json.dumps({"prompt": f"question {i}"}).encode(), id=f"req-{i}").result()
    proxy = FaultProxy(os.environ["PUBSUB_EMULATOR_HOST"], Faults(short=0.3, error=0.2, lost=0.1, ack_error=0.1),
                       seed=11)
    runtime, seen, reads = worker.acquire(), set(), 0
    try:
        deadline = time.monotonic() + 420
        while len(seen) < 50 and time.monotonic() < deadline:
            reads += 1
            out = tmp_path / f"ids-{reads}"
            read(path, worker, out, client=through(proxy))
            assert sum(runtime.admission.counts()) <= runtime.admission.bound, runtime.admission.counts()
            seen |= set(ids_in(out))  # one delivered again is read again: the generate step's dedupe serves it once
            runtime.report_waiting("key-1", 0, arrived=ids_in(out))  # the generate step has them
    finally:
        proxy.close()
    assert seen == {f"req-{i}" for i in range(50)}, f"{50 - len(seen)} never read; faults {dict(proxy.done)}"
    assert sum(proxy.done.values()) >= 5, proxy.done
    time.sleep(ACK_DEADLINE_S + 1)
    assert runtime.admission.counts() == (0, 0, 0)
