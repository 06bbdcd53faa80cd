"""Streaming generation as a Beam transform.

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

Each batch from the batcher is submitted as one unit (``submit_batch``): the
vLLM engine takes the requests it has room for, the transformers engine
(:mod:`pipeline.engines.transformers_engine`) generates the batch together or takes none of
it yet; what is not taken waits with its batch id, and is admitted batch by
batch.

Per shard, keyed state holds, each written only when it changes:

* ``waiting``: requests the engine had no room for, admitted in arrival order
  as streams finish. A key with only waiting requests backs off its polls (up
  to :data:`WAITING_POLL_CAP_S`).
* ``inflight``: requests the engine is streaming. A worker that dies
  mid-stream is recovered: the next poll finds no stream and sends the request
  again as a new ``attempt``.
* ``progress``: per stream, how many of its outputs were emitted. Written in
  the same commit as the outputs, it is what makes a poll safe to retry (see
  :mod:`pipeline.engines.engine`): the engine releases outputs only once a later poll
  shows this count past them.
* ``seen``: the ids of requests waiting, in flight, or finished within
  ``dedupe_window_s`` (:mod:`pipeline.generation.dedupe`).

Entries carry a version (:data:`STATE_VERSION`); one that cannot be decoded,
after an update changed the format, becomes a dead letter with its raw text and
the key goes on. A drain (the watermark timer at the window's end) gives
requests in flight ``drain_timeout_s`` to finish and turns the rest into dead
letters with stage ``drain`` that a redrive republishes (``ops/redrive.py``).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator, List, Tuple

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.coders import StrUtf8Coder, VarIntCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Timestamp

from pipeline.contract.element_guard import guarded_value
from pipeline.contract.keying import generate_key
from pipeline.contract.messages import PREPARED_ATTRIBUTE, STAGE_DRAIN, STAGE_INFERENCE, DeadLetter, InferenceRequest
from pipeline.contract.parameters import check_parameters, default
from pipeline.contract.state_format import StateFormatError, read_cell, write_cell
from pipeline.contract.stream_progress import (CHUNK, COMPLETION, DEAD_LETTER, MAX_LOST_STREAMS, KeyProgress, Output,
                                               RequestProgress, Step, advance)
from pipeline.engines.engine import EngineSettings
from pipeline.generation.dedupe import SeenIds
from pipeline.worker.load import LoadGauges
from pipeline.worker.runtime import (RuntimeSource, SharedRuntime, WorkerRuntime, client_id, new_runtime_tag,
                                     process_record, reconnect, start_heartbeat)

LOGGER = logging.getLogger(__name__)
# Bounds, in seconds, of the counters of answers whose first token took longer (``first_token_over_<b>s``).
# Cloud Monitoring charts Beam counters, not distributions' percentiles, so a percentile is read from them:
# the p95 of time to first token is over ``b`` exactly when more than 5 % of ``first_tokens`` are over ``b``.
FIRST_TOKEN_BOUNDS_S = (1, 2, 5, 10, 30)


def first_token_counter_name(bound_s: int) -> str:
    return f"first_token_over_{bound_s}s"


TAG_COMPLETIONS = "completions"
TAG_DEAD_LETTERS = "dead_letters"
DEFAULT_DEDUPE_WINDOW_S = float(default("dedupe_window_s"))
DEFAULT_DRAIN_TIMEOUT_S = float(default("drain_timeout_s"))
# A key whose requests only wait for room doubles its poll interval up to this.
WAITING_POLL_CAP_S = 2.0
# Version 1: today's entries without "v" (commit 41b0859); 2 adds "v" and moves progress to its own cell.
STATE_VERSION = 2
_ENTRY_FIELDS = {"request": (str,), "fp": (str,), "attempt": (int,), "key": (str, type(None)),
                 "deadline_at": (int, float, type(None))}
# What became of a call to the worker's runtime (StreamingGenerateFn._engine_call).
ANSWERED, UNREACHABLE, FAILED = "answered", "unreachable", "failed"
# How many keys' waiting reports a process remembers (ProcessRecord.reported_waiting) before it starts afresh.
_MAX_REPORTS_REMEMBERED = 100_000


def template_poll_interval_ms(chunk_interval_ms: float) -> float:
    """How often a key with requests in flight polls: half the chunk interval, within 10-100 ms."""
    return min(max(chunk_interval_ms / 2, 10.0), 100.0)


@dataclass(frozen=True)
class RequestEntry:
    """One request this key holds, waiting for room or in flight: an entry of the ``waiting`` or ``inflight`` bag."""

    request: str  # the request as JSON (InferenceRequest.to_json)
    fp: str  # its fingerprint: two requests that share an id are told apart by it
    attempt: int = 1  # the attempt its stream runs as (a lost stream is sent again as the next)
    key: str | None = None  # its stream at the engine; None while waiting, or lost while the engine was full
    deadline_at: float | None = None  # when its own deadline_ms passes (epoch seconds), if it has one
    batch: str | None = None  # the batcher's batch it came in: a static-batching engine takes a batch whole
    lost: int = 0  # how many of its streams were lost (bounded apart from attempts)

    @property
    def request_id(self) -> str:
        return InferenceRequest.from_json(self.request).id

    @property
    def progress(self) -> RequestProgress:
        return RequestProgress(self.key, 0, self.attempt, self.lost)

    def encode(self) -> str:
        return write_cell(asdict(self), STATE_VERSION)

    @classmethod
    def decode(cls, text: str) -> RequestEntry:
        """An entry, upgraded from any version this code knows; raises StateFormatError."""
        data = read_cell(text, (1, STATE_VERSION), _ENTRY_FIELDS)
        try:
            InferenceRequest.from_json(data["request"])
        except ValueError as exc:
            raise StateFormatError(f"its request does not decode: {exc}") from None
        lost = data.get("lost", 0)  # absent before streams lost were counted apart from attempts: none known
        if not isinstance(lost, int) or isinstance(lost, bool) or lost < 0:
            raise StateFormatError("field 'lost' of the wrong type")
        batch = data.get("batch")  # absent before batches were kept whole: each entry its own
        if batch is not None and not isinstance(batch, str):
            raise StateFormatError("field 'batch' of the wrong type")
        return cls(data["request"], data["fp"], data["attempt"], data["key"], data["deadline_at"], batch, lost)


def _positions(value: dict) -> dict[str, int]:
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value.values()):
        raise StateFormatError("a position is not a whole number")
    return {str(key): n for key, n in value.items()}


PROGRESS_VERSION = 1  # cells written before versions have none: the same fields


def read_progress(text: str | None) -> KeyProgress:
    """The key's progress cell; an unreadable one reads as empty: polled from their start, its streams are found
    released and sent again, so nothing is lost."""
    if not text:
        return KeyProgress()
    try:
        data = read_cell(text, (PROGRESS_VERSION,), {"taken": (dict,), "release": (dict,)})
        return KeyProgress(_positions(data["taken"]), _positions(data["release"]))
    except StateFormatError as exc:
        LOGGER.error("Unreadable progress state (%s); this key's streams will be sent again", exc)
        return KeyProgress()


def write_progress(state, before: KeyProgress, after: KeyProgress) -> None:
    """Writes the key's progress cell when it changed (cleared when empty)."""
    if after == before:
        return
    if after.taken or after.release:
        state.write(write_cell({"taken": dict(after.taken), "release": dict(after.release)}, PROGRESS_VERSION))
    else:
        state.clear()


