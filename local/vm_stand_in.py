"""A stand-in for a whole Dataflow worker VM: several real SDK processes, each with a bounded pool of harness
threads, sharing one engine host, reading a backlog whenever a thread is free.

:mod:`local.runner_semantics` stands in for the runner's commit rules around the generate step in the test's
own process. A worker VM is more than that, and this adds what it is made of:

* **Several SDK processes.** A Dataflow worker hands its work items to Apache Beam SDK processes, by default
  one per vCPU ("Troubleshoot Dataflow out of memory errors":
  https://cloud.google.com/dataflow/docs/guides/troubleshoot-oom; the job's SDK container image "recommends
  using more than one core per SDK container instance", ``SdkHarnessContainerImage`` in Dataflow's API). Each is
  a real process here (``multiprocessing``, spawned), running the real ``AdmitFn`` and ``StreamingGenerateFn``.
* **A bounded pool of harness threads in each.** A worker runs ``number_of_worker_harness_threads`` work items
  at once, read bundles and timer firings alike (Beam's pipeline options: "the number of threads per each
  worker harness process"; the runner hands it to the worker pool as ``numThreadsPerWorker``). Each process
  here runs at most ``threads`` work items at once, one DoFn instance per thread, as Beam keeps one per
  concurrently running bundle.
* **Reads whenever a thread is free.** Dataflow does not document how it schedules its readers' rounds against
  timers; the worst case, taken here, is that every thread with no due work item of a key runs a round of the
  job's reader fused with parsing and the admission step: the real ``PullWithinRoomFn.process`` on Beam's own
  restriction tracker, so the round takes what its process's real feed (:mod:`pipeline.flow.subscription_feed`)
  pulled from a real Pub/Sub (the emulator, or the tests' fault proxy in front of it: ``pubsub_host``) within
  the places it took in the worker's hold, and each message goes through the real steps fused after it: parsed
  (``ParseFn``) and measured (``MeasureFn``), each guarded at its element boundary (a message that is no request
  is a dead letter of the bundle), and admitted in its place by the real ``AdmitFn``; as Beam's SDK harness does
  after each call of a splittable DoFn, the round ends with ``check_done``, its residual and the size
  ``restriction_size`` reports for it. The job's readers are ``readers`` restrictions, each of which runs one
  round at a time and resumes its residual when the residual says, as the runner resumes a deferred reader; a
  round whose bundle committed has its finalizer run (the feed acknowledges), and what a dead process took comes
  back from Pub/Sub once its ack deadline (``READ_ACK_DEADLINE_S``) passes. Due timers queue first in, first out
  with the elements that arrive for keys, as a worker's work queue holds them.
* **One runtime per VM.** The steps reach the worker's runtime through Beam's ``MultiProcessShared``, which
  "will be instantiated once per VM and methods will be invoked on it via rpc" (its module's documentation): the
  first process to acquire it starts its host, a process of its own (``spawn_process``), and every process calls
  it through a proxy, exactly as the template's ``SharedRuntime`` does on a worker.
* **State lives in the service.** With Streaming Engine a key's state is kept by the service, not in the SDK
  process, and each work item commits whole (the rules and their sources: :mod:`local.runner_semantics`). So
  this stand-in keeps every key's committed state and ships each work item (the key's state with it) to the
  process that runs the key; a work item may fail to commit (then it runs again); a process that dies loses no
  committed state, and its keys' work items run in another process.
* **Processes pause and die; the job drains and is updated.** One process can be paused (``SIGSTOP``: a long
  GC, memory pressure) while the others run, so only its keys' timers are late; any can be killed
  (``SIGKILL``); the runtime's host can be paused or killed on its own; engine calls can be made to raise. A
  drain stops the reads and fires every key's drain timer, with many more keys than threads ("Drain a pipeline":
  https://cloud.google.com/dataflow/docs/guides/stopping-a-pipeline). An update replaces every process with a
  fresh one (and a fresh runtime) on the state the old ones left ("Update an existing pipeline":
  https://cloud.google.com/dataflow/docs/guides/updating-a-pipeline).

The admission step's requests go straight to the generate step's keys here (the batcher between them is
tested with the real DoFn in ``tests/test_worker_rig.py``; the reader under Beam's own portable runner, where
the runner resumes its residuals and calls its finalizers, in ``tests/test_subscription_reader.py``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import os
import random
import signal
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil
from apache_beam.io.restriction_trackers import OffsetRange
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.pvalue import TaggedOutput
from apache_beam.runners.sdf_utils import RestrictionTrackerView, ThreadsafeRestrictionTracker

from local.runner_semantics import Driver, KeyState, Outputs, Worker
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.parameters import default
from pipeline.contract.request_parsing import RequestLimits
from pipeline.flow import subscription_feed
from pipeline.flow.admission import AdmitFn
from pipeline.flow.subscription_reader import PullWithinRoomFn
from pipeline.generation.generate import StreamingGenerateFn
from pipeline.generation.generate_settings import GenerateSettings
from pipeline.intake.parsing import ParseFn
from pipeline.intake.prompt_length import MeasureFn, PromptLength
from pipeline.serving.vllm_server import is_healthy
from pipeline.worker.runtime import SharedRuntime, WorkerRuntime, new_runtime_tag
from pipeline.worker.runtime_settings import RuntimeSettings

START_TIMEOUT_S = 600.0  # the first process starts the runtime's host: with a managed vLLM, minutes on a CPU
LATE_ROUND_S = 1.0  # a round of the runner this long after the last is recorded (``VmStandIn.late_rounds``)
# Engine calls that a schedule may make raise (the generate step's calls into the runtime).
FAULTY_CALLS = ("poll", "submit_batch", "cancel")
# The ack deadline the readers' feeds give what they pull: Pub/Sub's least, so what a dead process took comes back
# within seconds (the job's is the reader's ACK_DEADLINE_S).
READ_ACK_DEADLINE_S = 10


class InjectedFault(RuntimeError):
    """An engine call made to raise by the schedule."""


class _FaultyRuntime:
    """The worker's runtime (a proxy in all but its host), whose engine calls raise at ``rate``."""

    def __init__(self, runtime: WorkerRuntime, rate: float, chance: random.Random) -> None:
        self._runtime, self._rate, self._chance = runtime, rate, chance

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._runtime, name)
        if name not in FAULTY_CALLS or not self._rate:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._chance.random() < self._rate:
                raise InjectedFault(f"{name} made to fail by the schedule")
            return attribute(*args, **kwargs)
        return call


