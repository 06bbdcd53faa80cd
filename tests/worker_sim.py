"""A deterministic simulation of the generate step on Dataflow workers: the real key machine, simulated world.

What runs for real: the key machine and its driver (:func:`pipeline.generation.key_driver.drive`, the one the DoFn
runs), each key's state loaded from and committed to its cells by the real codec
(:mod:`pipeline.generation.key_state`), and the engine side of the poll contract (the real registry of streams,
:class:`~pipeline.engines.stream_registry.StreamRegistry`: keys, output windows, the ``max_in_flight`` rule,
a retried submission joining its stream). What is simulated, each rule from the runner's
documented semantics (the same rules ``local/runner_semantics.py`` follows, with its citations):

* time: a clock that moves only when the scheduler says; timers fire at or after their time, late by a drawn
  amount ("timers ... fire at or after", Beam's state and timers guide);
* work items: a bundle of requests for a key, or one firing of its poll or drain timer, one key at a time,
  committed whole or not at all (Beam's "Bundling and persistence"; Dataflow retries a failed streaming work
  item indefinitely): a failed commit discards the outputs and state writes, and the bundle is delivered again
  or the committed timer fires again;
* redelivery: Pub/Sub delivers at least once, so a bundle may arrive twice; a request shed by its key's full
  queue is republished by its publisher, as its dead letter asks;
* keys move between workers (Streaming Engine keeps state in the service; the old worker's engine keeps its
  streams), a worker's engine host dies (every stream it held is gone), the runtime is unreachable or the
  engine raises on a call, each at drawn rates;
* the model server: tokens at a drawn rate per stream, cut into chunks;
* what a worker VM adds (:class:`VmEvents`, drawn apart so earlier seeds keep their worlds): one to three SDK
  processes per worker sharing its engine, each a lease client whose heartbeat the engine hears while it runs;
  one process paused for more than a stream lease (its keys' work items wait, its heartbeat stops: "Troubleshoot
  Dataflow out of memory errors" and the leases' docstring); a job update mid-stream (every host and process
  replaced, the keys' committed state kept: "Update an existing pipeline"); model-server restarts of drawn
  length (the engine sends each running stream again as its next attempt); a dead host's runtime that takes a
  drawn time to rebuild (its first rebuilds fail: every call to that worker is unreachable meanwhile); and a
  drain while streams run.

Requests are drawn on both lanes (apart from the rest of a seed's world, as the VM's events are): a key holding only
bulk requests, running or waiting, polls at the bulk cadence
(:func:`~pipeline.generation.key_events.bulk_poll_interval_s`).

Safety is checked as each work item commits: each attempt's chunks in order, no gap and no copy; no request ends
twice, nor with a stream its key knew still running uncancelled; a completion after all its chunks, at the cost its
faults allow (a host death or update costing each stream under it one resend) and, where no stream was lost, within
1.05 tokens generated per token delivered over the completions so far; no engine past ``max_in_flight``; no key
polling idle; and as each key's drain commits, its state cleared, the streams it knew ended (unless its cancel
failed: their leases end those) and no stream cut by its lease in the drain. What only the end can tell is checked
at the end: each request ended once, none waiting for the drain, and the token costs again with what generation went
on after a request ended (counted once every engine is done), the 1.05 bound then over every request read.

:func:`run` plays one schedule from a seed and returns its :class:`Report`; :func:`check` raises
:class:`Violation` naming the seed when an invariant fails, so ``run(seed)`` replays it exactly.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.contract.call_outcome import Call
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.parameters import default
from pipeline.contract.stream_progress import ATTEMPT, CHUNK, COMPLETION, DEAD_LETTER, Output
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.stream_registry import Stream, StreamRegistry
from pipeline.generation import key_state
from pipeline.generation.key_driver import drive
from pipeline.generation.key_events import (
    Arrived,
    DrainDue,
    Event,
    PollDue,
    Rules,
    Submission,
    SubmitResult,
    bulk_poll_interval_s,
)
from pipeline.generation.key_events import Report as WaitingReport
from pipeline.generation.step_work import MACHINE_COUNTS


@dataclass(frozen=True)
class Faults:
    """Per work item (or per call), the chance of each fault."""

    commit_fails: float = 0.0
    key_moves: float = 0.0
    host_dies: float = 0.0
    unreachable: float = 0.0
    engine_fails: float = 0.0
    redelivered: float = 0.0
    late_s: float = 0.0  # timers fire late by up to this
    broken: str = ""  # a call ("poll" or "submit") the engine fails every time, from broken_at for broken_s
    broken_at: float = 0.0
    broken_s: float = 0.0

    @property
    def loses_streams(self) -> bool:
        """Whether the schedule may lose streams that were generating (so regenerate tokens), or give them up: a
        spell of failed polls or submissions longer than the bound on lost streams gives up streams running, or
        started by a try whose commit failed and that a retry could not join."""
        return bool(self.key_moves or self.host_dies or self.broken)


@dataclass(frozen=True)
class VmEvents:
    """What a worker VM adds (drawn apart from the rest, so earlier seeds keep their worlds): SDK processes per
    worker sharing its engine (each a lease client), one process paused past a stream lease, a job update, and
    model-server restarts of drawn length, and how long a dead host's runtime takes to be rebuilt."""

    processes: int = 1
    pause: tuple[int, float, float] | None = None  # (process of w0, at, for_s): no work item, no heartbeat
    update_at: float | None = None  # every engine host and process replaced; committed state kept
    restarts: tuple[tuple[float, float], ...] = ()  # (at, length): the model server of w0 restarts
    drain_at: float | None = None  # the job drains then, streams running (else once every key is idle)
    # After a host dies its runtime is acquired anew, and the first rebuilds may fail (a model folder not there
    # yet): for this long every call to its worker is unreachable.
    rebuild_s: float = 0.0

    @property
    def loses_streams(self) -> bool:
        return self.update_at is not None or bool(self.restarts)

    @classmethod
    def draw(cls, rng: random.Random, lease_s: float | None) -> VmEvents:
        processes = rng.randint(1, 3)
        pause = None
        # Past one lease or two; well within the least dedupe window drawn (30 s), past which a copy that
        # arrives is a new request by the contract, and a paused process's redelivered bundle arrives late.
        if lease_s is not None and rng.random() < 0.3:
            pause = (rng.randrange(processes), rng.uniform(0, 2.0), rng.choice([1.5, 2.0]) * lease_s)
        update_at = rng.uniform(0, 3.0) if rng.random() < 0.15 else None
        restarts = tuple(sorted((rng.uniform(0, 3.0), rng.choice([0.5, 5.0, 40.0]))
                                for _ in range(rng.choice([0, 0, 0, 1, 2]))))
        drain_at = rng.uniform(0.2, 2.0) if rng.random() < 0.2 else None
        rebuild_s = rng.choice([0.0, 0.5, 5.0, 40.0])  # drawn last: earlier draws keep their worlds
        return cls(processes, pause, update_at, restarts, drain_at, rebuild_s)


