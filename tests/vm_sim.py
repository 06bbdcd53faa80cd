"""A deterministic simulation of one worker VM's harness threads around its reads: what the reader costs, and
whether the bound holds, under each way the runner might hand out work items (issue #57; docs/architecture.md).

A worker runs ``number_of_worker_harness_threads`` work items at once, its readers' rounds and the generate
step's work items (elements arriving at a key, its poll timer) alike, and Dataflow does not document how it
chooses between them. The reader (:mod:`pipeline.flow.subscription_reader`) must keep a backlog in the
subscription without starving the work items that free room. This plays a backlog many times the worker's
bound and measures, per policy: rounds that found no room (each defers; none fails), the most the worker held
against its bound, how late poll timers ran, and the model's idle slots while requests waited in keyed state.

What runs for real: the worker's admission ledger (:class:`~pipeline.worker.admission_ledger.AdmissionLedger` on the
simulated clock), the places a read takes (:mod:`pipeline.worker.read_places`), the reader's feed
(:class:`~pipeline.flow.subscription_feed.SubscriptionFeed`, its turns run on the simulated clock instead of its
thread), the reader's round as its DoFns run it (:func:`~pipeline.flow.subscription_reader.take_round` and
:func:`~pipeline.flow.subscription_reader.end_read_bundle`, :class:`~pipeline.flow.admission.AdmitFn`'s
:func:`~pipeline.flow.admission.admit_in_place` and :func:`~pipeline.flow.admission.end_admit_bundle`, each looked
up where it is defined), and the generate step's key machine with its state codec and the engine side of the poll
contract (the world of :mod:`tests.worker_sim`, which runs :func:`~pipeline.generation.key_driver.drive`). What is
simulated: the threads and the clock, the model server (tokens at a rate, at most ``max_in_flight`` streams), the
shuffle between admission and the keys (``transit_s``), the runner's resumption of a deferred reader
(``FULL_DELAY_S`` or ``EMPTY_DELAY_S`` later), Pub/Sub (:class:`SimPubSub`: pulls of drawn sizes, redelivery after
the ack deadline, and the fault proxy's faults, ``Setup.pubsub_faults``), and the fused stage's work item around the
round: pull, admit each request in its place and with its key, end the bundle, acknowledge once it commits.

Reads: ``reader`` (the job's) and, to show what it saves, ``native`` (a read that pulls whatever the
subscription gives, as Dataflow's own source does, with each request admitted where there is room). Policies,
how a free thread picks its next work item: ``timers`` (a key's due work item first, a reader's round
only when none is due), ``fair`` (a coin between the two when both are there), ``reads`` (a reader's round
whenever one is due). ``python -m tests.vm_sim N`` prints them side by side over N drawn workers;
``python -m tests.vm_sim N --mechanisms`` prints what the admission transit saves against its absence.
"""

from __future__ import annotations

import random
import statistics
import sys
import zlib
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from pipeline.contract.call_outcome import Call
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.engines.engine_settings import EngineSettings
from pipeline.flow import admission, subscription_reader
from pipeline.flow.subscription_backlog import SubscriptionBacklog
from pipeline.flow.subscription_feed import SubscriptionFeed
from pipeline.flow.subscription_reader import ACK_DEADLINE_S, EMPTY_DELAY_S, PULL_MOST
from pipeline.generation.key_events import Arrived, PollDue, Rules
from pipeline.generation.key_events import Report as WaitingReport
from pipeline.serving.vllm_server import ServerSpec
from pipeline.worker import read_places
from pipeline.worker.admission_ledger import AdmissionLedger
from pipeline.worker.runtime_settings import AdmissionSettings, CallSettings, RuntimeSettings
from tests.pubsub_fault_proxy import Faults as PubSubFaults
from tests.worker_sim import Faults, Schedule, SimEngine, World

POLICIES = ("timers", "fair", "reads")
# "reader": the job's reader, which takes places before it pulls; "native": a read that pulls whatever the
# subscription gives, as Dataflow's own Pub/Sub source does, its requests admitted only where there is room.
DESIGNS = ("reader", "native")
STEP_S = 0.005  # the clock's step, and how long one work item holds its thread


