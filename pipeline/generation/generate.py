"""Streaming generation as a Beam transform.

:class:`StreamingGenerate` takes batches of requests keyed by shard and emits
chunks as they arrive. Outputs of a DoFn are committed when its bundle ends,
so a DoFn that yielded chunks from inside ``process`` would release them only
once its longest request finished. Instead, ``process`` hands the requests to
the worker's engine (:mod:`pipeline.engines.engine_host`) and returns; a
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
from typing import Any, Iterator, Tuple

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.coders import StrUtf8Coder, VarIntCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Timestamp

from pipeline.contract.element_guard import guarded, guarded_value
from pipeline.contract.keying import generate_key
from pipeline.contract.messages import PREPARED_ATTRIBUTE, STAGE_DRAIN, STAGE_INFERENCE, DeadLetter, InferenceRequest
from pipeline.contract.parameters import default
from pipeline.contract.state_format import StateFormatError, read_cell, write_cell
from pipeline.engines.engine import ATTEMPT, CHUNK, COMPLETION, DEAD_LETTER, UNKNOWN, EngineBase, EngineSettings
from pipeline.engines.engine_host import acquire_engine, new_engine_tag
from pipeline.engines.stream_progress import Attempts, KeyProgress
from pipeline.engines.worker_load import LoadGauges
from pipeline.generation.dedupe import SeenIds

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


# (engine tag, key) -> (waiting count last reported to the engine, when): see _report_waiting.
_REPORTED: dict[tuple[str, str], tuple[int, float]] = {}
_MAX_REPORTS_REMEMBERED = 100_000


def template_poll_interval_ms(chunk_interval_ms: float) -> float:
    """How often a key with requests in flight polls: half the chunk interval, within 10-100 ms."""
    return min(max(chunk_interval_ms / 2, 10.0), 100.0)


def encode_entry(entry: dict) -> str:
    return write_cell(entry, STATE_VERSION)


def decode_entry(text: str) -> dict:
    """A waiting or in-flight entry, upgraded from any version this code knows; raises StateFormatError."""
    data = read_cell(text, (1, STATE_VERSION), _ENTRY_FIELDS)
    try:
        InferenceRequest.from_json(data["request"])
    except ValueError as exc:
        raise StateFormatError(f"its request does not decode: {exc}") from None
    lost = data.get("lost", 0)  # absent before streams lost were counted apart from attempts: none known
    if not isinstance(lost, int) or isinstance(lost, bool) or lost < 0:
        raise StateFormatError("field 'lost' of the wrong type")
    return {"request": data["request"], "fp": data["fp"], "attempt": data["attempt"], "key": data["key"],
            "deadline_at": data["deadline_at"], "batch": data.get("batch"), "lost": lost}


class _Progress:
    """The key's stream progress (:class:`~pipeline.engines.stream_progress.KeyProgress`) in its state cell."""

    VERSION = 1  # cells written before versions have none: the same fields

    def __init__(self, state) -> None:
        self._state = state
        text = state.read()
        self.streams = KeyProgress()
        if text:
            try:
                data = read_cell(text, (self.VERSION,), {"taken": (dict,), "release": (dict,)})
                self.streams = KeyProgress(_positions(data["taken"]), _positions(data["release"]))
            except StateFormatError as exc:
                # Polled from their start, the streams are found released and sent again: nothing is lost.
                LOGGER.error("Unreadable progress state (%s); this key's streams will be sent again", exc)
        self._before = self._cells()

    def _cells(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.streams.taken), dict(self.streams.release)

    def save(self) -> None:
        cells = self._cells()
        if cells == self._before:
            return
        taken, release = cells
        if taken or release:
            self._state.write(write_cell({"taken": taken, "release": release}, self.VERSION))
        else:
            self._state.clear()
        self._before = cells


def _positions(value: dict) -> dict[str, int]:
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value.values()):
        raise StateFormatError("a position is not a whole number")
    return {str(key): n for key, n in value.items()}