@dataclass(frozen=True)
class Schedule:
    """One drawn world: its sizes, rates and faults."""

    seed: int
    keys: int
    workers: int
    max_in_flight: int
    requests: int
    tokens: tuple[int, ...]  # each request's answer length
    arrivals: tuple[float, ...]  # when each request is published
    rate_tps: float  # tokens a second per stream
    chunk_tokens: int
    faults: Faults
    rules: Rules
    # The engines' stream lease (the template's default); None: no lease ever cancels a running stream (to measure
    # what leases save).
    stream_lease_s: float | None = float(default("stream_lease_s"))
    vm: VmEvents = VmEvents()
    bulk: tuple[bool, ...] = ()  # which requests are the bulk lane's (their keys poll at the bulk cadence)

    @property
    def loses_streams(self) -> bool:
        return self.faults.loses_streams or self.vm.loses_streams

    @classmethod
    def draw(cls, seed: int, *, faults: bool = True, spells: bool = True, vm: bool = True) -> Schedule:
        """The world of ``seed``; ``spells=False`` leaves out the spell of a broken engine call, which was drawn
        after the rest, so the seeds named by earlier regression tests replay the worlds they were found in."""
        rng = random.Random(seed)
        requests = rng.randint(1, 14)
        chance = (lambda p: rng.choice([0.0, p])) if faults else (lambda p: 0.0)
        drawn = Faults(commit_fails=chance(0.2), key_moves=chance(0.05), host_dies=chance(0.01),
                       unreachable=chance(0.05), engine_fails=chance(0.03), redelivered=chance(0.2),
                       late_s=rng.choice([0.0, 0.2, 2.0]))
        rules = Rules(poll_interval_s=0.05, dedupe_window_s=rng.choice([30.0, 600.0]),
                      drain_timeout_s=rng.choice([0.5, 30.0]), waiting_cap=rng.randint(2, 24))
        drawn_world = (rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 6), requests,
                       tuple(rng.randint(1, 24) for _ in range(requests)),
                       tuple(sorted(rng.uniform(0, 2.0) for _ in range(requests))),
                       rng.choice([20.0, 200.0, 2000.0]), rng.choice([1, 4]))
        if faults and spells:  # drawn last: the rest of every seed's world is what it was before spells existed
            drawn = replace(drawn, broken=rng.choice(["", "", "poll", "submit"]), broken_at=rng.uniform(0, 2.0),
                            broken_s=rng.choice([1.0, 10.0]))
        events = VmEvents.draw(random.Random(seed * 104729 + 3), cls.stream_lease_s) if faults and vm else VmEvents()
        bulk: tuple[bool, ...] = ()
        if vm:  # drawn apart, as the VM's events are: a seed's other draws are what they were before the lanes
            lanes = random.Random(seed * 7919 + 5)
            share = lanes.choice([0.0, 0.5, 1.0])
            bulk = tuple(lanes.random() < share for _ in range(requests))
            lease = cls.stream_lease_s if cls.stream_lease_s is not None else float("inf")
            rules = replace(rules, bulk_poll_interval_s=bulk_poll_interval_s(lease))
        return cls(seed, *drawn_world, drawn, rules, vm=events, bulk=bulk)


# What a dead letter that sheds a request says: the key's queue was full, republish it. Its id is released with
# the letter, so its republish is served: the simulated publisher republishes each, and the request must end.
SHED = "queue for its key is full"

# Committed polls in a row a key may fire that hold no request and change nothing it keeps (an idle poll): a key
# that keeps polling with nothing to do costs a work item every poll interval for ever.
IDLE_POLLS_MAX = 2


def _held(cells: dict[str, Any]) -> dict[str, Any]:
    """What a key keeps, less when its timer is next due."""
    return {name: value for name, value in cells.items() if name not in ("poll_at_ms", "wait_ms")}


class Violation(AssertionError):
    def __init__(self, seed: int, what: str) -> None:
        super().__init__(f"seed {seed}: {what} (replay: tests.worker_sim.run({seed}))")