@dataclass(frozen=True)
class Setup:
    """One drawn worker and backlog."""

    seed: int
    design: str
    policy: str
    threads: int
    readers: int  # the job's readers that run on this worker
    keys: int
    max_in_flight: int
    worker_queue: int
    requests: int
    tokens: tuple[int, ...]
    pull_sizes: tuple[int, ...]  # how many messages a pull returns at most (Pub/Sub may return fewer), cycled
    rate_tps: float
    transit_s: float  # how long the shuffle takes from a read's bundle to the keys
    # Drawn by no seed, set by a test (run's ``changes``):
    transit_spread: float = 0.0  # each bundle's transit is transit_s times 1 ± up to this
    admission_transit_s: float | None = None  # the ledger's setting; None: comfortably above transit_s
    remote_share: float = 0.0  # the share of keys that other workers host: their requests never reach this one
    # Whether a request on its way counts once its read's bundle ended (the admission transit); False plays the
    # ledger without it, to measure what it saves (mechanisms()).
    transit_counted: bool = True
    # Whether the admission step tells the ledger each request's key (AdmitFn does); False plays a ledger that
    # cannot learn which keys other workers host.
    keys_told: bool = True
    # What the simulated Pub/Sub does wrong, drawn as the fault proxy draws it (tests/pubsub_fault_proxy.py).
    pubsub_faults: PubSubFaults = field(default_factory=PubSubFaults)
    # The share of the reader's bundles that fail after admission (nothing acknowledged, nothing dispatched).
    failed_bundles: float = 0.0

    @classmethod
    def draw(cls, seed: int, policy: str, design: str = "reader") -> Setup:
        rng = random.Random(seed)
        requests = rng.randint(40, 160)
        return cls(seed, design, policy, threads=rng.choice([4, 8, 12]), readers=rng.choice([1, 2, 4, 16]),
                   keys=rng.randint(2, 8), max_in_flight=rng.choice([2, 4, 8]), worker_queue=rng.choice([1, 4, 8]),
                   requests=requests, tokens=tuple(rng.randint(4, 48) for _ in range(requests)),
                   pull_sizes=tuple(rng.randint(1, PULL_MOST) for _ in range(5)),
                   rate_tps=rng.choice([50.0, 200.0]), transit_s=rng.choice([0.05, 0.3]))


@dataclass
class Outcome:
    setup: Setup
    ended: dict[str, int]
    makespan_s: float = 0.0
    rounds: int = 0  # readers' rounds run
    deferred: int = 0  # the feed's asks that found the worker full (or no runtime) and pulled nothing
    uncounted: int = 0  # requests admitted without a place that still counted (their runtime was rebuilt)
    peak_hold: int = 0  # requests taken from the backlog and not yet ended, at the worst moment
    over_bound: tuple[float, int] | None = None  # (when, hold) the hold first passed bound + slack, compared each step
    bound: int = 0
    read_thread_s: float = 0.0  # thread time readers' rounds held
    idle_slot_s: float = 0.0  # model slots free while requests waited in keyed state
    starved_slot_s: float = 0.0  # model slots free while nothing waited in keyed state but the backlog did
    timer_late_s: list[float] = field(default_factory=list)
    host_deaths: int = 0
    failed_bundles: int = 0  # the reader's bundles that failed after admission
    remote_ended: int = 0  # requests generated by the workers that host the remote keys
    arrival_late_s: list[float] = field(default_factory=list)  # from reaching a key's queue to its work item

    @property
    def slack(self) -> int:
        """What the contract allows over the bound: the finished streams whose completions are not yet collected
        (they leave the engine's count before their key's)."""
        return self.setup.max_in_flight


@dataclass(frozen=True)
class _Message:
    data: bytes


@dataclass(frozen=True)
class _Received:
    ack_id: str
    message: _Message


@dataclass(frozen=True)
class _PullResponse:
    received_messages: list[_Received]