@dataclass(frozen=True)
class _Polled:
    """What collecting a key's streams came to: what to emit, the requests still in flight, and the key's progress."""

    emit: list[Any]
    remaining: list[RequestEntry]
    progress: KeyProgress


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
                 dedupe_window_s: float = DEFAULT_DEDUPE_WINDOW_S,
                 drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        self._source = runtime
        self._poll_interval_s = poll_interval_ms / 1000.0
        self._dedupe_window_s = dedupe_window_s
        self._drain_timeout_s = drain_timeout_s
        self._gauges = LoadGauges("generate")
        self.requests_sent = Metrics.counter("streaming_generate", "requests_sent")
        self.requests_queued = Metrics.counter("streaming_generate", "requests_queued")
        self.requests_admitted = Metrics.counter("streaming_generate", "requests_admitted_from_queue")
        self.duplicates = Metrics.counter("streaming_generate", "duplicates_dropped")
        self.chunks_out = Metrics.counter("streaming_generate", "chunks")
        self.completions_out = Metrics.counter("streaming_generate", "completions")
        self.dead_letters_out = Metrics.counter("streaming_generate", "dead_letters")
        self.resubmitted = Metrics.counter("streaming_generate", "lost_streams_resubmitted")
        self.undecodable = Metrics.counter("streaming_generate", "undecodable_state_entries")
        self.engine_failures = Metrics.counter("streaming_generate", "engine_call_failures")
        self.unreachable = Metrics.counter("streaming_generate", "runtime_unreachable")
        self.drained = Metrics.counter("streaming_generate", "drain_dead_letters")
        self.ttft = Metrics.distribution("streaming_generate", "time_to_first_token_ms")
        self.first_tokens = Metrics.counter("streaming_generate", "first_tokens")
        self.first_token_over = [(1000 * bound, Metrics.counter("streaming_generate", first_token_counter_name(bound)))
                                 for bound in FIRST_TOKEN_BOUNDS_S]
        # The model's busy time as apportioned to what this step emits (answers and dead letters alike).
        self.accelerator_ms = Metrics.counter("streaming_generate", "accelerator_ms")
        # Structured answers (a response_format) without a valid output_json, and those of them cut at max_tokens.
        self.structured_invalid = Metrics.counter("streaming_generate", "structured_output_invalid")
        self.structured_cut = Metrics.counter("streaming_generate", "structured_output_cut_at_max_tokens")

    def setup(self) -> None:
        self._source.acquire()  # builds or joins the VM's runtime (a vLLM start, minutes): here, not in a timer
        self._record = process_record(self._source.tag)
        self._client = client_id()  # the streams it polls run on this process's lease clocks
        start_heartbeat(self._source)

    # Beam's callbacks: load the key's state, apply the transitions, commit -----------------

    def process(self, element: tuple[object, list[InferenceRequest]],
                window=beam.DoFn.WindowParam,
                waiting=beam.DoFn.StateParam(WAITING),
                inflight=beam.DoFn.StateParam(INFLIGHT),
                seen_state=beam.DoFn.StateParam(SEEN),
                poll=beam.DoFn.TimerParam(POLL),
                poll_at_ms=beam.DoFn.StateParam(POLL_AT_MS),
                wait_ms=beam.DoFn.StateParam(WAIT_MS),
                drain=beam.DoFn.TimerParam(DRAIN)) -> Iterator[Any]:
        shard, requests = element
        now = time.time()
        seen = SeenIds(seen_state)
        batch = uuid.uuid4().hex[:12]  # the batcher's batch stays one unit for an engine that generates it so
        accepted: list[RequestEntry] = []
        for request in requests:
            entry, failure = guarded_value(STAGE_INFERENCE, request, lambda: self._accept(request, seen, batch, now))
            if failure is not None:
                yield failure
            elif isinstance(entry, RequestEntry):
                accepted.append(entry)
            elif entry is not None:
                yield entry  # its dead letter: another request holds the id
        already = sum(1 for _ in waiting.read())
        sent, left = ([], accepted) if already else self._send(accepted)  # once one waits, the rest queue behind it
        cap = waiting_cap(self._source.settings)
        left, over = left[:max(cap - already, 0)], left[max(cap - already, 0):]
        for entry in over:  # admission holds a worker far below this; a key past it sheds, never grows unbounded
            seen.release(entry.request_id, entry.fp, now + self._dedupe_window_s)
            yield self._dead_letter(entry.request, f"the generate step's queue for its key is full ({cap} requests "
                                                   "wait): the workers take more than they can hold; republish it")
        for entry in sent:
            inflight.add(entry.encode())
        for entry in left:
            waiting.add(entry.encode())
            self.requests_queued.inc()
        self._report_waiting(shard, already + len(left), arrived=[r.id for r in requests])
        seen.save(now)
        if accepted and wait_ms.read() is not None:
            wait_ms.clear()  # new work: poll at the chunk cadence again
        self._arm(poll, poll_at_ms, now + self._poll_interval_s)
        drain.set(window.max_timestamp())

    @on_timer(POLL)
    def on_poll(self, waiting=beam.DoFn.StateParam(WAITING), inflight=beam.DoFn.StateParam(INFLIGHT),
                progress_state=beam.DoFn.StateParam(PROGRESS), seen_state=beam.DoFn.StateParam(SEEN),
                poll=beam.DoFn.TimerParam(POLL), poll_at_ms=beam.DoFn.StateParam(POLL_AT_MS),
                wait_ms=beam.DoFn.StateParam(WAIT_MS), key=beam.DoFn.KeyParam) -> Iterator[Any]:
        poll_at_ms.clear()
        seen = SeenIds(seen_state)
        before = read_progress(progress_state.read())
        broken, stored = self._decoded(inflight)
        entries = self._unique(stored)
        polled = self._collect(entries, before, seen)
        yield from broken
        yield from polled.emit
        if polled.remaining != stored or broken:
            self._rewrite(inflight, polled.remaining)
        broken_waiting, stored = self._decoded(waiting)
        yield from broken_waiting
        emitted, sent, left = self._admit(self._unique(stored, besides=entries), seen)
        yield from emitted
        for entry in sent:
            inflight.add(entry.encode())
        if sent or left != stored or broken_waiting:
            self._rewrite(waiting, left)
        now = time.time()
        if broken or broken_waiting:  # their ids are held open with no entry left to end them
            seen.release_orphans({e.fp for e in polled.remaining + left + sent}, now + self._dedupe_window_s)
        self._report_waiting(key, len(left))
        self._gauges.update(self._source, self._record)
        write_progress(progress_state, before, polled.progress)
        seen.save(now, prune=not (polled.remaining or sent or left))
        self._schedule(poll, poll_at_ms, wait_ms, seen, now,
                       busy=bool(polled.remaining or sent or polled.progress.release), waiting=bool(left))

    @on_timer(DRAIN)
    def on_drain(self, waiting=beam.DoFn.StateParam(WAITING), inflight=beam.DoFn.StateParam(INFLIGHT),
                 progress_state=beam.DoFn.StateParam(PROGRESS), seen_state=beam.DoFn.StateParam(SEEN),
                 wait_ms=beam.DoFn.StateParam(WAIT_MS), poll=beam.DoFn.TimerParam(POLL),
                 poll_at_ms=beam.DoFn.StateParam(POLL_AT_MS), key=beam.DoFn.KeyParam) -> Iterator[Any]:
        """The window is closing (on the global window: the job drains).

        Dataflow fires this watermark timer once the drain moves the watermark to
        infinity; processing-time timers set after it may not fire before the job
        stops, so the wait for requests in flight happens here, bounded by
        ``drain_timeout_s``. What waits is not started: it becomes a ``drain``
        dead letter at once, to be redriven into the next job.
        """
        deadline = time.time() + self._drain_timeout_s
        # Keys drain one work item at a time, each polling only its own streams: the others' must not lapse.
        self._engine_call("hold leases", lambda runtime: runtime.hold_leases(self._drain_timeout_s))
        seen = SeenIds(seen_state)
        letters, stored = self._decoded(inflight)
        yield from letters
        entries = self._unique(stored)
        letters, waiting_entries = self._decoded(waiting)
        yield from letters
        for entry in self._unique(waiting_entries, besides=entries):
            yield self._drain_letter(entry, "the job drained before the request was sent to the model server")
        self._report_waiting(key, 0)
        # Polled from the committed positions, pass after pass, and nothing released: if this work item's
        # commit fails, its retry finds every stream where the last commit left it and collects it again.
        progress = read_progress(progress_state.read())
        committed = dict(progress.taken)
        while entries:
            polled = self._collect(entries, progress, seen, committed=committed)
            yield from polled.emit
            entries, progress = polled.remaining, polled.progress
            if not entries or time.time() >= deadline:
                break
            time.sleep(min(self._poll_interval_s, max(deadline - time.time(), 0.0)))
        # Unfinished within the timeout: stopped at the server now. Finished ones stay until the engine's
        # own expiry (request_timeout_s), for a retry of this work item to collect.
        self._engine_call("cancel", lambda runtime: runtime.cancel([e.key for e in entries if e.key is not None]))
        for entry in entries:
            yield self._drain_letter(entry, f"the job drained and the request did not finish within "
                                            f"drain_timeout_s={self._drain_timeout_s:g}")
        for state in (waiting, inflight, progress_state, seen_state, wait_ms, poll_at_ms):
            state.clear()
        poll.clear()

    # Transitions ------------------------------------------------------------------------------

    def _accept(self, request: InferenceRequest, seen: SeenIds, batch: str,
                now: float) -> RequestEntry | pvalue.TaggedOutput | None:
        """A new request's entry; None for a copy of one held (dropped), a dead letter for another request that
        shares its id."""
        fingerprint = request.fingerprint()
        holder = seen.holder(request.id, now)
        if holder == fingerprint:
            self.duplicates.inc()
            LOGGER.info("Request %s: a copy is in flight or finished within dedupe_window_s; dropped", request.id)
            return None
        if holder is not None:
            return self._dead_letter(request.to_json(), "another request with this id is in flight or finished "
                                     f"within dedupe_window_s={self._dedupe_window_s:g}; give each request its own id")
        seen.hold(request.id, fingerprint)
        deadline_at = None if request.deadline_ms is None else request.received_at + request.deadline_ms / 1000
        return RequestEntry(request.to_json(), fingerprint, deadline_at=deadline_at, batch=batch)

    def _send(self, entries: list[RequestEntry]) -> tuple[list[RequestEntry], list[RequestEntry]]:
        """Submits entries as one batch: (those the engine took, a prefix, with their streams; those left to wait).

        When the engine failed, each left counts it as a lost stream (so failures are bounded as moves are).
        """
        if not entries:
            return [], []
        keys = self._submit([e.request for e in entries], [e.attempt for e in entries])
        if keys is None:
            return [], [replace(entry, lost=entry.lost + 1) for entry in entries]
        sent = [replace(entry, key=key) for entry, key in itertools.takewhile(lambda pair: pair[1] is not None,
                                                                               zip(entries, keys))]
        self.requests_sent.inc(len(sent))
        return sent, entries[len(sent):]

    def _admit(self, entries: list[RequestEntry],
               seen: SeenIds) -> tuple[list[Any], list[RequestEntry], list[RequestEntry]]:
        """Waiting requests sent batch by batch while the engine has room: (dead letters of those whose deadline
        passed or that the engine failed too often, those sent, those still waiting).

        Offered even when the engine is full: a retried firing whose first try sent some of them finds the engine
        full of exactly those, and submitting again is what joins them (their keys come back, not None).
        """
        now, live, letters = time.time(), [], []
        for entry in entries:
            if entry.deadline_at is not None and now > entry.deadline_at:
                request = InferenceRequest.from_json(entry.request)
                letters.append(self._dead_letter(entry.request, f"its deadline_ms={request.deadline_ms} passed "
                                                                "while it waited for the model server (backlog)"))
                seen.release(request.id, entry.fp, now + self._dedupe_window_s)
            else:
                live.append(entry)
        sent: list[RequestEntry] = []
        groups = [list(group) for _, group in itertools.groupby(live, key=lambda e: e.batch)]
        for n, group in enumerate(groups):
            taken, left = self._send(group)
            sent += taken
            self.requests_admitted.inc(len(taken))
            if left:
                waiting = [e for rest in groups[n + 1:] for e in rest]
                for entry in reversed(left):
                    if entry.lost < MAX_LOST_STREAMS:
                        waiting.insert(0, entry)
                        continue
                    letters.append(self._dead_letter(entry.request, f"the engine failed each of the "
                                                                    f"{entry.lost} times it was sent"))
                    seen.release(entry.request_id, entry.fp, now + self._dedupe_window_s)
                return letters, sent, waiting
        return letters, sent, []

    def _collect(self, entries: list[RequestEntry], progress: KeyProgress, seen: SeenIds,
                 committed: dict[str, int] | None = None) -> _Polled:
        """Polls the engine for the key's streams and advances each request (:func:`~pipeline.contract.
        stream_progress.advance`).

        The engine is asked for each stream's outputs from its committed position, so a retried firing (whose
        state writes were discarded) gets the same outputs again; finished streams are released on the next
        firing. ``committed`` (a drain, which polls many times in one work item): the positions the last commit
        wrote; the engine is asked from them, so it releases nothing this work item emitted, and a stream lost
        meanwhile becomes a drain dead letter, for the next job.
        """
        if not entries and not progress.release:
            return _Polled([], [], progress)  # timers can fire twice for one setting
        draining = committed is not None
        asked = progress.asks([e.key for e in entries if e.key is not None], committed)
        answers = self._poll(asked, [e.key for e in entries if e.key is not None])
        emit, remaining, settled = [], [], []
        for entry in entries:
            current = replace(entry.progress, position=progress.position(entry.key))
            answer = answers.get(entry.key, []) if entry.key is not None else None
            after, step = advance(current, answer, asked.get(entry.key, 0), draining=draining)
            request = InferenceRequest.from_json(entry.request)
            outcome, failure = guarded_value(STAGE_INFERENCE, request,
                                             lambda: self._apply(entry, after, step, draining))
            if failure is not None:
                emit.append(failure)
                outcome = ([], None, after)
            outputs, still, final = outcome
            emit += outputs
            if still is None:
                seen.release(request.id, entry.fp, time.time() + self._dedupe_window_s)
            else:
                remaining.append(still)
            settled.append((final, still is None))
        return _Polled(emit, remaining, progress.settled(settled, draining=draining))

    def _apply(self, entry: RequestEntry, after: RequestProgress, step: Step,
               draining: bool) -> tuple[list[Any], RequestEntry | None, RequestProgress]:
        """Carries out one request's step: its outputs as Beam emits them, its entry now (None: it ended), and its
        progress as the key records it."""
        outputs = [self._output(output) for output in step.emit]
        if step.give_up:
            if draining:
                return outputs + [self._drain_letter(entry, "its stream was lost while the job drained")], None, after
            return outputs + [self._dead_letter(entry.request, f"its stream was lost {entry.lost} times (its key "
                                                "moved away, or its worker was lost, each time)")], None, after
        if step.ended:
            return outputs, None, after
        if step.resend is not None:
            keys = self._submit([entry.request], [step.resend.attempt])
            if keys is None:  # the engine failed: that counts as a lost stream too, so failures are bounded
                after = step.resend
            elif keys[0] is not None:
                self.resubmitted.inc()
                LOGGER.warning("Stream %s was lost; sent again as %s", entry.key, keys[0])
                after = replace(step.resend, stream=keys[0])
        return outputs, replace(entry, key=after.stream, attempt=after.attempt, lost=after.lost), after

    def _output(self, output: Output) -> Any:
        """One of the engine's outputs as the step emits it, counted."""
        kind, payload = output
        if kind == CHUNK:
            self.chunks_out.inc()
            return json.loads(payload)
        record = json.loads(payload)
        self.accelerator_ms.inc(round(1000 * (record.get("accelerator_seconds") or 0.0)))
        if kind == DEAD_LETTER:
            self.dead_letters_out.inc()
            return pvalue.TaggedOutput(TAG_DEAD_LETTERS, record)
        assert kind == COMPLETION, kind
        self.completions_out.inc()
        if record["time_to_first_token_ms"] is not None:
            self._count_first_token(int(record["time_to_first_token_ms"]))
        if record["output_error"] is not None:
            self.structured_invalid.inc()
            if record["finish_reason"] == "length":
                self.structured_cut.inc()
        return pvalue.TaggedOutput(TAG_COMPLETIONS, record)

    # State and the runtime ------------------------------------------------------------------

    def _decoded(self, bag) -> tuple[list[pvalue.TaggedOutput], list[RequestEntry]]:
        """The bag's entries, and a dead letter (with its raw text) for each that cannot be decoded; the caller
        rewrites the bag when there are any."""
        letters, entries = [], []
        for text in bag.read():
            try:
                entries.append(RequestEntry.decode(text))
            except StateFormatError as exc:
                self.undecodable.inc()
                self.dead_letters_out.inc()
                LOGGER.error("A state entry of this key cannot be decoded (%s); it goes to the dead letters", exc)
                letters.append(pvalue.TaggedOutput(TAG_DEAD_LETTERS, DeadLetter(
                    STAGE_INFERENCE, f"state entry could not be decoded after an update: {exc}", text,
                    at=time.time()).to_record()))
        return letters, entries

    def _unique(self, entries: list[RequestEntry], besides: list[RequestEntry] = ()) -> list[RequestEntry]:
        """The entries less copies of a request held already (here or in ``besides``): a copy gets in only when the
        record of ids was lost (an unreadable cell), and two entries of one request would share its stream and
        emit its completion twice."""
        held, unique = {e.fp for e in besides}, []
        for entry in entries:
            if entry.fp in held:
                self.duplicates.inc()
                LOGGER.warning("A second entry of one request in this key's state (its record of ids was lost); "
                               "dropped")
                continue
            held.add(entry.fp)
            unique.append(entry)
        return unique

    @staticmethod
    def _rewrite(bag, entries: list[RequestEntry]) -> None:
        bag.clear()
        for entry in entries:
            bag.add(entry.encode())

    def _schedule(self, poll, poll_at_ms, wait_ms, seen: SeenIds, now: float, *, busy: bool, waiting: bool) -> None:
        """The next poll: at the chunk cadence while anything streams; backing off while requests only wait
        (nothing here can change until another key's stream ends); to forget ids once nothing else is left."""
        backoff_ms = wait_ms.read()
        if busy:
            if backoff_ms is not None:
                wait_ms.clear()
            self._arm(poll, poll_at_ms, now + self._poll_interval_s)
        elif waiting:
            backoff = min(max(2 * (backoff_ms or 0), int(self._poll_interval_s * 1000)), int(WAITING_POLL_CAP_S * 1000))
            if backoff != backoff_ms:
                wait_ms.write(backoff)
            self._arm(poll, poll_at_ms, now + backoff / 1000)
        elif (next_expiry := seen.next_expiry()) is not None:
            self._arm(poll, poll_at_ms, next_expiry + 1.0)

    def _arm(self, poll, poll_at_ms, at: float) -> None:
        """Sets the poll timer for ``at`` unless it is already set to fire sooner."""
        armed = poll_at_ms.read()
        if armed is not None and armed / 1000.0 <= at:
            return
        poll.set(Timestamp(at))
        poll_at_ms.write(int(at * 1000))

    def _count_first_token(self, ttft_ms: int) -> None:
        self.ttft.update(ttft_ms)
        self.first_tokens.inc()
        for bound_ms, counter in self.first_token_over:
            if ttft_ms > bound_ms:
                counter.inc()

    def _engine_call(self, what: str, call: Callable[[WorkerRuntime], Any]) -> tuple[str, Any]:
        """``(ANSWERED, call(runtime))``; ``(UNREACHABLE, None)`` when the runtime's host process is gone (it is
        acquired anew in the background, :func:`~pipeline.worker.runtime.reconnect`: no timer waits for a rebuild,
        and a transient error with the host alive costs nothing); ``(FAILED, None)`` when the engine raised.

        Dataflow retries a timer callback that raised for ever, which would wedge its key: so no call to the
        runtime raises out of this step. Failures are logged and counted (``engine_call_failures``,
        ``runtime_unreachable``).
        """
        try:
            return ANSWERED, call(self._source.acquire())
        except (ConnectionError, EOFError) as exc:
            self.unreachable.inc()
            if reconnect(self._source):
                LOGGER.warning("The worker's runtime is unreachable (%s); acquiring it anew in the background", exc)
            return UNREACHABLE, None
        except Exception:
            LOGGER.exception("The worker's engine failed to %s", what)
            self.engine_failures.inc()
            return FAILED, None

    def _poll(self, asked: dict[str, int], streams: list[str]) -> dict[str, list[Output] | None]:
        """The engine's answers. While the runtime is unreachable, none: the streams are asked for again once it
        is back (a new host no longer knows them, and they are sent again then, once). When the engine failed,
        every stream is lost: sent again, within the request's bound on lost streams."""
        if not asked:
            return {}
        status, answers = self._engine_call("poll", lambda runtime: runtime.poll(asked, self._client))
        if status == FAILED:
            return {stream: None for stream in streams}
        return answers if status == ANSWERED else {}

    def _submit(self, request_jsons: list[str], attempts: list[int]) -> list[str | None] | None:
        """The engine's keys for new streams, None for each it has no room for (all, while the runtime is
        unreachable: they wait); None when the engine failed."""
        status, keys = self._engine_call(
            "submit", lambda runtime: runtime.submit_batch(request_jsons, attempts, self._client))
        if status == FAILED:
            return None
        return keys if status == ANSWERED else [None] * len(request_jsons)

    def _report_waiting(self, key: object, count: int, arrived: list[str] | None = None) -> None:
        """Tells the worker's admission ledger how many requests this key holds waiting, and which requests
        reached it (admission counts the first, and stops counting the second as on their way).

        A count is sent when it changes or its last report is a second old (reports lapse after
        ``WAITING_REPORT_LAPSE_S``, :mod:`pipeline.worker.admission_ledger`); arrivals always.
        """
        holder, now = repr(key), time.monotonic()
        reported = self._record.reported_waiting  # per process, not per instance: an instance may be per bundle
        last = reported.get(holder)
        if not arrived and last is not None and last[0] == count and now - last[1] < 1.0:
            return
        try:
            self._source.acquire().report_waiting(holder, count, arrived or [])
        except Exception:  # advisory: the next poll reconnects; the report lapses meanwhile (an arrival after transit)
            return
        with self._record.lock:
            if len(reported) > _MAX_REPORTS_REMEMBERED:
                reported.clear()  # only costs a repeated report per key
            reported[holder] = (count, now)

    def _drain_letter(self, entry: RequestEntry, reason: str) -> pvalue.TaggedOutput:
        self.drained.inc()
        return self._dead_letter(entry.request, reason + "; republish it with the redrive command", stage=STAGE_DRAIN)

    def _dead_letter(self, request_json: str, reason: str, stage: str = STAGE_INFERENCE) -> pvalue.TaggedOutput:
        self.dead_letters_out.inc()
        request = InferenceRequest.from_json(request_json)
        if stage == STAGE_DRAIN:  # republishable as it is: already prepared, so parsing applies no defaults again
            letter = DeadLetter(stage, reason, request.to_payload(), id=request.id,
                                attributes={PREPARED_ATTRIBUTE: "1"}, at=time.time())
        else:
            letter = DeadLetter(stage, reason, request_json, id=request.id, at=time.time())
        return pvalue.TaggedOutput(TAG_DEAD_LETTERS, letter.to_record())