@dataclass
class _Generation:
    """One stream at the simulated model server: tokens at a rate from when it started, cut into chunks."""

    stream: Stream  # the registry's record of it, which its outputs go to
    started: float
    rate: float
    chunk_tokens: int
    produced: int = 0
    chunks: int = 0
    cut: int = 0  # tokens already in chunks
    text: str = ""
    done: bool = False

    def advance(self, now: float) -> tuple[int, list[tuple[Output, bool]]]:
        """Generates up to ``now``: the tokens it generated, and its new outputs (each with whether it is the
        stream's last)."""
        if self.done or now < self.started:  # a restarted server is not back yet
            return 0, []
        request, outputs = self.stream.request, []
        total = request.max_tokens or 1
        target = min(total, int((now - self.started) * self.rate) + 1)  # the first token at once
        made = max(target - self.produced, 0)
        for n in range(self.produced, self.produced + made):
            self.text += f"t{n} "
            if (n + 1) % self.chunk_tokens == 0 or n + 1 == total:
                outputs.append((self._chunk(n + 1), False))
        self.produced += made
        if self.produced == total:
            self.done = True
            outputs.append(((COMPLETION, json.dumps({
                "id": request.id, "attempt": self.stream.attempt, "text": self.text, "tokens": total,
                "chunks": self.chunks, "time_to_first_token_ms": None, "output_error": None,
                "finish_reason": "length", "accelerator_seconds": 0.0})), True))
        return made, outputs

    def _chunk(self, upto: int) -> Output:
        text = "".join(f"t{n} " for n in range(self.cut, upto))
        self.cut = upto
        self.chunks += 1
        return CHUNK, json.dumps({"id": self.stream.request.id, "attempt": self.stream.attempt,
                                  "seq": self.chunks - 1, "text": text})


class SimEngine:
    """One worker's engine: the real registry of streams (:class:`~pipeline.engines.stream_registry.
    StreamRegistry`, the one the engine holds) in front of a simulated model server. Its callers are the
    worker's SDK processes, each a lease client (``p<n>``); ``awake`` names those that send their heartbeat."""

    def __init__(self, name: str, schedule: Schedule) -> None:
        self.name, self.schedule = name, schedule
        settings = EngineSettings(server=None, server_url="http://simulated", max_in_flight=schedule.max_in_flight)
        if schedule.stream_lease_s is not None:  # else no janitor ticks (advance): the engine's lease goes unread
            settings = replace(settings, stream_lease_s=schedule.stream_lease_s)
        self.registry = StreamRegistry(settings, name)
        self.server: dict[str, _Generation] = {}  # what the model server generates, by stream key
        self.generated = 0
        self.generated_for: Counter[str] = Counter()  # by request id
        self.expired = 0  # running streams cancelled because their lease ran out
        self.expired_at: dict[str, float] = {}  # when each of those was, by stream key
        self.awake: set[str] = {f"p{n}" for n in range(schedule.vm.processes)}
        self._leases_at = 0.0  # when the janitor last ticked

    def unfinished(self) -> int:
        return self.registry.unfinished

    def running(self) -> set[str]:
        """The request ids whose streams the engine runs now."""
        return {stream.request.id for stream in self.registry.streams.values() if not stream.done}

    def submit(self, request_jsons: tuple[str, ...], attempts: tuple[int, ...], now: float,
               client: str) -> list[str | None]:
        requests = [InferenceRequest.from_json(text) for text in request_jsons]
        keys, started = self.registry.submit(requests, list(attempts), client, now)
        for stream in started:
            self.server[stream.key] = _Generation(stream, now, self.schedule.rate_tps, self.schedule.chunk_tokens)
            self._advance(self.server[stream.key], now)
        return keys

    def poll(self, positions: dict[str, int], client: str) -> dict[str, list[Output]]:
        return self.registry.poll(positions, client)

    def cancel(self, keys: tuple[str, ...]) -> None:
        for stream in self.registry.stop(self.registry.take(list(keys)), 0.0):
            self.server.pop(stream.key, None)

    def hold_leases(self, for_s: float) -> None:
        self.registry.leases.hold(for_s)

    def restart(self, now: float, length_s: float) -> None:
        """The model server restarts, back after ``length_s``: the engine sends each running stream again as its
        next attempt, which says so in its window (as :meth:`pipeline.engines.engine.Engine.restart` does)
        and generates from its start."""
        for key, generation in list(self.server.items()):
            stream = generation.stream
            stream.attempt += 1
            stream.window.add((ATTEMPT, str(stream.attempt)))
            self.server[key] = _Generation(stream, now + length_s, self.schedule.rate_tps, self.schedule.chunk_tokens)

    def advance(self, now: float) -> None:
        """The model server and the engine's janitor up to ``now``: streams generate, and the lease clocks tick as
        the engine's janitor ticks them, cancelling the streams whose lease ran out."""
        tick_s = self.registry.tick_s
        while self.schedule.stream_lease_s is not None and self._leases_at + tick_s <= now:
            if not self.registry.streams:  # nothing a tick could expire: the clocks' readings matter to no stream
                self._leases_at += tick_s * int((now - self._leases_at) / tick_s)
                break
            self._leases_at += tick_s
            for client in self.awake:  # each live process's heartbeat (pipeline.worker.runtime)
                self.registry.leases.heard(client)
            for generation in list(self.server.values()):
                self._advance(generation, self._leases_at)
            for stream in self.registry.stop(self.registry.expire(tick_s), self._leases_at):
                self.server.pop(stream.key, None)
                self.expired += 1
                self.expired_at[stream.key] = self._leases_at
        for generation in list(self.server.values()):
            self._advance(generation, now)

    def _advance(self, generation: _Generation, now: float) -> None:
        made, outputs = generation.advance(now)
        self.generated += made
        self.generated_for[generation.stream.request.id] += made
        for output, final in outputs:
            self.registry.emit(generation.stream, output, final=final)
        if generation.done:
            del self.server[generation.stream.key]