class SimPubSub:
    """The subscription, as the feed's client sees it, on the simulated clock: a unary pull answers with at most
    ``max_messages`` (at most a pull size of the setup, fewer or an error as ``faults`` draw), what is pulled is
    delivered again once its ack deadline passes unacknowledged, and an ack deadline of 0 gives it back at once."""

    def __init__(self, vm: _Vm, faults: PubSubFaults) -> None:
        self._vm = vm
        self._faults = faults
        self.outstanding: dict[str, tuple[InferenceRequest, float]] = {}  # ack id -> (request, deadline)
        self._ack_ids = 0

    def _expire(self) -> None:
        now = self._vm.world.now
        for ack_id, (request, deadline) in list(self.outstanding.items()):
            if deadline <= now:  # back in the subscription: no longer the worker's
                del self.outstanding[ack_id]
                self._vm.backlog.appendleft(request)
                self._vm.taken.discard(request.id)
                self._vm.requests_by_ack.pop(ack_id, None)

    def _fault(self) -> None:
        from google.api_core import exceptions

        if self._vm.rng.random() < self._faults.error:
            raise exceptions.from_grpc_status(self._vm.rng.choice(self._faults.codes), "simulated")

    def pull(self, subscription: str, max_messages: int, timeout: float, retry: Any) -> _PullResponse:
        self._expire()
        self._fault()
        vm = self._vm
        size = vm.s.pull_sizes[vm._pulls % len(vm.s.pull_sizes)]
        vm._pulls += 1
        if vm.rng.random() < self._faults.short:
            size = int(size * vm.rng.random())
        received = []
        for _ in range(min(max_messages, size, len(vm.backlog))):
            request = vm.backlog.popleft()
            self._ack_ids += 1
            ack_id = f"a{self._ack_ids}"
            self.outstanding[ack_id] = (request, vm.world.now + 10.0)  # the subscription's own deadline
            vm.taken.add(request.id)
            vm.requests_by_ack[ack_id] = request
            received.append(_Received(ack_id, _Message(request.id.encode())))
        late = self._faults.slow if self._faults.slow_s >= timeout else 0.0
        if received and vm.rng.random() < self._faults.lost + late:  # carried out, its answer lost or too late:
            from google.api_core import exceptions  # leased to no one until their deadline

            for each in received:
                vm.taken.discard(vm.requests_by_ack.pop(each.ack_id).id)
            raise exceptions.from_grpc_status(self._vm.rng.choice(
                (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)), "simulated: the answer was lost")
        return _PullResponse(received)

    def modify_ack_deadline(self, subscription: str, ack_ids: list[str], ack_deadline_seconds: int,
                            timeout: float, retry: Any = None) -> None:
        if self._vm.rng.random() < self._faults.ack_error:
            self._fault_raise()
        for ack_id in ack_ids:
            if ack_id in self.outstanding:
                request, _ = self.outstanding[ack_id]
                self.outstanding[ack_id] = (request, self._vm.world.now + ack_deadline_seconds)
        self._expire()

    def acknowledge(self, subscription: str, ack_ids: list[str], timeout: float, retry: Any = None) -> None:
        if self._vm.rng.random() < self._faults.ack_error:
            self._fault_raise()
        for ack_id in ack_ids:
            self.outstanding.pop(ack_id, None)

    def get_subscription(self, subscription: str, timeout: float, retry: Any = None) -> None:
        return None

    def _fault_raise(self) -> None:
        from google.api_core import exceptions

        raise exceptions.ServiceUnavailable("simulated")