def waiting_cap(settings: EngineSettings) -> int:
    """The most requests one key of the generate step keeps waiting: twice its worker's bound. Admission keeps a
    worker's whole hold within the bound (plus a stated slack), so only keys spread very unevenly reach it."""
    return 2 * settings.max_held


def _by_generate_key(batch: tuple[object, list[InferenceRequest]],
                     generate_shards: int) -> Iterator[tuple[int, list[InferenceRequest]]]:
    groups: dict[int, list[InferenceRequest]] = {}
    for request in batch[1]:
        groups.setdefault(generate_key(request.id, generate_shards), []).append(request)
    yield from groups.items()


class KeyByGenerateShard(beam.PTransform):
    """Batches in, re-keyed by each request's generate shard (:func:`~pipeline.contract.keying.generate_key`):
    the keys that decide which worker's engine serves a request. Every copy of an id lands on one key."""

    def __init__(self, generate_shards: int) -> None:
        super().__init__()
        check_parameters({"generate_shards": generate_shards})
        self._generate_shards = generate_shards

    def expand(self, batches):
        return batches | beam.FlatMap(_by_generate_key, self._generate_shards).with_output_types(
            Tuple[int, List[InferenceRequest]])


class StreamingGenerate(beam.PTransform):
    """Batches of requests in, streamed chunks out.

    Input: ``(shard_key, [InferenceRequest, ...])``; with ``generate_shards``
    each request is first re-keyed by :func:`~pipeline.contract.keying.generate_key`
    (see :mod:`pipeline.contract.keying` for why). Outputs (a tuple of
    PCollections of JSON-ready dicts): ``chunks`` (main; empty when the engine
    publishes them to a ``chunk_topic`` and ``chunks_to_pipeline`` is off),
    ``completions`` and ``dead_letters``; see :mod:`pipeline.contract.messages` for their fields.

    Example::

        results = batches | StreamingGenerate(EngineSettings(server=None, server_url="http://vllm:8000"))
        results.chunks | ...
    """

    def __init__(self, settings: EngineSettings, *, poll_interval_ms: float | None = None,
                 runtime: SharedRuntime | None = None, dedupe_window_s: float = DEFAULT_DEDUPE_WINDOW_S,
                 generate_shards: int | None = None, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__()
        check_parameters({"drain_timeout_s": drain_timeout_s, "dedupe_window_s": dedupe_window_s})
        if generate_shards is not None and settings.engine == "transformers":
            raise ValueError("engine 'transformers' generates each batch as it came from the batcher, on its "
                             "batcher key: it takes no generate_shards")
        self._dedupe_window_s = dedupe_window_s
        self._drain_timeout_s = drain_timeout_s
        self._generate_shards = generate_shards
        self._poll_interval_ms = (template_poll_interval_ms(settings.chunk_policy.interval_ms)
                                  if poll_interval_ms is None else poll_interval_ms)
        # One runtime per worker for this pipeline (its admission step shares it).
        self._runtime = runtime or SharedRuntime(settings, new_runtime_tag(settings))

    def expand(self, batches):
        if self._generate_shards is not None:
            # Re-keyed by the id's generate shard: these keys decide which worker's GPU serves a request.
            batches = batches | "KeyByGenerateShard" >> KeyByGenerateShard(self._generate_shards)
        results = batches | "Generate" >> beam.ParDo(
            StreamingGenerateFn(self._runtime, self._poll_interval_ms, self._dedupe_window_s, self._drain_timeout_s)
        ).with_outputs(TAG_COMPLETIONS, TAG_DEAD_LETTERS, main="chunks")
        return results

