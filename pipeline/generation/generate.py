"""Streaming generation as a Beam transform: the generate step's DoFn, a thin shell around the key machine.

:class:`StreamingGenerate` takes batches of requests keyed by shard and emits
chunks as they arrive. Outputs of a DoFn are committed when its bundle ends,
so a DoFn that yielded chunks from inside ``process`` would release them only
once its longest request finished. Instead, ``process`` hands the requests to
the worker's engine (:mod:`pipeline.worker.runtime`) and returns; a
processing-time timer then polls the engine and emits whatever has arrived,
each firing its own small bundle. With ``EngineSettings.chunk_topic`` the
engine publishes chunks itself as they are cut (no Beam hop between a token
and its consumer), and the poll carries completions, dead letters and lost
streams; the template runs this way.

Every rule for a key (dedupe, waiting for room, deadlines, lost streams,
backoff, drain) is the key machine's (:mod:`pipeline.generation.key_machine`);
its state and cells are :mod:`pipeline.generation.key_state`. Each callback
here loads the key's cells, steps the machine until it asks the engine
nothing more (the calls go through :class:`~pipeline.worker.runtime_client.
RuntimeClient`), carries out its effects, and writes the cells it changed, as
Beam's ``AsyncWrapper`` reconciles one key's state around asynchronous work.
A drain (the watermark timer at the window's end) gives requests in flight
``drain_timeout_s`` to finish in that one work item, and turns the rest into
dead letters with stage ``drain`` that a redrive republishes
(``ops/redrive.py``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.coders import StrUtf8Coder, VarIntCoder
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Timestamp

from pipeline.contract.call_outcome import Call
from pipeline.contract.keying import generate_key
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import Output
from pipeline.engines.engine_settings import EngineSettings
from pipeline.generation import key_state
from pipeline.generation.generate_settings import GenerateSettings
from pipeline.generation.key_driver import drive
from pipeline.generation.key_events import (
    Arrived,
    DrainDue,
    Event,
    PollDue,
    Report,
    Rules,
    Submission,
    SubmitResult,
    bulk_poll_interval_s,
)
from pipeline.generation.key_state import KeyState
from pipeline.generation.step_outputs import TAG_COMPLETIONS, TAG_DEAD_LETTERS, StepOutputs
from pipeline.worker.load import LoadGauges
from pipeline.worker.runtime import RuntimeSource, SharedRuntime, new_runtime_tag, process_record
from pipeline.worker.runtime_client import RuntimeClient, start_heartbeat
from pipeline.worker.runtime_settings import RuntimeSettings


def template_poll_interval_ms(chunk_interval_ms: float) -> float:
    """How often a key with requests in flight polls: half the chunk interval, within 10-100 ms (a key whose only
    requests are bulk ones, running or waiting, polls at :func:`~.key_events.bulk_poll_interval_s`:
    ``key_machine._poll_in``)."""
    return min(max(chunk_interval_ms / 2, 10.0), 100.0)


@dataclass(frozen=True)
class _Cells:
    """One key's state cells and poll timer, as a callback gets them from Beam."""

    waiting: Any
    inflight: Any
    progress: Any
    seen: Any
    poll_at_ms: Any
    wait_ms: Any
    poll: Any

    def load(self) -> KeyState:
        return key_state.read_cells(self)

    def commit(self, before: KeyState, after: KeyState) -> None:
        key_state.write_cells(self, before, after)

    def timer(self, at: float | None) -> None:
        if at is None:
            self.poll.clear()
        else:
            self.poll.set(Timestamp(at))


@dataclass
class _WorkItem:
    """One callback's port for the key driver (:class:`~pipeline.generation.key_driver.KeyPort`): the worker's
    runtime through its client, the key's poll timer, and the outputs the callback yields once the machine is
    done (committed with its state)."""

    client: RuntimeClient
    outputs: StepOutputs
    cells: _Cells
    key: object
    emitted: list[Any] = field(default_factory=list)

    def now(self) -> float:
        return time.time()

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def hold_leases(self, seconds: float) -> None:
        self.client.hold_leases(seconds)

    def count(self, counts: Mapping[str, int], logs: tuple[tuple[int, str], ...]) -> None:
        self.outputs.count(counts, logs)

    def emit(self, output: Output) -> None:
        self.emitted.append(self.outputs.emit(output))

    def cancel(self, streams: tuple[str, ...]) -> None:
        self.client.cancel(streams)

    def report(self, report: Report) -> None:
        self.client.report_waiting(repr(self.key), report.waiting, report.arrived)

    def set_timer(self, at: float | None) -> None:
        self.cells.timer(at)

    def poll(self, asked: Mapping[str, int]) -> tuple[Call, Mapping[str, list[Output]]]:
        return self.client.poll(dict(asked))

    def submit(self, submission: Submission) -> SubmitResult:
        outcome, streams = self.client.submit(submission.requests, submission.attempts)
        return SubmitResult.of(submission, outcome, streams)