# The names of a key's cells, as the DoFn's state declares them.
CELL_NAMES = tuple(name for name, member in vars(key_state.KeyCells).items() if isinstance(member, property))


class _Cell:
    """A state cell as the runner keeps it between work items: a bag's list or a value (None: cleared)."""

    def __init__(self, bag: bool = False) -> None:
        self.bag = bag
        self.value: Any = [] if bag else None

    def read(self) -> Any:
        return self.value

    def add(self, value: str) -> None:
        self.value = [*self.value, value]  # a new list: a snapshot read before stays as it was

    def write(self, value: Any) -> None:
        self.value = value

    def clear(self) -> None:
        self.value = [] if self.bag else None


@dataclass
class _Key:
    """What the runner keeps for one key: its committed cells (loaded and written by the DoFn's own
    :func:`~pipeline.generation.key_state.read_cells` and ``write_cells``) and timers."""

    waiting: _Cell = field(default_factory=lambda: _Cell(bag=True))
    inflight: _Cell = field(default_factory=lambda: _Cell(bag=True))
    progress: _Cell = field(default_factory=_Cell)
    seen: _Cell = field(default_factory=_Cell)
    poll_at_ms: _Cell = field(default_factory=_Cell)
    wait_ms: _Cell = field(default_factory=_Cell)
    poll_at: float | None = None
    drain_set: bool = False

    @property
    def cells(self) -> dict[str, Any]:
        """Each cell's committed value, by name."""
        return {name: getattr(self, name).read() for name in CELL_NAMES}


@dataclass
class Report:
    schedule: Schedule
    ended: Counter[str] = field(default_factory=Counter)  # request id -> completions + dead letters committed
    shed: Counter[str] = field(default_factory=Counter)  # request id -> dead letters that shed it (SHED)
    completions: dict[str, dict] = field(default_factory=dict)
    letters: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    chunks: Counter[tuple[str, int, int]] = field(default_factory=Counter)  # (id, attempt, seq) committed
    chunk_text: dict[tuple[str, int, int], str] = field(default_factory=dict)
    generated: int = 0
    generated_for: Counter[str] = field(default_factory=Counter)  # by request id, every engine's
    delivered: int = 0
    ended_before_drain: set[str] = field(default_factory=set)
    moves: int = 0
    expired: int = 0  # running streams cancelled because their lease ran out
    seconds: float = 0.0  # simulated time until every request ended (or the calm spell ran out)
    host_deaths: int = 0
    updates: int = 0
    hits: Counter[str] = field(default_factory=Counter)  # request id -> host deaths and updates its stream ran through
    restarted: set[str] = field(default_factory=set)  # request ids whose streams ran through a server restart
    read: set[str] = field(default_factory=set)  # requests read before the drain (all, unless it came early)
    work_items: int = 0
    left_state: dict[int, dict] = field(default_factory=dict)
    idle_polls: Counter[int] = field(default_factory=Counter)  # per key, the most idle polls in a row (_held)


@dataclass
class _SimWorkItem:
    """One work item's port for the key driver (:class:`~pipeline.generation.key_driver.KeyPort`), the DoFn's
    counterpart: the key's worker's simulated engine through the world's faults, simulated time, the timer's
    settings and the outputs, kept for the commit."""

    world: World
    key: int
    outputs: list[Output] = field(default_factory=list)
    timer: list[float | None] = field(default_factory=list)  # the poll timer's settings in order (None: cleared)
    uncancelled: set[str] = field(default_factory=set)  # streams whose cancel this work item made failed

    def now(self) -> float:
        return self.world.now

    def wait(self, seconds: float) -> None:
        self.world.tick(self.world.now + seconds)

    def hold_leases(self, seconds: float) -> None:
        self.world.call(self.key, "hold", lambda engine: engine.hold_leases(seconds))

    def count(self, counts: Mapping[str, int], logs: tuple[tuple[int, str], ...]) -> None:
        """The simulator checks what ends, not the counters; but a count the generate step has no counter for
        would raise there, and Dataflow retry the work item for ever."""
        if unknown := set(counts) - set(MACHINE_COUNTS):
            raise Violation(self.world.s.seed, f"counts {sorted(unknown)} have no counter in the generate step")

    def emit(self, output: Output) -> None:
        self.outputs.append(output)

    def cancel(self, streams: tuple[str, ...]) -> None:
        outcome, _ = self.world.call(self.key, "cancel", lambda engine: engine.cancel(streams))
        if outcome is not Call.ANSWERED:  # not cancelled: its lease ends it (the contract's word for it)
            self.world.uncancelled.update((self.world.owner[self.key], stream) for stream in streams)
            self.uncancelled.update(streams)

    def report(self, report: WaitingReport) -> None:
        if self.world.on_report is not None:
            self.world.call(self.key, "report", lambda engine: self.world.on_report(self.key, report)
                            if self.world.on_report is not None else None)

    def set_timer(self, at: float | None) -> None:
        self.timer.append(at)

    def poll(self, asked: Mapping[str, int]) -> tuple[Call, Mapping[str, list[Output]]]:
        client = self.world.client_of(self.key)
        outcome, answers = self.world.call(self.key, "poll", lambda engine: engine.poll(dict(asked), client))
        return outcome, answers or {}

    def submit(self, submission: Submission) -> SubmitResult:
        return self.world._submit(self.key, submission)


