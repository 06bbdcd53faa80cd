"""A deterministic simulation of one worker VM's harness threads around admission: what each backpressure
design costs under each way the runner might hand out work items (issue #57; docs/architecture.md).

A worker runs ``number_of_worker_harness_threads`` work items at once, read bundles and the generate step's
work items (elements arriving at a key, its poll timer) alike, and Dataflow does not document how it chooses
between them. Admission must keep a backlog in the subscription without starving the work items that free
room. This plays a backlog many times the worker's bound and measures, per design and per policy: read bundles
refused (each a failed work item, an error in the job's log), the most the worker held against its bound,
how late poll timers ran, and the model's idle slots while requests waited in keyed state.

What runs for real: the worker's admission ledger (:class:`~pipeline.worker.admission_ledger.AdmissionLedger`
on the simulated clock, with the lead-bundle rule of :mod:`pipeline.worker.hold`) and the generate step's key
machine with its state codec and the engine side of the poll contract (the world of :mod:`tests.worker_sim`,
which runs :func:`~pipeline.generation.key_machine.converse`). What is simulated: the threads and the clock,
the model server (tokens at a rate, at most ``max_in_flight`` streams), the shuffle between admission and the
keys (``transit_s``), the runner's delay before a failed read is retried, and the admission step's loop, which
follows :class:`~pipeline.flow.admission.AdmitFn`: admit, else take a waiting place and wait with a doubling
backoff, else pause ``REFUSAL_PAUSE_S``, try once more and refuse.

Designs: ``refuse`` (today: at most ``admission_waiters`` bundles wait, a further one is refused) and ``wait``
(every read bundle waits for room; none is refused). Policies, how a free thread picks its next work item:
``timers`` (a key's due work item first, a read bundle only when none is due: what ``local/vm_stand_in.py``
assumes), ``fair`` (a coin between the two when both are there), ``reads`` (a read bundle whenever the backlog
has one). ``python -m tests.vm_sim`` prints the comparison over many seeds.
"""

from __future__ import annotations

import random
import statistics
import sys
import zlib
from collections import deque
from dataclasses import dataclass, field, replace

from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.engines.engine_settings import EngineSettings
from pipeline.flow.admission import REFUSAL_PAUSE_S
from pipeline.generation.key_events import Arrived, PollDue, Rules
from pipeline.generation.key_events import Report as WaitingReport
from pipeline.serving.vllm_server import ServerSpec
from pipeline.worker.admission_ledger import AdmissionLedger
from tests.worker_sim import Faults, Schedule, SimEngine, World

DESIGNS = ("refuse", "wait")
POLICIES = ("timers", "fair", "reads")
STEP_S = 0.005  # the clock's step, and how long one key's work item holds its thread
MAX_BACKOFF_S = 0.5  # AdmitFn's longest wait between tries


@dataclass(frozen=True)
class Setup:
    """One drawn worker and backlog."""

    seed: int
    design: str
    policy: str
    threads: int
    keys: int
    max_in_flight: int
    worker_queue: int
    requests: int
    tokens: tuple[int, ...]
    bundle_sizes: tuple[int, ...]  # read bundle sizes, cycled
    rate_tps: float
    transit_s: float
    retry_s: float  # the runner's delay before a failed read work item runs again

    @classmethod
    def draw(cls, seed: int, design: str, policy: str) -> Setup:
        rng = random.Random(seed)
        requests = rng.randint(40, 160)
        return cls(seed, design, policy, threads=rng.choice([4, 8, 12]), keys=rng.randint(2, 8),
                   max_in_flight=rng.choice([2, 4, 8]), worker_queue=rng.choice([1, 4, 8]), requests=requests,
                   tokens=tuple(rng.randint(4, 48) for _ in range(requests)),
                   bundle_sizes=tuple(rng.randint(1, 40) for _ in range(5)), rate_tps=rng.choice([50.0, 200.0]),
                   transit_s=rng.choice([0.05, 0.3]), retry_s=rng.choice([1.0, 10.0]))


