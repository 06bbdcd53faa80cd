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
* the model server: tokens at a drawn rate per stream, cut into chunks.

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
from pipeline.contract.stream_progress import CHUNK, COMPLETION, DEAD_LETTER, Output
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.leases import IN_PROCESS
from pipeline.engines.stream_registry import Stream, StreamRegistry
from pipeline.generation import key_state
from pipeline.generation.key_driver import drive
from pipeline.generation.key_events import Arrived, DrainDue, Event, PollDue, Rules, Submission, SubmitResult
from pipeline.generation.key_events import Report as WaitingReport
from pipeline.generation.key_state import KeyState


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

    @classmethod
    def draw(cls, seed: int, *, faults: bool = True, spells: bool = True) -> Schedule:
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
        return cls(seed, *drawn_world, drawn, rules)


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
        if self.done:
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
    StreamRegistry`, the one the engine holds) in front of a simulated model server."""

    def __init__(self, name: str, schedule: Schedule) -> None:
        self.name, self.schedule = name, schedule
        settings = EngineSettings(server=None, server_url="http://simulated", max_in_flight=schedule.max_in_flight)
        if schedule.stream_lease_s is not None:  # else no janitor ticks (advance): the engine's lease goes unread
            settings = replace(settings, stream_lease_s=schedule.stream_lease_s)
        self.registry = StreamRegistry(settings, name)
        self.server: dict[str, _Generation] = {}  # what the model server generates, by stream key
        self.generated = 0
        self.expired = 0  # running streams cancelled because their lease ran out
        self._leases_at = 0.0  # when the janitor last ticked

    def unfinished(self) -> int:
        return self.registry.unfinished

    def submit(self, request_jsons: tuple[str, ...], attempts: tuple[int, ...], now: float) -> list[str | None]:
        requests = [InferenceRequest.from_json(text) for text in request_jsons]
        keys, started = self.registry.submit(requests, list(attempts), IN_PROCESS, now)
        for stream in started:
            self.server[stream.key] = _Generation(stream, now, self.schedule.rate_tps, self.schedule.chunk_tokens)
            self._advance(self.server[stream.key], now)
        return keys

    def poll(self, positions: dict[str, int]) -> dict[str, list[Output]]:
        return self.registry.poll(positions, IN_PROCESS)

    def cancel(self, keys: tuple[str, ...]) -> None:
        for stream in self.registry.stop(self.registry.take(list(keys)), 0.0):
            self.server.pop(stream.key, None)

    def hold_leases(self, for_s: float) -> None:
        self.registry.leases.hold(for_s)

    def advance(self, now: float) -> None:
        """The model server and the engine's janitor up to ``now``: streams generate, and the lease clocks tick as
        the engine's janitor ticks them, cancelling the streams whose lease ran out."""
        tick_s = self.registry.tick_s
        while self.schedule.stream_lease_s is not None and self._leases_at + tick_s <= now:
            if not self.registry.streams:  # nothing a tick could expire: the clocks' readings matter to no stream
                self._leases_at += tick_s * int((now - self._leases_at) / tick_s)
                break
            self._leases_at += tick_s
            for generation in list(self.server.values()):
                self._advance(generation, self._leases_at)
            for stream in self.registry.stop(self.registry.expire(tick_s), self._leases_at):
                self.server.pop(stream.key, None)
                self.expired += 1
        for generation in list(self.server.values()):
            self._advance(generation, now)

    def _advance(self, generation: _Generation, now: float) -> None:
        made, outputs = generation.advance(now)
        self.generated += made
        for output, final in outputs:
            self.registry.emit(generation.stream, output, final=final)
        if generation.done:
            del self.server[generation.stream.key]


@dataclass
class _Key:
    """What the runner keeps for one key: its committed cells and timers."""

    cells: dict[str, Any] = field(default_factory=lambda: {"waiting": [], "inflight": []})
    poll_at: float | None = None
    drain_set: bool = False

    def load(self) -> KeyState:
        c = self.cells
        return key_state.load(waiting=c["waiting"], inflight=c["inflight"], progress=c.get("progress"),
                              seen=c.get("seen"), poll_at_ms=c.get("poll_at_ms"), wait_ms=c.get("wait_ms"))

    def commit(self, before: KeyState, after: KeyState) -> None:
        changed = key_state.changes(before, after)
        for name, change in changed.bags.items():
            self.cells[name] = list(change.entries) if change.rewrite else self.cells[name] + list(change.entries)
        for name, value in changed.values.items():
            self.cells[name] = value


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
    delivered: int = 0
    ended_before_drain: set[str] = field(default_factory=set)
    moves: int = 0
    expired: int = 0  # running streams cancelled because their lease ran out
    seconds: float = 0.0  # simulated time until every request ended (or the calm spell ran out)
    host_deaths: int = 0
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

    def now(self) -> float:
        return self.world.now

    def wait(self, seconds: float) -> None:
        self.world.tick(self.world.now + seconds)

    def hold_leases(self, seconds: float) -> None:
        self.world.engine_of(self.key).hold_leases(seconds)

    def count(self, counts: Mapping[str, int], logs: tuple[tuple[int, str], ...]) -> None:
        pass  # the simulator checks what ends, not the counters

    def emit(self, output: Output) -> None:
        self.outputs.append(output)

    def cancel(self, streams: tuple[str, ...]) -> None:
        self.world.engine_of(self.key).cancel(streams)

    def report(self, report: WaitingReport) -> None:
        if self.world.on_report is not None:
            self.world.on_report(self.key, report)

    def set_timer(self, at: float | None) -> None:
        self.timer.append(at)

    def poll(self, asked: Mapping[str, int]) -> tuple[Call, Mapping[str, list[Output]]]:
        outcome, answers = self.world.call(self.key, "poll", lambda engine: engine.poll(dict(asked)))
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
        self.keys = {key: _Key() for key in range(schedule.keys)}
        self.report = Report(schedule)
        self.bundles: list[tuple[float, int, tuple[InferenceRequest, ...]]] = []
        self.faulty = True
        # Told each key's report to the worker's admission ledger (tests/vm_sim.py runs the ledger around this).
        self.on_report: Callable[[int, WaitingReport], None] | None = None
        self._idle_run: Counter[int] = Counter()
        for i, at in enumerate(schedule.arrivals):
            request = InferenceRequest(id=f"r{i}", prompt=f"p{i}", max_tokens=schedule.tokens[i], prompt_tokens=1,
                                       received_at=at)
            self.bundles.append((at, i % schedule.keys, (request,)))
        self.published = {bundle[2][0].id: bundle for bundle in self.bundles}

    def chance(self, p: float) -> bool:
        return self.faulty and p > 0 and self.rng.random() < p

    def engine_of(self, key: int) -> SimEngine:
        return self.engines[self.owner[key]]

    def tick(self, to: float) -> None:
        self.now = max(self.now, to)
        for engine in self.engines.values():
            engine.advance(self.now)

    def call(self, key: int, kind: str, what: Callable[[SimEngine], Any]) -> tuple[Call, Any]:
        f = self.s.faults
        if self.chance(f.unreachable):
            return Call.UNREACHABLE, None
        if self.chance(f.engine_fails) or (self.faulty and kind == f.broken
                                           and f.broken_at <= self.now < f.broken_at + f.broken_s):
            return Call.FAILED, None
        return Call.ANSWERED, what(self.engine_of(key))

    def work_item(self, key: int, event: Event) -> bool:
        """One work item of ``key``; whether it committed."""
        self.report.work_items += 1
        record = self.keys[key]
        before = record.load()

        port = _SimWorkItem(self, key)
        after = drive(self.s.rules, before, event, port)
        if self.chance(self.s.faults.commit_fails):
            return False
        record.commit(before, after)
        if isinstance(event, PollDue):
            record.poll_at = None  # a timer that fires is cleared unless the callback sets it again
        if port.timer:
            record.poll_at = port.timer[-1]
        self._deliver(port.outputs)
        return True

    def _submit(self, key: int, submission: Submission) -> SubmitResult:
        outcome, streams = self.call(key, "submit", lambda engine: engine.submit(submission.requests,
                                                                                 submission.attempts, self.now))
        return SubmitResult(submission, outcome, tuple(streams) if outcome is Call.ANSWERED else ())

    def _deliver(self, outputs: list[Output]) -> None:
        r = self.report
        for kind, payload in outputs:
            record = json.loads(payload)
            if kind == CHUNK:
                index = (record["id"], record["attempt"], record["seq"])
                r.chunks[index] += 1
                r.chunk_text[index] = record["text"]
            elif kind == COMPLETION:
                r.ended[record["id"]] += 1
                r.completions[record["id"]] = record
                r.delivered += record["tokens"]
            else:
                assert kind == DEAD_LETTER, kind
                r.letters[record["id"]].append(record)
                if SHED in record["reason"]:  # not an end: the publisher republishes it, as the letter asks
                    r.shed[record["id"]] += 1
                    _, key, requests = self.published[record["id"]]
                    self.bundles.append((self.now + self.rng.uniform(0.05, 1.0), key, requests))
                else:
                    r.ended[record["id"]] += 1

    def due(self) -> list[tuple[str, int, Any]]:
        items: list[tuple[str, int, Any]] = [("bundle", key, b) for b in self.bundles if b[0] <= self.now
                                             for key in (b[1],)]
        items += [("poll", key, None) for key, k in self.keys.items()
                  if k.poll_at is not None and k.poll_at <= self.now]
        return items

    def next_time(self) -> float | None:
        times = [b[0] for b in self.bundles] + [k.poll_at for k in self.keys.values() if k.poll_at is not None]
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
        self.tick(self.now + self.rng.uniform(0.0005, 0.005))
        if self.chance(self.s.faults.key_moves) and self.s.workers > 1:
            moved = self.rng.randrange(self.s.keys)
            self.owner[moved] = self.rng.choice(sorted(self.engines))
            self.report.moves += 1
        if self.chance(self.s.faults.host_dies):
            dead = self.rng.choice(sorted(self.engines))
            self.report.generated += self.engines[dead].generated
            self.report.expired += self.engines[dead].expired
            self.engines[dead] = SimEngine(f"{dead}'", self.s)  # a new host: new stream keys, none of the old
            self.report.host_deaths += 1
        return True


def run(seed: int, *, faults: bool = True, spells: bool = True, max_items: int = 20_000) -> Report:
    """Plays the schedule of ``seed``: arrivals with faults, then a calm spell (faults off) until every key is idle
    or the clock passes 600 s, then a drain of every key. Deterministic in ``seed``."""
    return play(Schedule.draw(seed, faults=faults, spells=spells), max_items=max_items)


def play(schedule: Schedule, *, max_items: int = 20_000) -> Report:
    """Plays ``schedule`` as :func:`run` does (for a schedule changed from the drawn one)."""
    world = World(schedule)
    while world.step():
        if world.report.work_items > max_items:
            raise Violation(schedule.seed, f"more than {max_items} work items: a key polls without end")
        if world.now > 60 and world.faulty:
            world.faulty = False  # the calm spell: whatever the faults left must now finish
        if world.now > 600:
            break
    world.report.ended_before_drain = set(world.report.ended)
    world.report.seconds = world.now
    world.report.generated += sum(e.generated for e in world.engines.values())
    world.report.expired += sum(e.expired for e in world.engines.values())
    world.faulty = True
    for key, record in world.keys.items():
        if not record.drain_set:
            continue
        while not world.work_item(key, DrainDue(world.now)):
            pass  # a failed commit: the runner fires the drain timer again
        world.report.left_state[key] = {k: v for k, v in record.cells.items() if v}
    return world.report


def check(report: Report) -> None:
    """Raises :class:`Violation` unless every invariant holds for the played schedule."""
    s, seed = report.schedule, report.schedule.seed
    ids = {f"r{i}" for i in range(s.requests)}
    for request_id in sorted(ids):
        if report.ended[request_id] != 1:
            raise Violation(seed, f"request {request_id} ended {report.ended[request_id]} times")
    for request_id, completion in report.completions.items():
        attempt, n = completion["attempt"], completion["chunks"]
        seqs = [report.chunks[(request_id, attempt, q)] for q in range(n)]
        if seqs != [1] * n:
            raise Violation(seed, f"request {request_id} attempt {attempt}: chunks delivered {seqs}, not once each")
        text = "".join(report.chunk_text[(request_id, attempt, q)] for q in range(n))
        if text != completion["text"]:
            raise Violation(seed, f"request {request_id}: its chunks do not add up to its completion")
    for index, times in report.chunks.items():
        if times != 1:
            raise Violation(seed, f"chunk {index} delivered {times} times")
    for key, polls in report.idle_polls.items():
        if polls > IDLE_POLLS_MAX:
            raise Violation(seed, f"key {key} polled {polls} times in a row holding no request and changing nothing")
    if report.ended_before_drain != ids:
        raise Violation(seed, f"requests wedged until the drain: {sorted(ids - report.ended_before_drain)}")
    for key, cells in report.left_state.items():
        if cells:
            raise Violation(seed, f"key {key} holds state after its drain: {sorted(cells)}")
    if not s.faults.loses_streams and report.generated > 1.05 * report.delivered + 1:
        raise Violation(seed, f"{report.generated} tokens generated for {report.delivered} delivered, no stream "
                              "lost to a move or a host death")


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