class _StreamingGenerateFn(beam.DoFn):
    WAITING = BagStateSpec("waiting", StrUtf8Coder())
    INFLIGHT = BagStateSpec("inflight", StrUtf8Coder())
    PROGRESS = ReadModifyWriteStateSpec("progress", StrUtf8Coder())
    SEEN = ReadModifyWriteStateSpec("seen", StrUtf8Coder())
    POLL = TimerSpec("poll", TimeDomain.REAL_TIME)
    POLL_AT_MS = ReadModifyWriteStateSpec("poll_at_ms", VarIntCoder())
    WAIT_MS = ReadModifyWriteStateSpec("wait_ms", VarIntCoder())  # backoff of a key whose requests only wait
    DRAIN = TimerSpec("drain", TimeDomain.WATERMARK)

    def __init__(self, settings: EngineSettings, shared_tag: str, poll_interval_ms: float,
                 dedupe_window_s: float, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        self._settings = settings
        self._shared_tag = shared_tag
        self._poll_interval_s = poll_interval_ms / 1000.0
        self._dedupe_window_s = dedupe_window_s
        self._drain_timeout_s = drain_timeout_s
        self._engine: EngineBase | None = None
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
        self._engine = acquire_engine(self._settings, self._shared_tag)

    def _count_first_token(self, ttft_ms: int) -> None:
        self.ttft.update(ttft_ms)
        self.first_tokens.inc()
        for bound_ms, counter in self.first_token_over:
            if ttft_ms > bound_ms:
                counter.inc()

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
        accepted: list[dict] = []
        for request in requests:
            yield from guarded(STAGE_INFERENCE, request, lambda: self._accept(request, seen, batch, accepted, now))
        already = sum(1 for _ in waiting.read())
        sent = 0 if already else self._send(accepted, inflight)  # once one waits, the rest queue behind it
        for entry in accepted[sent:]:
            waiting.add(encode_entry(entry))
            self.requests_queued.inc()
        self._report_waiting(shard, already + len(accepted) - sent, arrived=[r.id for r in requests])
        seen.save(now)
        if accepted and wait_ms.read() is not None:
            wait_ms.clear()  # new work: poll at the chunk cadence again
        self._arm(poll, poll_at_ms, now + self._poll_interval_s)
        drain.set(window.max_timestamp())

    def _accept(self, request: InferenceRequest, seen: SeenIds, batch: str, accepted: list[dict],
                now: float) -> Iterator[Any]:
        """De-duplicates a request by id and, if it is new, adds its state entry to ``accepted``."""
        fingerprint = request.fingerprint()
        holder = seen.holder(request.id, now)
        if holder == fingerprint:
            self.duplicates.inc()
            LOGGER.info("Request %s: a copy is in flight or finished within dedupe_window_s; dropped", request.id)
            return
        if holder is not None:
            yield self._dead_letter(request.to_json(), "another request with this id is in flight or finished "
                                    f"within dedupe_window_s={self._dedupe_window_s:g}; give each request its own id")
            return
        deadline_at = None if request.deadline_ms is None else request.received_at + request.deadline_ms / 1000
        accepted.append({"request": request.to_json(), "fp": fingerprint, "attempt": 1, "key": None,
                         "deadline_at": deadline_at, "batch": batch})
        seen.hold(request.id, fingerprint)

    def _send(self, entries: list[dict], inflight) -> int:
        """Submits entries as one batch; those the engine took go in flight. Returns how many (a prefix)."""
        if not entries:
            return 0
        keys = self._submit([e["request"] for e in entries], [e["attempt"] for e in entries])
        sent = 0
        for entry, key in zip(entries, keys):
            if key is None:
                break
            entry["key"] = key
            inflight.add(encode_entry(entry))
            sent += 1
        self.requests_sent.inc(sent)
        return sent

    @on_timer(POLL)
    def on_poll(self, waiting=beam.DoFn.StateParam(WAITING), inflight=beam.DoFn.StateParam(INFLIGHT),
                progress_state=beam.DoFn.StateParam(PROGRESS), seen_state=beam.DoFn.StateParam(SEEN),
                poll=beam.DoFn.TimerParam(POLL), poll_at_ms=beam.DoFn.StateParam(POLL_AT_MS),
                wait_ms=beam.DoFn.StateParam(WAIT_MS), key=beam.DoFn.KeyParam) -> Iterator[Any]:
        poll_at_ms.clear()
        seen = SeenIds(seen_state)
        progress = _Progress(progress_state)
        streaming = yield from self._collect(inflight, progress, seen)
        sent, left = yield from self._admit(waiting, inflight, seen)
        self._report_waiting(key, left)
        self._gauges.update(self._engine)
        progress.save()
        now = time.time()
        seen.save(now, prune=not (streaming or sent or left))
        backoff_ms = wait_ms.read()
        if streaming or sent or progress.streams.release:
            if backoff_ms is not None:
                wait_ms.clear()
            self._arm(poll, poll_at_ms, now + self._poll_interval_s)
        elif left:  # only waiting: nothing here can change until another key's stream ends
            backoff = min(max(2 * (backoff_ms or 0), int(self._poll_interval_s * 1000)), int(WAITING_POLL_CAP_S * 1000))
            if backoff != backoff_ms:
                wait_ms.write(backoff)
            self._arm(poll, poll_at_ms, now + backoff / 1000)
        elif (next_expiry := seen.next_expiry()) is not None:
            self._arm(poll, poll_at_ms, next_expiry + 1.0)  # to forget the ids whose window has passed

    def _arm(self, poll, poll_at_ms, at: float) -> None:
        """Sets the poll timer for ``at`` unless it is already set to fire sooner."""
        armed = poll_at_ms.read()
        if armed is not None and armed / 1000.0 <= at:
            return
        poll.set(Timestamp(at))
        poll_at_ms.write(int(at * 1000))

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
        seen = SeenIds(seen_state)
        entries = yield from self._decoded(waiting)
        for entry in entries:
            yield self._drain_letter(entry, "the job drained before the request was sent to the model server")
        waiting.clear()
        self._report_waiting(key, 0)
        progress = _Progress(progress_state)
        # Polled from the committed positions, pass after pass, and nothing released: if this work item's
        # commit fails, its retry finds every stream where the last commit left it and collects it again.
        committed = dict(progress.streams.taken)
        while (yield from self._collect(inflight, progress, seen, committed=committed)) and time.time() < deadline:
            time.sleep(min(self._poll_interval_s, max(deadline - time.time(), 0.0)))
        entries = yield from self._decoded(inflight)
        # Unfinished within the timeout: stopped at the server now. Finished ones stay until the engine's
        # own expiry (request_timeout_s), for a retry of this work item to collect.
        self._engine.cancel([e["key"] for e in entries if e["key"] is not None])
        for entry in entries:
            yield self._drain_letter(entry, f"the job drained and the request did not finish within "
                                            f"drain_timeout_s={self._drain_timeout_s:g}")
        for state in (inflight, progress_state, seen_state, wait_ms, poll_at_ms):
            state.clear()
        poll.clear()

    def _report_waiting(self, key: object, count: int, arrived: list[str] | None = None) -> None:
        """Tells the worker's engine how many requests this key holds waiting, and which requests reached it
        (admission counts the first, and stops counting the second as on their way).

        A count is sent when it changes or its last report is a second old (reports lapse after
        ``WAITING_REPORT_LAPSE_S``); arrivals always. What was reported is remembered per process, not per
        DoFn instance: a runner may build a new instance per bundle, which must still clear an old report.
        """
        holder, now = repr(key), time.monotonic()
        last = _REPORTED.get((self._shared_tag, holder))
        if not arrived and last is not None and last[0] == count and now - last[1] < 1.0:
            return
        try:
            self._engine.report_waiting(holder, count, arrived or [])
        except (ConnectionError, EOFError):
            return  # the next poll reconnects; the report lapses meanwhile (and an arrival after transit)
        if len(_REPORTED) > _MAX_REPORTS_REMEMBERED:
            _REPORTED.clear()  # only costs a repeated report per key
        _REPORTED[(self._shared_tag, holder)] = (count, now)

    def _drain_letter(self, entry: dict, reason: str) -> pvalue.TaggedOutput:
        self.drained.inc()
        return self._dead_letter(entry["request"], reason + "; republish it with the redrive command",
                                 stage=STAGE_DRAIN)

    def _submit(self, request_jsons: list[str], attempts: list[int]) -> list[str | None]:
        """The engine's keys for new streams; None for each it has no room for (or when it must be reconnected)."""
        try:
            return self._engine.submit_batch(request_jsons, attempts)
        except (ConnectionError, EOFError) as exc:
            LOGGER.warning("The worker's engine is unreachable (%s); reconnecting", exc)
            self._engine = acquire_engine(self._settings, self._shared_tag, fresh=True)
            return [None] * len(request_jsons)

    def _decoded(self, bag, texts: list[str] | None = None) -> Iterator[Any]:
        """The bag's entries; one that cannot be decoded is a dead letter with its raw text (the bag is rewritten).

        ``texts``: the bag's contents when the caller has already read them. Returns the
        entries, as a generator's return value, after yielding the dead letters.
        """
        entries, broken = [], False
        for text in bag.read() if texts is None else texts:
            try:
                entries.append(decode_entry(text))
            except StateFormatError as exc:
                broken = True
                self.undecodable.inc()
                self.dead_letters_out.inc()
                LOGGER.error("A state entry of this key cannot be decoded (%s); it goes to the dead letters", exc)
                yield pvalue.TaggedOutput(TAG_DEAD_LETTERS, DeadLetter(
                    STAGE_INFERENCE, f"state entry could not be decoded after an update: {exc}", text,
                    at=time.time()).to_record())
        if broken:
            bag.clear()
            for entry in entries:
                bag.add(encode_entry(entry))
        return entries

    def _admit(self, waiting, inflight, seen: SeenIds) -> Iterator[Any]:
        """Sends waiting requests, batch by batch, while the engine has room; returns (sent, still waiting)."""
        texts = list(waiting.read())  # one read of the bag per firing
        if not texts:
            return 0, 0
        # Offered even when the engine is full: a retried firing whose first try sent some of them finds the engine
        # full of exactly those, and submitting again is what joins them (their keys come back, not None).
        entries = yield from self._decoded(waiting, texts)
        now, live, expired = time.time(), [], False
        for entry in entries:
            if entry["deadline_at"] is not None and now > entry["deadline_at"]:
                request = InferenceRequest.from_json(entry["request"])
                yield self._dead_letter(entry["request"], f"its deadline_ms={request.deadline_ms} passed while "
                                                          "it waited for the model server (backlog)")
                seen.release(request.id, entry["fp"], now + self._dedupe_window_s)
                expired = True
            else:
                live.append(entry)
        taken = 0
        while taken < len(live):
            batch = live[taken].get("batch")
            group = list(itertools.takewhile(lambda e: e.get("batch") == batch, live[taken:]))
            sent = self._send(group, inflight)
            taken += sent
            self.requests_admitted.inc(sent)
            if sent < len(group):
                break
        if taken or expired:
            waiting.clear()
            for entry in live[taken:]:
                waiting.add(encode_entry(entry))
        return taken, len(live) - taken

    def _collect(self, inflight, progress: _Progress, seen: SeenIds,
                 committed: dict[str, int] | None = None) -> Iterator[Any]:
        """Emits what the engine has for each in-flight request; returns how many remain.

        The engine is asked for each stream's outputs from its committed
        position on (:mod:`pipeline.engines.stream_progress`), so a retried
        firing (whose state writes were discarded) gets the same outputs again;
        finished streams are released on the next firing. The bag is rewritten
        only when an entry changed (finished, resent).

        ``committed`` (a drain, which polls many times in one work item): the
        positions the last commit wrote. The engine is asked from them, so it
        releases nothing this work item emitted; what was emitted by an earlier
        pass is skipped. A stream lost meanwhile is not sent again: it becomes a
        drain dead letter, for the next job.
        """
        entries = yield from self._decoded(inflight)
        streams = progress.streams
        if not entries and not streams.release:
            return 0  # timers can fire twice for one setting
        keys = [e["key"] for e in entries if e["key"] is not None]
        asked = streams.ask(keys, committed)
        try:
            ready = self._engine.poll(asked) if asked else {}
        except (ConnectionError, EOFError) as exc:
            # The SDK process hosting the shared engine died: its streams are gone with it.
            LOGGER.warning("The worker's engine is unreachable (%s); reconnecting and resending", exc)
            self._engine = acquire_engine(self._settings, self._shared_tag, fresh=True)
            ready = {key: [(UNKNOWN, "")] for key in keys}
        remaining, changed = [], False
        for entry in entries:
            key, attempt = entry["key"], entry["attempt"]
            items = ready.get(key, [])
            if not (items and items[0][0] == UNKNOWN):
                items = streams.unseen(key, items)
            if not items and key is not None:
                remaining.append(entry)  # nothing new for this request
                streams.emitted(key, 0, ended=False)
                continue
            step, failure = guarded_value(STAGE_INFERENCE, InferenceRequest.from_json(entry["request"]),
                                          lambda: self._outputs(entry, items, draining=committed is not None))
            emit, ended, current = ([failure], True, entry) if failure is not None else step
            yield from emit
            if ended:
                seen.release(json.loads(entry["request"])["id"], entry["fp"], time.time() + self._dedupe_window_s)
                changed = True
            else:
                remaining.append(current)
                changed = changed or (current["key"], current["attempt"]) != (key, attempt)
            if key is not None and current["key"] == key:  # the same stream, not lost and sent again under a new key
                streams.emitted(key, len(items), ended=ended)
        if changed:
            inflight.clear()
            for entry in remaining:
                inflight.add(encode_entry(entry))
        return len(remaining)

    def _outputs(self, entry: dict, items: Any, draining: bool) -> tuple[list[Any], bool, dict]:
        """One request's outputs from a poll: (what to emit, whether the request ended, its entry now)."""
        emit, ended = [], False
        attempts = Attempts(entry["attempt"], entry.get("lost", 0))
        if entry["key"] is None:  # its stream was lost while the engine was full: send it again
            items = [(UNKNOWN, "")]
        for kind, payload in items:
            if kind == CHUNK:
                self.chunks_out.inc()
                chunk = json.loads(payload)
                attempts = attempts.seen(chunk["attempt"])
                emit.append(chunk)
            elif kind == ATTEMPT:  # the engine retried the stream: a lost stream must be resent past it
                attempts = attempts.seen(int(payload))
            elif kind == COMPLETION:
                self.completions_out.inc()
                ended = True
                completion = json.loads(payload)
                if completion["time_to_first_token_ms"] is not None:
                    self._count_first_token(int(completion["time_to_first_token_ms"]))
                self.accelerator_ms.inc(round(1000 * (completion.get("accelerator_seconds") or 0.0)))
                if completion["output_error"] is not None:
                    self.structured_invalid.inc()
                    if completion["finish_reason"] == "length":
                        self.structured_cut.inc()
                emit.append(pvalue.TaggedOutput(TAG_COMPLETIONS, completion))
            elif kind == DEAD_LETTER:
                self.dead_letters_out.inc()
                ended = True
                letter = json.loads(payload)
                self.accelerator_ms.inc(round(1000 * (letter.get("accelerator_seconds") or 0.0)))
                emit.append(pvalue.TaggedOutput(TAG_DEAD_LETTERS, letter))
            elif kind == UNKNOWN:
                if draining:
                    return emit + [self._drain_letter(entry, "its stream was lost while the job drained")], True, entry
                again = attempts.resent()
                if again is None:
                    return emit + [self._dead_letter(entry["request"], f"its stream was lost {attempts.lost} times "
                                                     "(its key moved away, or its worker was lost, each time)")], \
                        True, entry
                key = self._submit([entry["request"]], [again.attempt])[0]
                if key is not None:
                    attempts = again
                    self.resubmitted.inc()
                    LOGGER.warning("Stream %s was lost; sent again as %s", entry["key"], key)
                entry = {**entry, "key": key}
        return emit, ended, {**entry, "attempt": attempts.attempt, "lost": attempts.lost}

    def _dead_letter(self, request_json: str, reason: str, stage: str = STAGE_INFERENCE) -> pvalue.TaggedOutput:
        self.dead_letters_out.inc()
        request = InferenceRequest.from_json(request_json)
        if stage == STAGE_DRAIN:  # republishable as it is: already prepared, so parsing applies no defaults again
            letter = DeadLetter(stage, reason, request.to_payload(), id=request.id,
                                attributes={PREPARED_ATTRIBUTE: "1"}, at=time.time())
        else:
            letter = DeadLetter(stage, reason, request_json, id=request.id, at=time.time())
        return pvalue.TaggedOutput(TAG_DEAD_LETTERS, letter.to_record())


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
        if generate_shards < 1:
            raise ValueError(f"generate_shards must be at least 1, got {generate_shards}")
        self._generate_shards = generate_shards

    def expand(self, batches):
        return batches | beam.FlatMap(_by_generate_key, self._generate_shards).with_output_types(Tuple[int, Any])


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
                 shared_tag: str | None = None, dedupe_window_s: float = DEFAULT_DEDUPE_WINDOW_S,
                 generate_shards: int | None = None, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__()
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be 0 or more, got {drain_timeout_s:g}")
        if dedupe_window_s < 0:
            raise ValueError(f"dedupe_window_s must be 0 or more, got {dedupe_window_s:g}")
        if generate_shards is not None and settings.engine == "transformers":
            raise ValueError("engine 'transformers' generates each batch as it came from the batcher, on its "
                             "batcher key: it takes no generate_shards")
        self._settings = settings
        self._dedupe_window_s = dedupe_window_s
        self._drain_timeout_s = drain_timeout_s
        self._generate_shards = generate_shards
        self._poll_interval_ms = template_poll_interval_ms(
            settings.chunk_policy.interval_ms if poll_interval_ms is None else 2 * poll_interval_ms)
        # One engine per worker for this pipeline (its admission step passes the same tag).
        self._shared_tag = shared_tag or new_engine_tag(settings)

    def expand(self, batches):
        if self._generate_shards is not None:
            # Re-keyed by the id's generate shard: these keys decide which worker's GPU serves a request.
            batches = batches | "KeyByGenerateShard" >> KeyByGenerateShard(self._generate_shards)
        results = batches | "Generate" >> beam.ParDo(
            _StreamingGenerateFn(self._settings, self._shared_tag, self._poll_interval_ms, self._dedupe_window_s,
                                 self._drain_timeout_s)
        ).with_outputs(TAG_COMPLETIONS, TAG_DEAD_LETTERS, main="chunks")
        return results