class _FaultySource:
    """A runtime source whose engine calls raise at ``rate``; the runtime itself is the real shared one. One
    object per SDK process (unpickled there), whose draws every thread's DoFns share."""

    def __init__(self, inner: SharedRuntime, rate: float, seed: int) -> None:
        self.inner, self.rate = inner, rate
        self.settings, self.tag = inner.settings, inner.tag
        self._chance = random.Random(seed)

    def acquire(self, *, fresh: bool = False) -> Any:
        return _FaultyRuntime(self.inner.acquire(fresh=fresh), self.rate, self._chance)


class _Finalizer:
    """What a read bundle's ``BundleFinalizerParam`` is given: the callbacks, run once the bundle committed."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def register(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)


@dataclass(frozen=True)
class ReadRound:
    """What one read work item did: the requests it admitted, the dead letters its parse and measure steps made,
    the reader's residual (``None``: its restriction is done) with the size it reports for it and when the runner
    resumes it (seconds from now), and whether the worker was full. The finalizer's callbacks stay in the SDK
    process until the runner says the bundle committed."""

    passed: list[InferenceRequest]
    dead_letters: list[dict]
    residual: OffsetRange | None
    size: int
    again_s: float
    full: bool


def _read_round(reader: PullWithinRoomFn, fused: tuple[ParseFn, MeasureFn, AdmitFn], element: tuple[str, int],
                restriction: OffsetRange, tag: str) -> tuple[ReadRound, list[Callable[[], None]]]:
    """One work item of a reader fused with parsing, measuring and admission, as Beam's SDK harness runs a
    splittable DoFn (``DoFnInvoker.invoke_process`` in apache_beam/runners/common.py): the real ``process`` on
    Beam's restriction tracker over the reader's current restriction, its outputs through the real steps fused
    after it, then ``check_done``, the deferred residual and the size ``restriction_size`` reports for it (which
    Beam refuses when negative)."""
    parse, measure, admit = fused
    tracker = ThreadsafeRestrictionTracker(reader.create_tracker(restriction))
    finalizer = _Finalizer()
    for dofn in (reader, parse, measure, admit):
        dofn.start_bundle()
    passed: list[InferenceRequest] = []
    letters: list[dict] = []

    def through(dofn: Any, values: Any) -> list[Any]:
        kept: list[Any] = []
        for value in values:
            if isinstance(value, TaggedOutput):
                letters.append(value.value)
            else:
                kept.extend(dofn.process(value) if dofn is not None else [value])
        return kept

    for value in reader.process(element, finalizer, RestrictionTrackerView(tracker),
                                ManualWatermarkEstimator(None)):
        measured = through(None, through(measure, through(parse, [value.value])))
        passed.extend(through(None, through(admit, measured)))
    for dofn in (admit, measure, parse, reader):
        dofn.finish_bundle()
    tracker.check_done()
    deferred = tracker.deferred_status()
    residual, size = (deferred[0], reader.restriction_size(element, deferred[0])) if deferred else (None, 0)
    if size < 0:
        raise ValueError(f"Expected size >= 0 but received {size}.")  # as Beam's SDK refuses it
    feed = subscription_feed.existing_feed(element[0], tag, False)
    return ReadRound(passed, letters, residual, size, max(deferred[1].micros / 1e6, 0.0) if deferred else 0.0,
                     feed is not None and feed.full), finalizer.callbacks


def _serve(name: str, source: _FaultySource, threads: int, readers: int, poll_interval_ms: float,
           drain_timeout_s: float, pubsub_host: str | None, conn: Any) -> None:
    """An SDK process: runs the work items it is sent on ``threads`` harness threads, one DoFn each."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    if pubsub_host:
        os.environ["PUBSUB_EMULATOR_HOST"] = pubsub_host
    local = threading.local()
    send = threading.Lock()
    finalizers: dict[int, list[Callable[[], None]]] = {}  # by read work item, until the runner says it committed

    def dofns() -> tuple[Driver, tuple[ParseFn, MeasureFn, AdmitFn], PullWithinRoomFn]:
        if not hasattr(local, "driver"):
            generate = StreamingGenerateFn(source, poll_interval_ms, GenerateSettings(
                dedupe_window_s=600, drain_timeout_s=drain_timeout_s, engine=source.settings.engine.engine))
            generate.setup()
            length = PromptLength()
            local.fused = (ParseFn(RequestLimits(), default("id_attribute"), None),
                           MeasureFn(length.estimator, length.model, length.prompt_format, length.max_model_len,
                                     length.hf_token_secret), AdmitFn(source))
            local.reader = PullWithinRoomFn(source, ack_deadline_s=READ_ACK_DEADLINE_S, readers=readers)
            for dofn in (*local.fused, local.reader):
                dofn.setup()
            local.driver = Driver([Worker(name, generate, None)])
        return local.driver, local.fused, local.reader

    def work(token: int, kind: str, payload: Any) -> None:
        driver, fused, reader = dofns()
        try:
            if kind == "read":
                element, restriction = payload
                done, callbacks = _read_round(reader, fused, element, restriction, source.tag)
                if callbacks:
                    finalizers[token] = callbacks
                reply: tuple = (token, "done", done)
            else:
                key, method, element, timer, state = payload
                driver.state[key] = state
                outputs = driver.run(key, method, element, timer=timer)
                reply = (token, "done", (outputs, driver.state.pop(key)))
        except Exception as exc:  # the work item failed: the runner retries it
            logging.getLogger(name).exception("work item failed")
            reply = (token, "failed", repr(exc))
        with send:
            conn.send(reply)

    dofns()  # acquires the VM's runtime: the first process to do so starts its host
    conn.send(("ready", os.getpid()))
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{name}-harness")
    while True:
        message = conn.recv()
        if message[0] == "stop":
            pool.shutdown(wait=False, cancel_futures=True)
            return
        if message[0] == "finalize":  # its read bundle committed: Beam runs the finalizer on a harness thread
            for callback in finalizers.pop(message[1], []):
                pool.submit(callback)
            continue
        if message[0] == "stop feeds":  # a new schedule reads another subscription: what the old ones hold goes back
            for feed in subscription_feed.feeds_of(source.tag):
                threading.Thread(target=feed.stop, daemon=True).start()
            continue
        _, token, kind, payload = message
        pool.submit(work, token, kind, payload)