class World:
    """One schedule's keys, engines and report; :func:`run` plays it (``tests/vm_sim.py`` drives its keys from
    simulated harness threads instead)."""

    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.rng = random.Random(schedule.seed * 7919 + 1)
        self.now = 0.0
        self.engines = {f"w{n}": SimEngine(f"w{n}", schedule) for n in range(schedule.workers)}
        self.owner = {key: "w0" for key in range(schedule.keys)}
        self.process = {key: key % schedule.vm.processes for key in range(schedule.keys)}  # its SDK process
        self.keys = {key: _Key() for key in range(schedule.keys)}
        self._restarts = list(schedule.vm.restarts)
        self.rebuilt_at: dict[str, float] = {}  # worker -> when its dead host's runtime answers again
        self.read: set[str] = set()  # requests whose bundle a committed work item took
        self.shed_pending: set[str] = set()  # shed requests whose republish no committed work item took yet
        self.uncancelled: set[tuple[str, str]] = set()  # (worker, stream) whose cancel failed
        self._updated = schedule.vm.update_at is None
        self._next_seq: Counter[tuple[str, int]] = Counter()  # (id, attempt) -> the next chunk to be delivered
        self._completed = [0, 0]  # tokens generated for the completed requests by their completion, and delivered
        self.report = Report(schedule)
        self.bundles: list[tuple[float, int, tuple[InferenceRequest, ...]]] = []
        self.faulty = True
        # Told each key's report to the worker's admission ledger (tests/vm_sim.py runs the ledger around this).
        self.on_report: Callable[[int, WaitingReport], None] | None = None
        self._idle_run: Counter[int] = Counter()
        for i, at in enumerate(schedule.arrivals):
            request = InferenceRequest(id=f"r{i}", prompt=f"p{i}", max_tokens=schedule.tokens[i], prompt_tokens=1,
                                       received_at=at, lane="bulk" if schedule.bulk[i:i + 1] == (True,) else None)
            self.bundles.append((at, i % schedule.keys, (request,)))
        self.published = {bundle[2][0].id: bundle for bundle in self.bundles}

    def chance(self, p: float) -> bool:
        return self.faulty and p > 0 and self.rng.random() < p

    def engine_of(self, key: int) -> SimEngine:
        return self.engines[self.owner[key]]

    def client_of(self, key: int) -> str:
        return f"p{self.process[key]}"

    def paused(self, key: int) -> bool:
        """Whether the key's SDK process is paused now (its work items wait for it: one key at a time)."""
        pause = self.s.vm.pause
        return (pause is not None and self.owner[key] == "w0" and self.process[key] == pause[0]
                and pause[1] <= self.now < pause[1] + pause[2] and not self._replaced_by_update())

    def _replaced_by_update(self) -> bool:
        """Whether an update replaced every process (a paused one is gone with the rest)."""
        return self.s.vm.update_at is not None and self._updated

    def _vm_events(self) -> None:
        """The VM's drawn events that are due: the pause's heartbeat, an update, model-server restarts."""
        pause = self.s.vm.pause
        if pause is not None:
            w0, client = self.engines["w0"], f"p{pause[0]}"
            if pause[1] <= self.now < pause[1] + pause[2] and not self._replaced_by_update():
                w0.awake.discard(client)
            else:
                w0.awake.add(client)
        if not self._updated and self.now >= (self.s.vm.update_at or 0.0):
            self._updated = True  # every process and engine host replaced; the keys' committed state carries over
            for name in sorted(self.engines):
                self.host_died(name)
            self.report.updates += 1
        while self._restarts and self._restarts[0][0] <= self.now:
            _, length = self._restarts.pop(0)
            self.report.restarted |= self.engines["w0"].running()
            self.engines["w0"].restart(self.now, length)

    def host_died(self, name: str) -> None:
        dead = self.engines[name]
        for request_id in {stream.request.id for stream in dead.registry.streams.values()}:  # finished ones too
            self.report.hits[request_id] += 1
        self.report.generated += dead.generated
        self.report.generated_for.update(dead.generated_for)
        self.report.expired += dead.expired
        self.engines[name] = SimEngine(f"{name}'", self.s)  # a new host: new stream keys, none of the old

    def tick(self, to: float) -> None:
        """Moves the clock to ``to``, stopping at the pause's start and end on the way, so the engine's janitor
        hears the paused process's heartbeat only while it runs."""
        pause = self.s.vm.pause
        for boundary in (() if pause is None else (pause[1], pause[1] + pause[2])):
            if self.now < boundary < to:
                self._tick_to(boundary)
        self._tick_to(to)

    def _tick_to(self, to: float) -> None:
        self.now = max(self.now, to)
        self._vm_events()
        for engine in self.engines.values():
            engine.advance(self.now)

    def call(self, key: int, kind: str, what: Callable[[SimEngine], Any]) -> tuple[Call, Any]:
        f = self.s.faults
        # The chance is drawn first: a world with a rebuild outage draws what it drew without one.
        if self.chance(f.unreachable) | (self.now < self.rebuilt_at.get(self.owner[key], 0.0)):
            return Call.UNREACHABLE, None
        if self.chance(f.engine_fails) or (self.faulty and kind == f.broken
                                           and f.broken_at <= self.now < f.broken_at + f.broken_s):
            return Call.FAILED, None
        return Call.ANSWERED, what(self.engine_of(key))

    def work_item(self, key: int, event: Event) -> bool:
        """One work item of ``key``; whether it committed."""
        self.report.work_items += 1
        record = self.keys[key]
        before = key_state.read_cells(record)

        port = _SimWorkItem(self, key)
        after = drive(self.s.rules, before, event, port)
        for engine in self.engines.values():
            if engine.unfinished() > self.s.max_in_flight:
                raise Violation(self.s.seed, f"engine {engine.name} runs {engine.unfinished()} streams, past "
                                             f"max_in_flight={self.s.max_in_flight}")
        if self.chance(self.s.faults.commit_fails):
            return False
        key_state.write_cells(record, before, after)
        if isinstance(event, Arrived):  # read: before its outputs, which may shed it again
            self.read.update(request.id for request in event.requests)
            self.shed_pending.difference_update(request.id for request in event.requests)
        if isinstance(event, PollDue):
            record.poll_at = None  # a timer that fires is cleared unless the callback sets it again
        if port.timer:
            record.poll_at = port.timer[-1]
        ended = self._deliver(port.outputs)
        # A request that ended leaves no stream running that its key knew: finished, or cancelled by this work
        # item (unless that cancel failed, and the stream's lease ends it).
        engine, knew = self.engine_of(key), {entry.request_id: entry.key for entry in before.inflight if entry.key}
        for request_id in ended:
            stream = engine.registry.streams.get(knew.get(request_id) or "")
            if stream is not None and not stream.done and stream.key not in port.uncancelled:
                raise Violation(self.s.seed, f"request {request_id} ended with its stream {stream.key} still "
                                             f"running (at {self.now:.2f} s)")
        return True

    def _submit(self, key: int, submission: Submission) -> SubmitResult:
        client = self.client_of(key)
        outcome, streams = self.call(key, "submit", lambda engine: engine.submit(submission.requests,
                                                                                 submission.attempts, self.now, client))
        return SubmitResult.of(submission, outcome, streams)

    def _deliver(self, outputs: list[Output]) -> list[str]:
        """Records a committed work item's outputs, checking at once what must hold after every step: each
        attempt's chunks arrive in order, without a gap or a copy, and no request ends twice. Returns the ids of
        the requests that ended."""
        r, seed = self.report, self.s.seed
        ended: list[str] = []
        for kind, payload in outputs:
            record = json.loads(payload)
            if kind == CHUNK:
                index = (record["id"], record["attempt"], record["seq"])
                expected = self._next_seq[index[:2]]
                if record["seq"] != expected:
                    raise Violation(seed, f"request {record['id']} attempt {record['attempt']}: chunk "
                                          f"{record['seq']} delivered where {expected} was next (at {self.now:.2f} s)")
                self._next_seq[index[:2]] += 1
                r.chunks[index] += 1
                r.chunk_text[index] = record["text"]
            elif kind == COMPLETION:
                if r.ended[record["id"]]:
                    raise Violation(seed, f"request {record['id']} ended twice (at {self.now:.2f} s)")
                self._check_completion(record)
                r.ended[record["id"]] += 1
                ended.append(record["id"])
                r.completions[record["id"]] = record
                r.delivered += record["tokens"]
            else:
                assert kind == DEAD_LETTER, kind
                r.letters[record["id"]].append(record)
                if SHED in record["reason"]:  # not an end: the publisher republishes it, as the letter asks
                    r.shed[record["id"]] += 1
                    self.shed_pending.add(record["id"])
                    _, key, requests = self.published[record["id"]]
                    backoff = min(2.0 ** (r.shed[record["id"]] - 1), 30.0)  # a publisher that backs off
                    self.bundles.append((self.now + self.rng.uniform(0.05, 1.0) * backoff, key, requests))
                else:
                    if r.ended[record["id"]]:
                        raise Violation(seed, f"request {record['id']} ended twice (at {self.now:.2f} s)")
                    r.ended[record["id"]] += 1
                    ended.append(record["id"])
        return ended

    def _check_completion(self, record: dict[str, Any]) -> None:
        """What must hold as a completion commits: every chunk of its attempt delivered before it, adding up to
        its text; and where nothing but host deaths and updates lost streams, the contract's cost of each: one
        resend of each stream that ran through it, in attempts and in the tokens generated for it so far."""
        r, s, request_id, attempt = self.report, self.s, record["id"], record["attempt"]
        if self._next_seq[(request_id, attempt)] != record["chunks"]:
            raise Violation(s.seed, f"request {request_id} completed after {self._next_seq[(request_id, attempt)]} "
                                    f"of its {record['chunks']} chunks (at {self.now:.2f} s)")
        if "".join(r.chunk_text[(request_id, attempt, q)] for q in range(record["chunks"])) != record["text"]:
            raise Violation(s.seed, f"request {request_id}: its chunks do not add up to its completion")
        if not (s.faults.key_moves or s.faults.broken or s.vm.restarts) and attempt > 1 + r.hits[request_id]:
            raise Violation(s.seed, f"request {request_id} ended at attempt {attempt} after {r.hits[request_id]} "
                                    "host deaths or updates under it")
        # The token cost so far (check() counts what generation goes on after, once every engine is done).
        generated = r.generated_for[request_id] + sum(e.generated_for[request_id] for e in self.engines.values())
        if not (s.faults.key_moves or s.faults.broken or s.vm.restarts) and \
                generated > record["tokens"] * (1 + r.hits[request_id]):
            raise Violation(s.seed, f"request {request_id}: {generated} tokens generated for {record['tokens']} "
                                    f"by its completion, after {r.hits[request_id]} host deaths or updates under it")
        self._completed[0] += generated
        self._completed[1] += record["tokens"]
        # Where no stream was lost so far (none drawn, and no host death the VM simulator staged ran through one).
        if not (s.loses_streams or r.hits) and self._completed[0] > 1.05 * self._completed[1] + 1:
            raise Violation(s.seed, f"{self._completed[0]} tokens generated for the {self._completed[1]} delivered "
                                    f"by the completions so far (at {self.now:.2f} s): past 1.05 per token "
                                    "delivered, with no stream lost to a move or a host death")

    def due(self) -> list[tuple[str, int, Any]]:
        items: list[tuple[str, int, Any]] = [("bundle", key, b) for b in self.bundles if b[0] <= self.now
                                             for key in (b[1],)]
        items += [("poll", key, None) for key, k in self.keys.items()
                  if k.poll_at is not None and k.poll_at <= self.now]
        return [item for item in items if not self.paused(item[1])]

    def next_time(self) -> float | None:
        times = [b[0] for b in self.bundles] + [k.poll_at for k in self.keys.values() if k.poll_at is not None]
        pause = self.s.vm.pause
        if times and pause is not None and self.now < pause[1] + pause[2] and min(times) <= self.now:
            times.append(pause[1] + pause[2])  # only paused keys' work is due: the pause's end comes next
            times = [t for t in times if t > self.now]
        return min(times) if times else None

    def step(self) -> bool:
        """One work item, or the clock moved to the next one; False when nothing is left to do."""
        items = self.due()
        if not items:
            upcoming = self.next_time()
            if upcoming is None:
                return False
            late = self.rng.uniform(0, self.s.faults.late_s) if self.faulty else 0.0
            self.tick(upcoming + late)
            return True
        kind, key, payload = items[self.rng.randrange(len(items))]
        if kind == "bundle":
            self.bundles.remove(payload)
            committed = self.work_item(key, Arrived(self.now, payload[2], f"b{self.rng.randrange(10**9)}"))
            self.keys[key].drain_set = True
            if not committed or self.chance(self.s.faults.redelivered):
                self.bundles.append((self.now + self.rng.uniform(0.01, 0.5), key, payload[2]))
        else:
            before = _held(self.keys[key].cells)
            if self.work_item(key, PollDue(self.now)):
                idle = not before["inflight"] and not before["waiting"] and _held(self.keys[key].cells) == before
                self._idle_run[key] = self._idle_run[key] + 1 if idle else 0
                self.report.idle_polls[key] = max(self.report.idle_polls[key], self._idle_run[key])
                if self._idle_run[key] > IDLE_POLLS_MAX:
                    raise Violation(self.s.seed, f"key {key} polled {self._idle_run[key]} times in a row holding no "
                                                 f"request and changing nothing (at {self.now:.2f} s)")
        self.tick(self.now + self.rng.uniform(0.0005, 0.005))
        if self.chance(self.s.faults.key_moves) and self.s.workers > 1:
            moved = self.rng.randrange(self.s.keys)
            self.owner[moved] = self.rng.choice(sorted(self.engines))
            self.process[moved] = self.rng.randrange(self.s.vm.processes)
            self.report.moves += 1
        if self.chance(self.s.faults.host_dies):
            dead = self.rng.choice(sorted(self.engines))
            self.host_died(dead)
            self.rebuilt_at[dead] = self.now + self.s.vm.rebuild_s
            self.report.host_deaths += 1
        return True