@dataclass
class Outcome:
    setup: Setup
    ended: dict[str, int]
    makespan_s: float = 0.0
    refused: int = 0
    peak_hold: int = 0  # requests taken from the backlog and not yet ended, at the worst moment
    bound: int = 0
    wait_thread_s: float = 0.0  # thread time read bundles spent waiting for room
    idle_slot_s: float = 0.0  # model slots free while requests waited in keyed state
    timer_late_s: list[float] = field(default_factory=list)
    host_deaths: int = 0
    arrival_late_s: list[float] = field(default_factory=list)  # from reaching a key's queue to its work item

    @property
    def slack(self) -> int:
        """What the contract allows over the bound: less than one read bundle (the lead's), and the finished
        streams whose completions are not yet collected (they leave the engine's count before their key's)."""
        return max(self.setup.bundle_sizes) - 1 + self.setup.max_in_flight


@dataclass
class _Read:
    """A read bundle on a thread, as AdmitFn runs it."""

    name: str
    messages: list[InferenceRequest]
    admitted: list[str] = field(default_factory=list)
    next_try: float = 0.0
    backoff: float = 0.01
    place: bool = False
    refuse_at: float | None = None  # after the refusal pause: one more try, then refused
    lost: bool = False  # the runtime's host died while it was open: its admissions are in the lost ledger


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
        self.settings = EngineSettings(
            server=ServerSpec(model="simulated"), max_in_flight=setup.max_in_flight, worker_queue=setup.worker_queue,
            admission_transit_s=max(2.0, 4 * setup.transit_s), admission_waiters=max(setup.threads // 2, 1),
            chunk_policy=ChunkPolicy())
        self.ledger = AdmissionLedger(self.settings, self.engine.unfinished, clock=lambda: self.world.now)
        self.backlog: deque[InferenceRequest] = deque(
            InferenceRequest(id=f"r{i}", prompt=f"p{i}", max_tokens=setup.tokens[i], prompt_tokens=1, received_at=0.0)
            for i in range(setup.requests))
        for request in self.backlog:  # what a shed request's publisher republishes
            self.world.published[request.id] = (0.0, self._key_of(request), (request,))
        self.retrying: list[tuple[float, list[InferenceRequest]]] = []  # refused reads, until the runner retries
        self.transit: list[tuple[float, int, tuple[InferenceRequest, ...]]] = []  # (arrives at, key, requests)
        self.arrivals: deque[tuple[float, int, tuple[InferenceRequest, ...]]] = deque()  # due at their keys
        self.threads: list[object | None] = [None] * setup.threads  # a _Read, ("key", key, until), or None
        self.taken: set[str] = set()
        self.out = Outcome(setup, ended={}, bound=bound)
        self._sizes = 0

    def _key_of(self, request: InferenceRequest) -> int:
        return zlib.crc32(request.id.encode()) % self.s.keys

    # The generate step's side -----------------------------------------------------------------------------

    def _report(self, key: int, report: WaitingReport) -> None:
        if self.down_until is None:  # advisory: a report the dead host missed lapses, the next one counts
            self.ledger.report_waiting(repr(key), report.waiting, report.arrived)

    def _key_busy(self) -> set[int]:
        return {slot[1] for slot in self.threads if isinstance(slot, tuple)}

    def _due_key_item(self) -> tuple[int, object] | None:
        busy = self._key_busy()
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

    # The admission step's side ----------------------------------------------------------------------------

    def _new_read(self) -> _Read | None:
        if not self.backlog:
            return None
        size = self.s.bundle_sizes[self._sizes % len(self.s.bundle_sizes)]
        self._sizes += 1
        messages = [self.backlog.popleft() for _ in range(min(size, len(self.backlog)))]
        return _Read(f"bundle-{self._sizes}", messages, next_try=self.world.now)

    def _step_read(self, thread: int, read: _Read) -> None:
        """Runs the read bundle until it must wait, is refused, or finishes."""
        now = self.world.now
        if now < read.next_try or self.down_until is not None:  # waiting for room, or for the new runtime
            read.lost = read.lost or self.down_until is not None
            self.out.wait_thread_s += STEP_S
            return
        if read.lost and read.admitted:  # AdmitFn._call: counted again in the new ledger, whatever the room
            self.ledger.admit(read.admitted, in_place_of=read.admitted, bundle=read.name)
        read.lost = False
        while len(read.admitted) < len(read.messages):
            request = read.messages[len(read.admitted)]
            if self.ledger.admit([request.id], bundle=read.name):
                read.admitted.append(request.id)
                self.taken.add(request.id)
                read.backoff, read.refuse_at = 0.01, None
                continue
            if read.refuse_at is not None:  # the one try after the pause failed
                self._refuse(thread, read)
                return
            if self.s.design == "wait" or self.ledger.wait_place(read.name):
                read.place = read.place or self.s.design == "refuse"
                read.next_try = now + read.backoff
                read.backoff = min(2 * read.backoff, MAX_BACKOFF_S)
            else:
                read.refuse_at = read.next_try = now + REFUSAL_PAUSE_S
            self.out.wait_thread_s += STEP_S
            return
        self.ledger.dispatched(read.admitted)
        if read.place:
            self.ledger.leave_place(read.name)
        by_key: dict[int, list[InferenceRequest]] = {}
        for request in read.messages:
            by_key.setdefault(self._key_of(request), []).append(request)
        for key, requests in by_key.items():
            self.transit.append((now + self.s.transit_s, key, tuple(requests)))
        self.threads[thread] = None

    def _refuse(self, thread: int, read: _Read) -> None:
        self.out.refused += 1
        self.ledger.withdraw(read.admitted)
        self.taken.difference_update(read.admitted)
        if read.place:
            self.ledger.leave_place(read.name)
        self.retrying.append((self.world.now + self.s.retry_s, read.messages))
        self.threads[thread] = None

    # The runner ---------------------------------------------------------------------------------------------

    def _assign(self, thread: int) -> None:
        """A free thread takes its next work item, as the policy says."""
        key_first = {"timers": True, "reads": not self.backlog, "fair": self.rng.random() < 0.5}[self.s.policy]
        for kind in ("key", "read") if key_first else ("read", "key"):
            if kind == "key":
                item = self._due_key_item()
                if item is not None:
                    self._run_key_item(thread, *item)
                    return
            else:
                read = self._new_read()
                if read is not None:
                    self.threads[thread] = read
                    self._step_read(thread, read)
                    return

    def _hold(self) -> int:
        return len(self.taken - {i for i, n in self.out.ended.items() if n})

    def _host(self, now: float) -> None:
        """The runtime's host dies at ``host_dies_at`` (its streams and its ledger with it); for ``rebuild_s`` every
        call to the runtime finds it unreachable; then a new engine and a new, empty ledger answer."""
        if self.host_dies_at is not None and now >= self.host_dies_at:
            self.host_dies_at, self.down_until = None, now + self.rebuild_s
            self.out.host_deaths += 1
            self.world.report.generated += self.engine.generated
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
        for at, messages in [r for r in self.retrying if r[0] <= now]:
            self.retrying.remove((at, messages))
            self.backlog.extendleft(reversed(messages))
        for item in [t for t in self.transit if t[0] <= now]:
            self.transit.remove(item)
            self.arrivals.append(item)
        for thread, slot in enumerate(self.threads):
            if isinstance(slot, tuple) and slot[2] <= now:
                self.threads[thread] = None
            elif isinstance(slot, _Read):
                self._step_read(thread, slot)
        for thread, slot in enumerate(self.threads):
            if slot is None:
                self._assign(thread)
        waiting = sum(len(record.cells["waiting"]) for record in self.world.keys.values())
        self.out.idle_slot_s += STEP_S * max(0, min(self.s.max_in_flight - self.engine.unfinished(), waiting))
        self.out.ended = dict(self.world.report.ended)
        self.out.peak_hold = max(self.out.peak_hold, self._hold())
        self.world.tick(now + STEP_S)

    def done(self) -> bool:
        return len(self.world.report.ended) == self.s.requests and not self.backlog and not self.retrying


def run(seed: int, design: str, policy: str, *, host_dies_at: float | None = None, rebuild_s: float = 30.0,
        limit_s: float = 600.0) -> Outcome:
    """Plays one drawn worker and backlog under one design and policy until every request has ended (or
    ``limit_s`` of simulated time has passed: a standstill); ``host_dies_at``: the runtime's host dies then and
    is rebuilt in ``rebuild_s``. Deterministic in its arguments."""
    vm = _Vm(Setup.draw(seed, design, policy), host_dies_at, rebuild_s)
    while not vm.done() and vm.world.now < limit_s:
        vm.step()
    vm.out.makespan_s = vm.world.now
    return vm.out


class Violation(AssertionError):
    def __init__(self, outcome: Outcome, what: str) -> None:
        s = outcome.setup
        super().__init__(f"seed {s.seed}, {s.design}, {s.policy}: {what} "
                         f"(replay: tests.vm_sim.run({s.seed}, {s.design!r}, {s.policy!r}))")


def check(outcome: Outcome, *, bound: bool = True) -> None:
    """Raises :class:`Violation` unless every request ended exactly once and (``bound``) the hold kept its bound
    plus the stated slack."""
    s = outcome.setup
    wrong = {f"r{i}": outcome.ended.get(f"r{i}", 0) for i in range(s.requests) if outcome.ended.get(f"r{i}") != 1}
    if wrong:
        raise Violation(outcome, f"requests not ended exactly once: {dict(sorted(wrong.items())[:5])}")
    if bound and outcome.peak_hold > outcome.bound + outcome.slack:
        raise Violation(outcome, f"held {outcome.peak_hold} against a bound of {outcome.bound} + {outcome.slack}")
    if s.design == "wait" and outcome.refused:
        raise Violation(outcome, "a read bundle was refused")


def compare(seeds: range) -> str:
    """The comparison table over ``seeds``: means and maxima per design and policy."""
    lines = ["| design | policy | runs with a request unended / over bound + slack | refused reads (mean, max) | "
             "peak hold over bound (max) | poll timer late, p99 s (mean, max) | idle model slot-s while requests "
             "wait (mean, max) | makespan s (mean) |",
             "|---|---|---|---|---|---|---|---|"]
    for design in DESIGNS:
        for policy in POLICIES:
            outcomes = [run(seed, design, policy) for seed in seeds]
            late = [sorted(o.timer_late_s)[int(0.99 * (len(o.timer_late_s) - 1))] if o.timer_late_s else 0.0
                    for o in outcomes]
            idle = [o.idle_slot_s for o in outcomes]
            refused = [o.refused for o in outcomes]
            unended = sum(any(o.ended.get(f"r{i}") != 1 for i in range(o.setup.requests)) for o in outcomes)
            over = sum(o.peak_hold > o.bound + o.slack for o in outcomes)
            lines.append(f"| {design} | {policy} | {unended} / {over} of {len(outcomes)} | "
                         f"{statistics.fmean(refused):.1f}, {max(refused)} | "
                         f"{max(o.peak_hold - o.bound for o in outcomes)} | {statistics.fmean(late):.2f}, "
                         f"{max(late):.2f} | {statistics.fmean(idle):.1f}, {max(idle):.1f} | "
                         f"{statistics.fmean(o.makespan_s for o in outcomes):.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    print(compare(range(count)))