class StreamingGenerateFn(beam.DoFn):
    """The generate step's DoFn (see the module docstring); ``runtime`` says how it reaches its worker's runtime."""

    WAITING = BagStateSpec("waiting", StrUtf8Coder())
    INFLIGHT = BagStateSpec("inflight", StrUtf8Coder())
    PROGRESS = ReadModifyWriteStateSpec("progress", StrUtf8Coder())
    SEEN = ReadModifyWriteStateSpec("seen", StrUtf8Coder())
    POLL = TimerSpec("poll", TimeDomain.REAL_TIME)
    POLL_AT_MS = ReadModifyWriteStateSpec("poll_at_ms", VarIntCoder())
    WAIT_MS = ReadModifyWriteStateSpec("wait_ms", VarIntCoder())  # backoff of a key whose requests only wait
    DRAIN = TimerSpec("drain", TimeDomain.WATERMARK)

    def __init__(self, runtime: RuntimeSource, poll_interval_ms: float,
                 generate: GenerateSettings = GenerateSettings()) -> None:
        self._source = runtime
        self._rules = Rules(poll_interval_ms / 1000.0, generate.dedupe_window_s, generate.drain_timeout_s,
                            waiting_cap(runtime.settings),
                            bulk_poll_interval_s=bulk_poll_interval_s(runtime.settings.engine.stream_lease_s))
        self._gauges = LoadGauges("generate")
        self._outputs = StepOutputs()

    def setup(self) -> None:
        self._source.acquire()  # builds or joins the VM's runtime (a vLLM start, minutes): here, not in a timer
        self._record = process_record(self._source.tag)
        self._client = RuntimeClient(self._source, "streaming_generate")
        start_heartbeat(self._source)

    def process(self, element: tuple[object, list[InferenceRequest]], window: Any = beam.DoFn.WindowParam,
                waiting: Any = beam.DoFn.StateParam(WAITING), inflight: Any = beam.DoFn.StateParam(INFLIGHT),
                progress_state: Any = beam.DoFn.StateParam(PROGRESS), seen_state: Any = beam.DoFn.StateParam(SEEN),
                poll: Any = beam.DoFn.TimerParam(POLL), poll_at_ms: Any = beam.DoFn.StateParam(POLL_AT_MS),
                wait_ms: Any = beam.DoFn.StateParam(WAIT_MS),
                drain: Any = beam.DoFn.TimerParam(DRAIN)) -> Iterator[Any]:
        shard, requests = element
        cells = _Cells(waiting, inflight, progress_state, seen_state, poll_at_ms, wait_ms, poll)
        batch = uuid.uuid4().hex[:12]  # the batcher's batch stays one unit for an engine that generates it so
        yield from self._run(cells, shard, Arrived(time.time(), tuple(requests), batch))
        drain.set(window.max_timestamp())

    @on_timer(POLL)
    def on_poll(self, waiting: Any = beam.DoFn.StateParam(WAITING), inflight: Any = beam.DoFn.StateParam(INFLIGHT),
                progress_state: Any = beam.DoFn.StateParam(PROGRESS), seen_state: Any = beam.DoFn.StateParam(SEEN),
                poll: Any = beam.DoFn.TimerParam(POLL), poll_at_ms: Any = beam.DoFn.StateParam(POLL_AT_MS),
                wait_ms: Any = beam.DoFn.StateParam(WAIT_MS), key: Any = beam.DoFn.KeyParam) -> Iterator[Any]:
        cells = _Cells(waiting, inflight, progress_state, seen_state, poll_at_ms, wait_ms, poll)
        yield from self._run(cells, key, PollDue(time.time()))
        self._gauges.update(self._client, self._record)

    @on_timer(DRAIN)
    def on_drain(self, waiting: Any = beam.DoFn.StateParam(WAITING), inflight: Any = beam.DoFn.StateParam(INFLIGHT),
                 progress_state: Any = beam.DoFn.StateParam(PROGRESS), seen_state: Any = beam.DoFn.StateParam(SEEN),
                 wait_ms: Any = beam.DoFn.StateParam(WAIT_MS), poll: Any = beam.DoFn.TimerParam(POLL),
                 poll_at_ms: Any = beam.DoFn.StateParam(POLL_AT_MS), key: Any = beam.DoFn.KeyParam) -> Iterator[Any]:
        """The window is closing (on the global window: the job drains). Dataflow fires this watermark timer once
        the drain moves the watermark to infinity; processing-time timers set after it may not fire before the
        job stops, so the wait for requests in flight happens here (the key machine's drain)."""
        cells = _Cells(waiting, inflight, progress_state, seen_state, poll_at_ms, wait_ms, poll)
        yield from self._run(cells, key, DrainDue(time.time()))

    def _run(self, cells: _Cells, key: object, event: Event) -> Iterator[Any]:
        """Steps the key's machine from its committed state until it asks the engine nothing more, carrying out
        each step's effects (:func:`~pipeline.generation.key_driver.drive`); then commits what changed."""
        before = cells.load()
        work_item = _WorkItem(self._client, self._outputs, cells, key)
        after = drive(self._rules, before, event, work_item)
        yield from work_item.emitted
        cells.commit(before, after)