def run(seed: int, *, faults: bool = True, spells: bool = True, vm: bool = True, max_items: int = 20_000) -> Report:
    """Plays the schedule of ``seed``: arrivals with faults, then a calm spell (faults off) until every key is idle
    or the clock passes 600 s, then a drain of every key. Deterministic in ``seed``; ``spells`` and ``vm`` False
    leave out what was drawn after a seed was named by a regression test."""
    return play(Schedule.draw(seed, faults=faults, spells=spells, vm=vm), max_items=max_items)


def play(schedule: Schedule, *, max_items: int = 20_000) -> Report:
    """Plays ``schedule`` as :func:`run` does (for a schedule changed from the drawn one)."""
    world = World(schedule)
    drain_at = schedule.vm.drain_at
    # While a restarted server is away its keys' streams still run: each key polls them at its interval.
    max_items += int(sum(length for _, length in schedule.vm.restarts) * schedule.keys / schedule.rules.poll_interval_s)
    while world.step():
        if drain_at is not None and world.now >= drain_at:
            break  # the job drains now: it reads no more (what is unread stays in Pub/Sub for the next job)
        # Likewise while a dead host's runtime is rebuilt.
        rebuilding = world.report.host_deaths * schedule.vm.rebuild_s * schedule.keys / schedule.rules.poll_interval_s
        if world.report.work_items > max_items + rebuilding:
            raise Violation(schedule.seed, f"more than {max_items} work items: a key polls without end")
        if world.now > 60 and world.faulty:
            world.faulty = False  # the calm spell: whatever the faults left must now finish
        if world.now > 600:
            break
    world.report.ended_before_drain = set(world.report.ended)
    world.report.read = world.read - world.shed_pending  # a shed request's republish stays in Pub/Sub
    world.report.seconds = world.now
    world.faulty = True
    # The streams the keys' committed state knows on the engine each key is on: the drain must end each (a try
    # whose commit failed may have left one nobody knows, and a key that moved left its old worker's: their
    # leases end those, or the job's end).
    known_by_key = {key: {(world.owner[key], entry.key) for entry in key_state.read_cells(record).inflight
                          if entry.key} for key, record in world.keys.items()}
    known = set().union(*known_by_key.values())
    drain_began, engines_then = world.now, dict(world.engines)
    for key, record in world.keys.items():
        if not record.drain_set:
            continue
        while not world.work_item(key, DrainDue(world.now)):
            pass  # a failed commit: the runner fires the drain timer again
        # Checked as each key's drain commits: its state cleared, the streams it knew ended (unless a cancel it
        # made failed: their leases end those), and no stream any key knew cut by its lease meanwhile (keys drain
        # one at a time, and each drain holds every stream's lease while it runs, so that a key drained late finds
        # its streams: pipeline.generation.key_machine._hold).
        left = world.report.left_state[key] = {k: v for k, v in record.cells.items() if v}
        if left:
            raise Violation(schedule.seed, f"key {key} holds state after its drain: {sorted(left)}")
        running = _running(world, known_by_key[key])
        if running:
            raise Violation(schedule.seed, f"engine {running[0][0]} still runs {len(running)} streams after key "
                                           f"{key} drained: {[stream for _, stream in running[:5]]}")
        cut = _cut_in_drain(world, known, drain_began, engines_then)
        if cut:
            raise Violation(schedule.seed, f"streams the drain should have held were cut by their lease by the "
                                           f"time key {key} drained: {cut[:5]}")
    # What the engines alive at the end generated and expired: a host that died (in the drain too) added its own.
    world.report.generated += sum(e.generated for e in world.engines.values())
    world.report.expired += sum(e.expired for e in world.engines.values())
    for engine in world.engines.values():
        world.report.generated_for.update(engine.generated_for)
    return world.report