class _Vm:
    def __init__(self, setup: Setup, host_dies_at: float | None = None, rebuild_s: float = 0.0) -> None:
        self.s = setup
        self.host_dies_at, self.rebuild_s = host_dies_at, rebuild_s
        self.down_until: float | None = None  # while the runtime is acquired anew
        self.rng = random.Random(setup.seed * 104729 + 7)
        bound = setup.max_in_flight + setup.worker_queue
        schedule = Schedule(setup.seed, setup.keys, 1, setup.max_in_flight, 0, (), (), setup.rate_tps, 4,
                            Faults(), Rules(poll_interval_s=0.05, dedupe_window_s=600.0, drain_timeout_s=30.0,
                                            waiting_cap=2 * bound))
        self.world = World(schedule)
        self.world.faulty = False
        self.world.on_report = self._report
        self.engine: SimEngine = self.world.engines["w0"]
        self.settings = RuntimeSettings(
            EngineSettings(server=ServerSpec(model="simulated"), max_in_flight=setup.max_in_flight,
                           chunk_policy=ChunkPolicy()),
            AdmissionSettings(worker_queue=setup.worker_queue, **_transit(setup)),
            CallSettings(harness_threads=setup.threads))
        self.ledger = AdmissionLedger(self.settings, self.engine.unfinished, clock=lambda: self.world.now)
        self.tag = f"vm-sim-{setup.seed}-{setup.policy}-{id(self)}"
        self.backlog: deque[InferenceRequest] = deque(
            InferenceRequest(id=f"r{i}", prompt=f"p{i}", max_tokens=setup.tokens[i], prompt_tokens=1, received_at=0.0)
            for i in range(setup.requests))
        for request in self.backlog:  # what a shed request's publisher republishes
            self.world.published[request.id] = (0.0, self._key_of(request), (request,))
        self.readers_due = [0.0] * setup.readers  # when each reader's deferred residual runs again
        self.transit: list[tuple[float, int, tuple[InferenceRequest, ...]]] = []  # (arrives at, key, requests)
        self.arrivals: deque[tuple[float, int, tuple[InferenceRequest, ...]]] = deque()  # due at their keys
        self.threads: list[tuple[str, int, float] | None] = [None] * setup.threads  # (kind, key or reader, until)
        self.taken: set[str] = set()
        self.out = Outcome(setup, ended={}, bound=bound)
        self._pulls = 0
        self.requests_by_ack: dict[str, InferenceRequest] = {}
        self.pubsub = SimPubSub(self, setup.pubsub_faults)
        # The job's feed of the subscription (pipeline/flow/subscription_feed.py), run on the simulated clock by
        # its own thread's turns (feed_due), its runtime calls answered by the ledger, or unreachable while the
        # host is down.
        self.feed = SubscriptionFeed("projects/sim/subscriptions/s", None, False, ACK_DEADLINE_S, lambda: self.pubsub,
                                     clock=lambda: self.world.now, runtime_call=self._runtime_call,
                                     backlog=SubscriptionBacklog("", clock=lambda: self.world.now), start=False)
        self.feed_due = 0.0

    def _key_of(self, request: InferenceRequest) -> int:
        return zlib.crc32(request.id.encode()) % self.s.keys

    def _remote(self, key: int) -> bool:
        """Whether another worker hosts this key (the lowest ``remote_share`` of them)."""
        return key < round(self.s.remote_share * self.s.keys)

    # The generate step's side -----------------------------------------------------------------------------

    def _report(self, key: int, report: WaitingReport) -> None:
        if self.down_until is None:  # advisory: a report the dead host missed lapses, the next one counts
            self.ledger.report_waiting(repr(key), report.waiting, report.arrived)

    def _busy(self, kind: str) -> set[int]:
        return {slot[1] for slot in self.threads if slot is not None and slot[0] == kind}

    def _due_key_item(self) -> tuple[int, object] | None:
        busy = self._busy("key")
        for n, (at, key, requests) in enumerate(self.arrivals):
            if key not in busy:
                del self.arrivals[n]
                self.out.arrival_late_s.append(self.world.now - at)
                return key, Arrived(self.world.now, requests, f"b{self.rng.randrange(10**9)}")
        due = sorted((record.poll_at, key) for key, record in self.world.keys.items()
                     if record.poll_at is not None and record.poll_at <= self.world.now and key not in busy)
        if due:
            at, key = due[0]
            self.out.timer_late_s.append(self.world.now - at)
            return key, PollDue(self.world.now)
        return None

    def _run_key_item(self, thread: int, key: int, event: object) -> None:
        assert self.world.work_item(key, event)  # type: ignore[arg-type]  # no faults: every item commits
        while self.world.bundles:  # a shed request goes back to the subscription, as its dead letter asks
            _, _, requests = self.world.bundles.pop()
            self.backlog.extend(requests)
            self.taken.difference_update(r.id for r in requests)
        self.threads[thread] = ("key", key, self.world.now + STEP_S)

    # The reader's side: one round of PullWithinRoomFn, fused with parsing and AdmitFn -------------------------

    def _due_reader(self) -> int | None:
        busy = self._busy("read")
        due = [n for n, at in enumerate(self.readers_due) if at <= self.world.now and n not in busy]
        return due[0] if due else None

    def _runtime_call(self, what: str, call: Any) -> tuple[Call, Any]:
        if self.down_until is not None:
            return Call.UNREACHABLE, None
        return Call.ANSWERED, call(self.ledger)

    def _run_round(self, thread: int, reader: int) -> None:
        now = self.world.now
        self.out.rounds += 1
        self.out.read_thread_s += STEP_S
        self.threads[thread] = ("read", reader, now + STEP_S)
        if self.s.design == "native":  # no places: the pull takes what the subscription gives
            self._native_round(reader)
            return
        taken = subscription_reader.take_round(self.feed, self.tag)  # the round PullWithinRoomFn runs, looked up
        if not taken.messages:
            self.readers_due[reader] = now + taken.again_s
            return
        pulled = [self.requests_by_ack.pop(ack_id) for ack_id in taken.ack_ids]
        places = taken.places
        if self.rng.random() < self.s.failed_bundles:  # admitted, then the fused stage fails: the runner retries
            # nothing here; the messages come back after their deadline, the places and ids lapse (place_open_s)
            for request in pulled:  # its finish_bundle never runs: nothing is discarded or dispatched
                self._admit_one(request)
            self.taken.difference_update(request.id for request in pulled)  # leased to a bundle that is gone
            self.out.failed_bundles += 1
            self.readers_due[reader] = now
            return
        self._admit(pulled, places)
        self.feed.acknowledge(taken.ack_ids)  # the bundle committed: its finalizer acknowledges
        self.readers_due[reader] = now

    def _native_round(self, reader: int) -> None:
        """A read that pulls whatever the subscription gives, as Dataflow's own source does: no feed, no places."""
        now = self.world.now
        places = [f"unasked-{self._pulls}-{n}" for n in range(PULL_MOST)]
        size = self.s.pull_sizes[self._pulls % len(self.s.pull_sizes)]
        self._pulls += 1
        pulled = [self.backlog.popleft() for _ in range(min(len(places), size, len(self.backlog)))]
        self.taken.update(request.id for request in pulled)
        read_places.settle(self.ledger, self.tag, places, len(pulled))
        self._admit(pulled, places)
        self.readers_due[reader] = now if pulled else now + EMPTY_DELAY_S

    def _admit(self, pulled: list[InferenceRequest], places: list[str]) -> None:
        """AdmitFn, in the round's bundle: each request in place of a place, then the bundle ends."""
        now = self.world.now
        admitted = []
        for request in pulled:
            if self._admit_one(request):
                admitted.append(request.id)
            else:
                self.out.uncounted += 1
        if self.s.design == "reader":
            subscription_reader.end_read_bundle(self.feed, self.tag, places)  # PullWithinRoomFn.finish_bundle's
        else:  # the native read's places are the simulator's own: they go on their way with the bundle
            read_places.discard(self.tag, places)
            if self.down_until is None:
                self.ledger.dispatched(places[:len(pulled)])
        admission.end_admit_bundle(admitted, lambda dispatch: self._runtime_call("dispatch", dispatch))  # AdmitFn's
        by_key: dict[int, list[InferenceRequest]] = {}
        for request in pulled:
            by_key.setdefault(self._key_of(request), []).append(request)
        for key, requests in by_key.items():
            spread = self.rng.uniform(-self.s.transit_spread, self.s.transit_spread) if self.s.transit_spread else 0.0
            self.transit.append((now + self.s.transit_s * (1 + spread), key, tuple(requests)))

    def _admit_one(self, request: InferenceRequest) -> bool:
        """AdmitFn's own step, looked up where it is defined. Its places' age is on the wall clock, which passes
        next to nothing within a round here: the simulated time a bundle takes leaves them fresh, as a bundle
        that commits leaves them on Dataflow."""
        return admission.admit_in_place(self.tag, request, repr(self._key_of(request)) if self.s.keys_told else None,
                                        self.settings.admission.place_open_s,
                                        lambda admit: self._runtime_call("admit", admit))

    # The runner ---------------------------------------------------------------------------------------------

    def _assign(self, thread: int) -> None:
        """A free thread takes its next work item, as the policy says."""
        reader = self._due_reader()
        key_first = {"timers": True, "reads": reader is None, "fair": self.rng.random() < 0.5}[self.s.policy]
        for kind in ("key", "read") if key_first else ("read", "key"):
            if kind == "key":
                item = self._due_key_item()
                if item is not None:
                    self._run_key_item(thread, *item)
                    return
            elif reader is not None:
                self._run_round(thread, reader)
                return

    def _hold(self) -> int:
        return len(self.taken - {i for i, n in self.out.ended.items() if n})

    def _host(self, now: float) -> None:
        """The runtime's host dies at ``host_dies_at`` (its streams and its ledger with it); for ``rebuild_s`` every
        call to the runtime finds it unreachable; then a new engine and a new, empty ledger answer."""
        if self.host_dies_at is not None and now >= self.host_dies_at:
            self.host_dies_at, self.down_until = None, now + self.rebuild_s
            self.out.host_deaths += 1
            self.world.host_died("w0")  # what it generated counted, each stream on it hit (the contract's cost)
            self.world.s = replace(self.world.s, faults=Faults(unreachable=1.0))
            self.world.faulty = True
        elif self.down_until is not None and now >= self.down_until:
            self.down_until = None
            self.world.s = replace(self.world.s, faults=Faults())
            self.world.faulty = False
            self.engine = self.world.engines["w0"] = SimEngine("w0-rebuilt", self.world.s)
            self.ledger = AdmissionLedger(self.settings, self.engine.unfinished, clock=lambda: self.world.now)

    def step(self) -> None:
        now = self.world.now
        self._host(now)
        if self.s.design == "reader" and now >= self.feed_due:  # the feed's thread: never a harness thread
            self.feed_due = now + max(self.feed.step(), STEP_S)
            self.out.deferred += self.feed.counts().get("read_deferred", 0)
        for item in [t for t in self.transit if t[0] <= now]:
            self.transit.remove(item)
            if self._remote(item[1]):  # another worker generates them; this one never hears of them again
                self.world.report.ended.update(request.id for request in item[2])
                self.out.remote_ended += len(item[2])
            else:
                self.arrivals.append(item)
        for thread, slot in enumerate(self.threads):
            if slot is not None and slot[2] <= now:
                self.threads[thread] = None
        for thread, slot in enumerate(self.threads):
            if slot is None:
                self._assign(thread)
        waiting = sum(len(record.cells["waiting"]) for record in self.world.keys.values())
        free = max(0, self.s.max_in_flight - self.engine.unfinished())
        self.out.idle_slot_s += STEP_S * min(free, waiting)
        if not waiting and self.backlog:
            self.out.starved_slot_s += STEP_S * free
        self.out.ended = dict(self.world.report.ended)
        hold = self._hold()
        self.out.peak_hold = max(self.out.peak_hold, hold)
        if self.out.over_bound is None and hold > self.out.bound + self.out.slack:
            self.out.over_bound = (now, hold)
        self.world.tick(now + STEP_S)

    def done(self) -> bool:
        return len(self.world.report.ended) == self.s.requests and not self.backlog and not self.pubsub.outstanding