def waiting_cap(settings: RuntimeSettings) -> int:
    """The most requests one key of the generate step keeps waiting: twice its worker's bound. Admission keeps a
    worker's whole hold within the bound (plus a stated slack), so only keys spread very unevenly reach it."""
    return 2 * settings.max_held


def _by_generate_key(batch: tuple[object, list[InferenceRequest]],
                     generate_shards: int) -> Iterator[tuple[int, list[InferenceRequest]]]:
    groups: dict[int, list[InferenceRequest]] = {}
    for request in batch[1]:
        groups.setdefault(generate_key(request.id, generate_shards), []).append(request)
    yield from groups.items()


class KeyByGenerateShard(beam.PTransform[Any, Any]):
    """Batches in, re-keyed by each request's generate shard (:func:`~pipeline.contract.keying.generate_key`):
    the keys that decide which worker's engine serves a request. Every copy of an id lands on one key."""

    def __init__(self, generate_shards: int) -> None:
        super().__init__()
        self._generate_shards = generate_shards  # checked by the GenerateSettings it comes from

    def expand(self, batches: Any) -> Any:
        return batches | beam.FlatMap(_by_generate_key, self._generate_shards).with_output_types(
            tuple[int, list[InferenceRequest]])


class StreamingGenerate(beam.PTransform[Any, Any]):
    """Batches of requests in, streamed chunks out.

    Input: ``(shard_key, [InferenceRequest, ...])``; with ``generate.generate_shards``
    each request is first re-keyed by :func:`~pipeline.contract.keying.generate_key`
    (see :mod:`pipeline.contract.keying` for why). Outputs (a tuple of
    PCollections of JSON-ready dicts): ``chunks`` (main; empty when the engine
    publishes them to a ``chunk_topic`` and ``chunks_to_pipeline`` is off),
    ``completions`` and ``dead_letters``; see :mod:`pipeline.contract.messages` for their fields.

    Example::

        results = batches | StreamingGenerate(EngineSettings(server=None, server_url="http://vllm:8000"),
                                              GenerateSettings(generate_shards=64))
        results.chunks | ...

    ``settings``: the engine's alone (admission's and the runtime calls' take their defaults), or the whole
    runtime's (:class:`~pipeline.worker.runtime_settings.RuntimeSettings`); ``generate``: the step's own
    (its defaults, for the same engine, when None).
    """

    def __init__(self, settings: EngineSettings | RuntimeSettings, generate: GenerateSettings | None = None, *,
                 poll_interval_ms: float | None = None, runtime: SharedRuntime | None = None) -> None:
        super().__init__()
        if isinstance(settings, EngineSettings):
            settings = RuntimeSettings(settings)
        generate = generate or GenerateSettings(engine=settings.engine.engine)
        if generate.engine != settings.engine.engine:
            raise ValueError(f"the generate step's settings are for engine {generate.engine!r}, its runtime's for "
                             f"{settings.engine.engine!r}: build both for one engine")
        self._generate = generate
        self._poll_interval_ms = (template_poll_interval_ms(settings.engine.chunk_policy.interval_ms)
                                  if poll_interval_ms is None else poll_interval_ms)
        # One runtime per worker for this pipeline (its admission step shares it).
        self._runtime = runtime or SharedRuntime(settings, new_runtime_tag(settings))

    def expand(self, batches: Any) -> Any:
        if self._generate.generate_shards is not None:
            # Re-keyed by the id's generate shard: these keys decide which worker's GPU serves a request.
            batches = batches | "KeyByGenerateShard" >> KeyByGenerateShard(self._generate.generate_shards)
        results = batches | "Generate" >> beam.ParDo(
            StreamingGenerateFn(self._runtime, self._poll_interval_ms, self._generate)
        ).with_outputs(TAG_COMPLETIONS, TAG_DEAD_LETTERS, main="chunks")
        return results