def _running(world: World, streams: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Of these (worker, stream), those still running on their engine, less those whose cancel failed."""
    return sorted((name, key) for name, key in streams if name in world.engines and (name, key) not in world.uncancelled
                  and (stream := world.engines[name].registry.streams.get(key)) is not None and not stream.done)


def _cut_in_drain(world: World, known: set[tuple[str, str]], drain_began: float,
                  engines_then: dict[str, SimEngine]) -> list[str]:
    """Of the streams known when the drain began, those cut by their lease since, on engines alive throughout (a
    host that died in the drain took its streams with it)."""
    return sorted(f"{name}/{stream}" for name, stream in known
                  if world.engines.get(name) is engines_then.get(name) is not None
                  and drain_began < world.engines[name].expired_at.get(stream, -1.0) <= world.now)


def check(report: Report) -> None:
    """Raises :class:`Violation` unless every invariant holds for the played schedule."""
    s, seed = report.schedule, report.schedule.seed
    # Each request ends once; after an early drain, each the job read (the rest stays in Pub/Sub).
    ids = report.read if s.vm.drain_at is not None else {f"r{i}" for i in range(s.requests)}
    for request_id in sorted(ids | set(report.ended)):
        if report.ended[request_id] != (request_id in ids):
            raise Violation(seed, f"request {request_id} ended {report.ended[request_id]} times")
    # Checked as each work item committed: chunks in order and adding up to each completion, each request ended
    # at most once at the cost its faults allow, no key polling idle, none holding state after its drain.
    if s.vm.drain_at is None and report.ended_before_drain != ids:
        raise Violation(seed, f"requests wedged until the drain: {sorted(ids - report.ended_before_drain)}")
    if not (s.faults.key_moves or s.faults.broken or s.vm.restarts):
        # The contract's cost of a host's death (or an update's) in tokens: each stream on it generated again once
        # at most (what each engine generated is known once it died or the run ended).
        for request_id, completion in report.completions.items():
            if report.generated_for[request_id] > completion["tokens"] * (1 + report.hits[request_id]):
                raise Violation(seed, f"request {request_id}: {report.generated_for[request_id]} tokens generated "
                                      f"for {completion['tokens']}, after {report.hits[request_id]} host deaths or "
                                      "updates under it")
    # For the requests read (an early drain can leave a stream that a try whose commit failed started for one the
    # job never read: Pub/Sub delivers it to the next job), and none a drain cut short.
    cut_by_drain = any(letter["stage"] == "drain" for letters in report.letters.values() for letter in letters)
    generated = sum(report.generated_for[request_id] for request_id in ids)
    if not s.loses_streams and not cut_by_drain and generated > 1.05 * report.delivered + 1:
        raise Violation(seed, f"{generated} tokens generated for {report.delivered} delivered: past 1.05 per "
                              "token delivered, with no stream lost to a move or a host death")


def leases(seeds: range, slow: float) -> str:
    """What stream leases save against their absence: the worlds of ``seeds`` on two workers or more, keys moving
    at 5 % a work item, every stream ``slow`` times slower than drawn, with the default lease and with none."""
    lines = ["| lease | worlds | key moves per worker-hour | answer s (mean, max) | running streams cancelled by "
             "their lease | tokens generated | tokens delivered | generated per delivered |",
             "|---|---|---|---|---|---|---|---|"]
    for lease in (Schedule.stream_lease_s, None):
        reports = []
        for seed in seeds:
            drawn = Schedule.draw(seed)
            schedule = replace(drawn, workers=max(drawn.workers, 2), rate_tps=drawn.rate_tps / slow,
                               faults=replace(drawn.faults, key_moves=0.05), stream_lease_s=lease)
            reports.append(play(schedule, max_items=200_000))
        generated, delivered = sum(r.generated for r in reports), sum(r.delivered for r in reports)
        worker_hours = sum(r.seconds * r.schedule.workers for r in reports) / 3600
        answers = [tokens / r.schedule.rate_tps for r in reports for tokens in r.schedule.tokens]
        lines.append(f"| {'none' if lease is None else f'{lease:g} s'} | {len(reports)} | "
                     f"{sum(r.moves for r in reports) / worker_hours:.0f} | "
                     f"{statistics.fmean(answers):.1f}, {max(answers):.1f} | {sum(r.expired for r in reports)} | "
                     f"{generated} | {delivered} | {generated / max(delivered, 1):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    slow = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    print(leases(range(count), slow))