@dataclass
class SdkProcess:
    name: str
    process: Any
    conn: Any
    pid: int
    running: dict[int, tuple] = field(default_factory=dict)  # token -> the work item it runs
    paused: bool = False
    dead: bool = False


@dataclass
class Schedule:
    """What the runner does to the VM, drawn by a test: how often a work item of a key fails to commit, and how
    often an engine call raises (what Pub/Sub does wrong is the fault proxy's, in front of the emulator)."""

    commit_failure_rate: float = 0.0
    engine_failure_rate: float = 0.0
    seed: int = 0


@dataclass
class VmStandIn:
    """A worker VM of ``processes`` SDK processes of ``threads`` harness threads each; the first process starts
    the runtime's host. Use as a context manager; :meth:`reset` starts a new schedule on the same processes, reading
    ``subscription`` of ``topic`` (what :meth:`publish` publishes to) on the Pub/Sub at ``pubsub_host`` (the
    environment's ``PUBSUB_EMULATOR_HOST`` when None)."""

    settings: RuntimeSettings
    processes: int = 2
    threads: int = 2
    poll_interval_ms: float = 50.0
    drain_timeout_s: float = 20.0
    generate_keys: int = 4
    readers: int = 8  # the job's readers: restrictions, each resumed on its own residual
    schedule: Schedule = field(default_factory=Schedule)
    topic: str = ""
    subscription: str = ""
    pubsub_host: str | None = None
    tag: str = ""
    sdk: list[SdkProcess] = field(default_factory=list)
    state: dict[Any, KeyState] = field(default_factory=dict)
    owner: dict[Any, int] = field(default_factory=dict)
    committed: Outputs = field(default_factory=Outputs)
    published: set[str] = field(default_factory=set)  # ids published to the topic this schedule
    raw: set[str] = field(default_factory=set)  # messages published as they are (publish_raw), by their text
    queue: collections.deque = field(default_factory=collections.deque)  # work items of keys, first in first out
    taken: set[str] = field(default_factory=set)  # ids whose read bundle committed
    retried: int = 0  # work items that failed (a process died in them, or they raised) and ran again
    deferred: int = 0  # reads' rounds that took nothing while the worker was full
    rounds: collections.Counter = field(default_factory=collections.Counter)  # reads' rounds, by what they did
    failed_commits: int = 0
    holds: list[int] = field(default_factory=list)  # requests taken and not yet ended, at each round
    sizes: list[int] = field(default_factory=list)  # what each read's residual reported (restriction_size)
    timer_delays: list[float] = field(default_factory=list)  # from due to dispatched, undisturbed and reading
    work_items: list[tuple[float, Any, str]] = field(default_factory=list)  # (seconds it ran, key, method)
    # When each key's work items were sent, and the runner's own rounds that came late (when, seconds late),
    # on the monotonic clock: a key polls its streams only in a work item, so these say how long each went unpolled.
    sent_at: dict[Any, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    late_rounds: list[tuple[float, float]] = field(default_factory=list)
    reading: bool = True
    keep_reading: bool = False  # read on when nothing published is left unread: what Pub/Sub delivers again
    _readers_due: list[float] = field(default_factory=list)  # when each reader's next round may run (monotonic)
    _readers: list[OffsetRange] = field(default_factory=list)  # each reader's restriction: its last residual
    _publisher: Any = None
    _disrupted_at: float = 0.0  # the last resume, kill or update: only timers due after it are measured
    _began: dict[int, float] = field(default_factory=dict)  # token -> when its work item was sent
    _last_round: float = 0.0

    def __enter__(self) -> VmStandIn:
        self.tag = self.tag or new_runtime_tag(self.settings)
        self.sdk = [self._start(n) for n in range(self.processes)]
        self.reset(self.schedule)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_all()

    def reset(self, schedule: Schedule, topic: str = "", subscription: str = "") -> None:
        """A new schedule, on the same processes and runtime (dead ones started again), with no keys, reading
        ``subscription`` of ``topic``: the feeds of the last one stop, giving back what they hold."""
        for sdk in self.sdk:
            if not sdk.dead:
                sdk.conn.send(("stop feeds",))
        self.schedule, self.topic, self.subscription = schedule, topic, subscription
        self._chance = random.Random(schedule.seed)
        self._tokens = 0
        self.sdk = [self._start(n) if sdk.dead else sdk for n, sdk in enumerate(self.sdk)]
        self.state, self.owner, self.committed = {}, {}, Outputs()
        self.published, self.raw, self.queue, self.taken = set(), set(), collections.deque(), set()
        self.retried = self.deferred = self.failed_commits = 0
        self.rounds = collections.Counter()
        self.holds, self.timer_delays, self.reading, self.keep_reading = [], [], True, False
        self.work_items, self.sent_at, self.late_rounds = [], collections.defaultdict(list), []
        self._readers_due = [0.0] * self.readers
        self.sizes = []
        reader = PullWithinRoomFn(None, ack_deadline_s=READ_ACK_DEADLINE_S)  # type: ignore[arg-type]
        self._readers = [reader.initial_restriction((subscription, n)) for n in range(self.readers)]
        self._last_round = time.monotonic()

    @property
    def unread(self) -> set[str]:
        """What was published and no committed read bundle took: in Pub/Sub, or in a feed's hands (requests by
        id, messages published raw by their text until their dead letter commits)."""
        return (self.published - self.taken) | (self.raw - {d["payload"] for d in self.committed.dead_letters})

    # The runner's side ------------------------------------------------------------------------

    def publish(self, requests: list[InferenceRequest]) -> None:
        """Publishes the requests to the schedule's topic, as their publisher would."""
        if self._publisher is None:
            from google.cloud import pubsub_v1

            self._publisher = pubsub_v1.PublisherClient()
        for future in [self._publisher.publish(self.topic, request.to_payload().encode()) for request in requests]:
            future.result(timeout=30)
        self.published.update(request.id for request in requests)

    def publish_raw(self, data: bytes) -> None:
        """Publishes ``data`` as it is (a message no request parses from), as a faulty publisher would."""
        if self._publisher is None:
            from google.cloud import pubsub_v1

            self._publisher = pubsub_v1.PublisherClient()
        self._publisher.publish(self.topic, data).result(timeout=30)
        self.raw.add(data.decode())

    def assign(self, key: Any, process: int) -> None:
        """The key's work items run in SDK process ``process`` from now on (otherwise in any process with a free
        thread, as the runner hands them out)."""
        self.owner[key] = process

    def deliver(self, key: Any, requests: list) -> None:
        """Elements for the key (what a committed read bundle sent it), queued behind its other work items."""
        self.queue.append((key, "process", (key, list(requests)), None, time.time()))

    @property
    def ended(self) -> set[str]:
        return {c["id"] for c in self.committed.completions} | {d["id"] for d in self.committed.dead_letters}

    def busy(self) -> list[Any]:
        """Keys with requests, or a stream to release, and a poll timer set; keys with work items queued or
        running; and "read" while a read bundle runs."""
        keys = {key for key, state in self.state.items() if state.timers["poll"] is not None
                and (state.bags["inflight"] or state.bags["waiting"] or state.values["progress"])}
        reads = {"read" for sdk in self.sdk for item in sdk.running.values() if item[0] == "read"}
        return sorted(keys | {item[0] for item in self.queue} | self._running_keys() | reads, key=str)

    def step(self) -> bool:
        """One round of the runner: takes back what finished, queues due timers, gives every free thread of a
        running process a work item (a read bundle when no key's work item waits for it). Whether anything ran."""
        now = time.monotonic()
        if now - self._last_round > LATE_ROUND_S:
            self.late_rounds.append((now, now - self._last_round))
        self._last_round = now
        moved = self._collect()
        self._queue_due_timers()
        moved = self._dispatch() or moved
        self.holds.append(len(self.taken - self.ended))
        return moved

    def unpolled(self) -> dict[Any, tuple[float, float]]:
        """Per key, the longest time between two of its work items being sent (or since the last), and when that
        began (monotonic): what the lease saw of the key's polls. For a failure's message, with ``late_rounds``."""
        now, longest = time.monotonic(), {}
        for key, times in self.sent_at.items():
            spans = [(b - a, a) for a, b in zip(times, [*times[1:], now], strict=True)]
            longest[key] = max(spans)
        return longest

    def run_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.step():
                time.sleep(0.01)

    def run_until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Runs until ``condition()`` holds (checked every round); whether it did within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                return False
            if not self.step():
                time.sleep(0.01)
        return True

    def run_until_idle(self, timeout_s: float = 180.0) -> None:
        """Runs until what was published is read and no key holds anything (every timer committed)."""
        deadline = time.monotonic() + timeout_s
        while (self.reading and self.unread) or self.busy():
            if time.monotonic() > deadline:
                raise AssertionError(f"still busy after {timeout_s:g} s: {len(self.unread)} unread, "
                                     f"keys {self.busy()}")
            if not self.step():
                time.sleep(0.01)

    def drain(self, timeout_s: float = 180.0) -> None:
        """Stops reading and fires every key's drain timer, then runs until nothing is left."""
        self.reading = False
        for key, state in list(self.state.items()):
            if state.timers["drain"] is not None:
                self.queue.append((key, "on_drain", None, "drain", time.time()))
        self.run_until_idle(timeout_s)

    # What happens to processes ------------------------------------------------------------------

    def pause(self, process: int) -> None:
        os.kill(self.sdk[process].pid, signal.SIGSTOP)
        self.sdk[process].paused = True

    def resume(self, process: int) -> None:
        os.kill(self.sdk[process].pid, signal.SIGCONT)
        self.sdk[process].paused = False
        self._disrupted_at = time.time()

    def host_pid(self) -> int:
        """The runtime's host: the process listening at the address ``MultiProcessShared`` wrote for the tag (a
        file in the temporary directory), a child of the SDK process that acquired it first."""
        with open(os.path.join(tempfile.gettempdir(), self.tag) + ".address") as address:
            port = int(address.read().rsplit(":", 1)[1])
        for sdk in self.sdk:
            if sdk.dead:
                continue
            parent = psutil.Process(sdk.pid)
            for process in [parent, *parent.children(recursive=True)]:
                if any(connection.status == psutil.CONN_LISTEN and connection.laddr.port == port
                       for connection in process.net_connections(kind="tcp")):
                    return process.pid
        raise RuntimeError(f"no process of the VM listens at port {port}")

    def host_processes(self) -> set[int]:
        """The runtime hosts alive now: the processes the SDK processes spawned (one, unless a rebuild is under
        way), each found by how ``multiprocessing`` starts a spawned child."""
        found = set()
        for sdk in self.sdk:
            if sdk.dead:
                continue
            for child in psutil.Process(sdk.pid).children():
                try:
                    if any("spawn_main" in part for part in child.cmdline()):
                        found.add(child.pid)
                except psutil.Error:  # it ended meanwhile
                    continue
        return found

    def thread_counts(self) -> dict[int, int]:
        """How many threads each live SDK process runs now."""
        return {n: psutil.Process(sdk.pid).num_threads() for n, sdk in enumerate(self.sdk) if not sdk.dead}

    def server_url(self) -> str:
        """Where the managed vLLM of the runtime's host answers: the loopback port one of the host's descendants
        listens on whose ``/health`` answers."""
        for process in psutil.Process(self.host_pid()).children(recursive=True):
            try:
                ports = [c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
            except psutil.Error:
                continue
            for port in ports:
                if is_healthy(f"http://127.0.0.1:{port}"):
                    return f"http://127.0.0.1:{port}"
        raise RuntimeError("the runtime's host runs no vLLM server that answers")

    def host(self) -> int:
        """The SDK process the runtime's host belongs to (it dies with it)."""
        pid = self.host_pid()
        for n, sdk in enumerate(self.sdk):
            if not sdk.dead and sdk.pid in (pid, psutil.Process(pid).ppid()):
                return n
        raise RuntimeError(f"the runtime's host {pid} belongs to no live SDK process")

    def signal_host(self, signum: int) -> int:
        """Sends the runtime's host ``signum`` (SIGSTOP, SIGCONT, SIGKILL), not the SDK process it belongs to."""
        pid = self.host_pid()
        os.kill(pid, signum)
        if signum == signal.SIGKILL:
            self._disrupted_at = time.time()
        return pid

    def kill(self, process: int) -> None:
        sdk = self.sdk[process]
        if sdk.paused:
            self.resume(process)
        os.kill(sdk.pid, signal.SIGKILL)
        sdk.process.join(timeout=10)
        self._died(sdk)
        self._disrupted_at = time.time()

    def update(self) -> None:
        """A replacement job: every process (and so the runtime) replaced, on the state the old ones committed."""
        for n in range(len(self.sdk)):
            self.kill(n)
        self.tag = new_runtime_tag(self.settings)
        self.sdk = [self._start(n) for n in range(self.processes)]
        self._disrupted_at = time.time()

    # Inside -------------------------------------------------------------------------------------

    def _start(self, n: int) -> SdkProcess:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        name = f"sdk-{n}"
        source = _FaultySource(SharedRuntime(self.settings, self.tag), self.schedule.engine_failure_rate,
                               self.schedule.seed * 31 + n)
        # Not daemonic: an SDK process starts the runtime's host as a child of its own, as on a worker.
        process = context.Process(target=_serve, name=name, daemon=False, args=(
            name, source, self.threads, self.readers, self.poll_interval_ms, self.drain_timeout_s, self.pubsub_host,
            child))
        process.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not parent.poll(1.0):
            if not process.is_alive() or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"{name} did not start (exit code {process.exitcode}): see its log above")
        _, pid = parent.recv()
        return SdkProcess(name, process, parent, pid)

    def _stop_all(self) -> None:
        for sdk in self.sdk:
            if sdk.paused:
                os.kill(sdk.pid, signal.SIGCONT)
            if not sdk.dead:
                with contextlib.suppress(OSError):
                    sdk.conn.send(("stop",))
        for sdk in self.sdk:
            sdk.process.join(timeout=10)
            if sdk.process.is_alive():
                sdk.process.kill()
                sdk.process.join(timeout=5)

    def _died(self, sdk: SdkProcess) -> None:
        """Its work items failed: a key's runs again (elsewhere); what its reads and feeds took comes back from
        Pub/Sub once its ack deadline passes."""
        sdk.dead = True
        for token, item in sdk.running.items():
            self._began.pop(token, None)
            self._failed(item)
        sdk.running.clear()

    def _failed(self, item: tuple) -> None:
        self.retried += 1
        if item[0] != "read":  # a read's messages were never acknowledged: Pub/Sub delivers them again
            self.queue.appendleft(item)

    def _running_keys(self) -> set[Any]:
        return {item[0] for sdk in self.sdk for item in sdk.running.values() if item[0] != "read"}

    def _live(self) -> list[int]:
        return [n for n, sdk in enumerate(self.sdk) if not sdk.dead]

    def _runs_in(self, key: Any, n: int) -> bool:
        """Whether process ``n`` may run the key's next work item: any process may, unless the key was assigned
        to one (a key whose process died moves to a live one)."""
        if key not in self.owner:
            return True
        if self.sdk[self.owner[key]].dead:
            self.owner[key] = self._live()[0]
        return self.owner[key] == n

    def _collect(self) -> bool:
        moved = False
        for sdk in self.sdk:
            while not sdk.dead and not sdk.paused:
                try:
                    if not sdk.conn.poll(0):
                        break
                    token, status, result = sdk.conn.recv()
                except (EOFError, OSError):
                    self._died(sdk)
                    break
                moved = True
                item = sdk.running.pop(token)
                began = self._began.pop(token, None)
                if item[0] != "read" and began is not None:
                    self.work_items.append((time.monotonic() - began, item[0], item[1]))
                self._finished(sdk, token, item, status, result)
        return moved

    def _finished(self, sdk: SdkProcess, token: int, item: tuple, status: str, result: Any) -> None:
        if item[0] == "read":
            if status == "failed":
                self._failed(item)
                return
            done: ReadRound = result
            result = done.passed
            self.rounds["took" if done.passed or done.dead_letters else "full" if done.full else "nothing pulled"] += 1
            if not done.passed and not done.dead_letters:
                self.deferred += done.full
            self.sizes.append(done.size)
            self.committed.dead_letters += done.dead_letters  # the parse and measure steps' outputs commit with it
            if done.residual is None:  # a reader's restriction ends only with a job that bounds its rounds
                raise AssertionError(f"reader {item[1]}'s restriction ended: an unbounded reader defers, always")
            self._readers[item[1]] = done.residual
            self._readers_due[item[1]] = time.monotonic() + done.again_s
            try:
                sdk.conn.send(("finalize", token))  # committed: its finalizer acknowledges what it read
            except OSError:
                self._died(sdk)
            if result:
                self.taken.update(request.id for request in result)
                by_key: dict[int, list] = collections.defaultdict(list)
                for request in result:
                    by_key[zlib.crc32(request.id.encode()) % self.generate_keys].append(request)
                for key, requests in by_key.items():
                    self.deliver(f"shard-{key}", requests)
            return
        if status == "failed":
            self._failed(item)
            return
        if self._chance.random() < self.schedule.commit_failure_rate:
            self.failed_commits += 1
            self.queue.append(item)  # discarded; the runner retries the work item
            return
        outputs, state = result
        self.state[item[0]] = state
        self.committed.extend(outputs)

    def _queue_due_timers(self) -> None:
        now = time.time()
        waiting = {item[0] for item in self.queue} | self._running_keys()
        for key, state in list(self.state.items()):
            due = state.timers["poll"]
            if due is None or due > now or key in waiting:
                continue
            if not (state.bags["inflight"] or state.bags["waiting"] or state.values["progress"]):
                continue
            self.queue.append((key, "on_poll", None, "poll", due))

    def _dispatch(self) -> bool:
        moved = False
        running = self._running_keys()
        for n in self._live():
            sdk = self.sdk[n]
            while not sdk.paused and len(sdk.running) < self.threads:
                item = next((item for item in self.queue if item[0] not in running and self._runs_in(item[0], n)),
                            None)
                if item is not None:
                    self.queue.remove(item)
                    due = self.state.get(item[0], KeyState()).timers["poll"]
                    if item[3] == "poll" and (due is None or due > time.time()):
                        continue  # set again by a work item that ran before it: it fires when due
                    running.add(item[0])
                    if item[3] == "poll" and self.reading and item[4] > self._disrupted_at and \
                            not any(sdk.paused or sdk.dead for sdk in self.sdk):
                        self.timer_delays.append(max(time.time() - item[4], 0.0))
                    key, method, element, timer, _ = item
                    payload = (key, method, element, timer, self.state.setdefault(key, KeyState()))
                    sent = self._send(sdk, ("work", item), payload)
                elif self.reading and (self.unread or self.keep_reading) and \
                        (reader := self._due_reader()) is not None:
                    sent = self._send(sdk, ("read", reader), ((self.subscription, reader), self._readers[reader]))
                else:
                    break
                moved = True
                if not sent:
                    break
        return moved

    def _due_reader(self) -> int | None:
        """A reader whose round may run now: none of its rounds runs, and its residual is due."""
        running = {item[1] for sdk in self.sdk for item in sdk.running.values() if item[0] == "read"}
        now = time.monotonic()
        return next((n for n, due in enumerate(self._readers_due) if n not in running and due <= now), None)

    def _send(self, sdk: SdkProcess, item: tuple, payload: Any) -> bool:
        self._tokens += 1
        record = item[1] if item[0] == "work" else item
        sdk.running[self._tokens] = record
        self._began[self._tokens] = time.monotonic()
        if item[0] == "work":
            self.sent_at[record[0]].append(self._began[self._tokens])
        try:
            sdk.conn.send(("work", self._tokens, "read" if item[0] == "read" else "run", payload))
        except OSError:
            self._died(sdk)
            return False
        return True