def _transit(setup: Setup) -> dict[str, float]:
    """The ledger's transit settings for ``setup``; without the transit, an id stops counting as its bundle ends."""
    if not setup.transit_counted:
        return {"transit_s": 1e-9, "transit_cap_s": 1e-9}
    return {"transit_s": max(2.0, 4 * setup.transit_s) if setup.admission_transit_s is None
            else setup.admission_transit_s}


def run(seed: int, policy: str, design: str = "reader", *, host_dies_at: float | None = None,
        rebuild_s: float = 30.0, limit_s: float = 600.0, **changes: Any) -> Outcome:
    """Plays one drawn worker and backlog under one policy and read design until every request has ended (or
    ``limit_s`` of simulated time has passed: a standstill); ``host_dies_at``: the runtime's host dies then and is
    rebuilt in ``rebuild_s``; ``changes`` replace fields of the drawn :class:`Setup`. Deterministic in its
    arguments."""
    vm = _Vm(replace(Setup.draw(seed, policy, design), **changes), host_dies_at, rebuild_s)
    while not vm.done() and vm.world.now < limit_s:
        vm.step()
    vm.out.makespan_s = vm.world.now
    return vm.out


class Violation(AssertionError):
    def __init__(self, outcome: Outcome, what: str) -> None:
        s = outcome.setup
        drawn = Setup.draw(s.seed, s.policy, s.design)
        changes = "".join(f", {name}={getattr(s, name)!r}" for name in s.__dataclass_fields__
                          if getattr(s, name) != getattr(drawn, name))
        super().__init__(f"seed {s.seed}, {s.design}, {s.policy}: {what} "
                         f"(replay: tests.vm_sim.run({s.seed}, {s.policy!r}, {s.design!r}{changes}))")


def check(outcome: Outcome, *, bound: bool = True) -> None:
    """Raises :class:`Violation` unless every request ended exactly once and (``bound``) the hold kept its bound
    plus the stated slack at every step (the first step past it is named)."""
    s = outcome.setup
    wrong = {f"r{i}": outcome.ended.get(f"r{i}", 0) for i in range(s.requests) if outcome.ended.get(f"r{i}") != 1}
    if wrong:
        raise Violation(outcome, f"requests not ended exactly once: {dict(sorted(wrong.items())[:5])}")
    if bound and outcome.over_bound is not None:
        at, held = outcome.over_bound
        raise Violation(outcome, f"held {held} at {at:.2f} s (at most {outcome.peak_hold}) against a bound of "
                                 f"{outcome.bound} + {outcome.slack}")


def compare(seeds: range) -> str:
    """The policies side by side over ``seeds``: means and maxima."""
    lines = ["| read | policy | runs with a request unended / over bound + slack | rounds that deferred (mean share) | "
             "peak hold over bound (max) | read thread-s per request (mean) | poll timer late, p99 s (mean, max) | "
             "idle model slot-s while requests wait in state (mean, max) | idle model slot-s while only the backlog "
             "waits (mean, max) | makespan s (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for design, policy in [(design, policy) for design in DESIGNS for policy in POLICIES]:
        outcomes = [run(seed, policy, design) for seed in seeds]
        late = [sorted(o.timer_late_s)[int(0.99 * (len(o.timer_late_s) - 1))] if o.timer_late_s else 0.0
                for o in outcomes]
        idle = [o.idle_slot_s for o in outcomes]
        starved = [o.starved_slot_s for o in outcomes]
        unended = sum(any(o.ended.get(f"r{i}") != 1 for i in range(o.setup.requests)) for o in outcomes)
        over = sum(o.peak_hold > o.bound + o.slack for o in outcomes)
        lines.append(f"| {design} | {policy} | {unended} / {over} of {len(outcomes)} | "
                     f"{statistics.fmean(o.deferred / max(o.rounds, 1) for o in outcomes):.2f} | "
                     f"{max(o.peak_hold - o.bound for o in outcomes)} | "
                     f"{statistics.fmean(o.read_thread_s / o.setup.requests for o in outcomes):.3f} | "
                     f"{statistics.fmean(late):.2f}, {max(late):.2f} | "
                     f"{statistics.fmean(idle):.1f}, {max(idle):.1f} | "
                     f"{statistics.fmean(starved):.1f}, {max(starved):.1f} | "
                     f"{statistics.fmean(o.makespan_s for o in outcomes):.1f} |")
    return "\n".join(lines)


# The shuffles the transit is measured under: as drawn (0.05 or 0.3 s), and a loaded runner's, slower than the
# ledger's transit setting (what the bench of #59 saw on a busy DirectRunner).
SHUFFLES: dict[str, dict[str, Any]] = {
    "as drawn": {},
    "3 s ± 30 %, transit set to 1 s": {"transit_s": 3.0, "transit_spread": 0.3, "admission_transit_s": 1.0},
}


def mechanisms(seeds: range) -> str:
    """The admission transit against its absence, over ``seeds`` under the ``timers`` policy, per shuffle."""
    lines = ["| shuffle | transit counted | runs over bound + slack | peak hold over bound (mean, max) | "
             "idle model slot-s while requests wait in state (mean) | idle model slot-s while only the backlog "
             "waits (mean) | makespan s (mean) |",
             "|---|---|---|---|---|---|---|"]
    for name, shuffle in SHUFFLES.items():
        for counted in (True, False):
            outcomes = [run(seed, "timers", transit_counted=counted, **shuffle) for seed in seeds]
            over = [o.peak_hold - o.bound for o in outcomes]
            lines.append(f"| {name} | {'yes' if counted else 'no'} | "
                         f"{sum(o.peak_hold > o.bound + o.slack for o in outcomes)} of {len(outcomes)} | "
                         f"{statistics.fmean(over):.1f}, {max(over)} | "
                         f"{statistics.fmean(o.idle_slot_s for o in outcomes):.1f} | "
                         f"{statistics.fmean(o.starved_slot_s for o in outcomes):.1f} | "
                         f"{statistics.fmean(o.makespan_s for o in outcomes):.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    print(mechanisms(range(count)) if "--mechanisms" in sys.argv else compare(range(count)))
