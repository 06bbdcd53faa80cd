"""Streaming generation as a Beam transform.

:class:`StreamingGenerate` takes batches of requests keyed by shard and emits
chunks as they arrive. Outputs of a DoFn are committed when its bundle ends,
so a DoFn that yielded chunks from inside ``process`` would release them only
once its longest request finished. Instead, ``process`` hands the requests to
the worker's engine (:mod:`pipeline.engine_host`) and returns; a
processing-time timer then polls the engine and emits whatever has arrived,
each firing its own small bundle. With ``EngineSettings.chunk_topic`` the
engine publishes chunks itself as they are cut (no Beam hop between a token
and its consumer), and the poll carries completions, dead letters and lost
streams; the template runs this way.

Each batch from the batcher is submitted as one unit (``submit_batch``): the
vLLM engine takes the requests it has room for, the transformers engine
(:mod:`pipeline.static_engine`) generates the batch together or takes none of
it yet; what is not taken waits with its batch id, and is admitted batch by
batch.

Per shard, keyed state holds three things, each written only when it changes:

* ``waiting``: requests the engine had no room for. A backlog waits here, in
  Beam state, not in the engine, and is admitted in arrival order as streams
  finish; waiting is never a reason to give a request up.
* ``inflight``: requests the engine is streaming. A worker that dies
  mid-stream is recovered: the next poll finds no stream and sends the request
  again as a new ``attempt``.
* ``seen``: the ids of requests waiting, in flight, or finished within
  ``dedupe_window_s`` (:mod:`pipeline.dedupe`).
"""

from __future__ import annotations

import hashlib
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

from pipeline.dedupe import SeenIds
from pipeline.element_guard import guarded
from pipeline.engine import ATTEMPT, CHUNK, COMPLETION, DEAD_LETTER, UNKNOWN, EngineBase, EngineSettings
from pipeline.engine_host import acquire_engine
from pipeline.keying import generate_key
from pipeline.messages import STAGE_INFERENCE, DeadLetter, InferenceRequest

LOGGER = logging.getLogger(__name__)

TAG_COMPLETIONS = "completions"
TAG_DEAD_LETTERS = "dead_letters"
# A request whose stream is lost this many times (worker restarts) is given up.
MAX_ATTEMPTS = 4
DEFAULT_DEDUPE_WINDOW_S = 600.0


class _StreamingGenerateFn(beam.DoFn):
    WAITING = BagStateSpec("waiting", StrUtf8Coder())
    INFLIGHT = BagStateSpec("inflight", StrUtf8Coder())
    SEEN = ReadModifyWriteStateSpec("seen", StrUtf8Coder())
    POLL = TimerSpec("poll", TimeDomain.REAL_TIME)
    POLL_AT_MS = ReadModifyWriteStateSpec("poll_at_ms", VarIntCoder())
    DRAIN = TimerSpec("drain", TimeDomain.WATERMARK)

    def __init__(self, settings: EngineSettings, shared_tag: str, poll_interval_ms: float,
                 dedupe_window_s: float) -> None:
        self._settings = settings
        self._shared_tag = shared_tag
        self._poll_interval_s = poll_interval_ms / 1000.0
        self._dedupe_window_s = dedupe_window_s
        self._engine: EngineBase | None = None
        self.requests_sent = Metrics.counter("streaming_generate", "requests_sent")
        self.requests_queued = Metrics.counter("streaming_generate", "requests_queued")
        self.requests_admitted = Metrics.counter("streaming_generate", "requests_admitted_from_queue")
        self.duplicates = Metrics.counter("streaming_generate", "duplicates_dropped")
        self.chunks_out = Metrics.counter("streaming_generate", "chunks")
        self.completions_out = Metrics.counter("streaming_generate", "completions")
        self.dead_letters_out = Metrics.counter("streaming_generate", "dead_letters")
        self.resubmitted = Metrics.counter("streaming_generate", "lost_streams_resubmitted")
        self.ttft = Metrics.distribution("streaming_generate", "time_to_first_token_ms")
        # Structured answers (a response_format) without a valid output_json, and those of them cut at max_tokens.
        self.structured_invalid = Metrics.counter("streaming_generate", "structured_output_invalid")
        self.structured_cut = Metrics.counter("streaming_generate", "structured_output_cut_at_max_tokens")

    def setup(self) -> None:
        self._engine = acquire_engine(self._settings, self._shared_tag)

    def process(self, element: tuple[object, list[InferenceRequest]],
                window=beam.DoFn.WindowParam,
                waiting=beam.DoFn.StateParam(WAITING),
                inflight=beam.DoFn.StateParam(INFLIGHT),
                seen_state=beam.DoFn.StateParam(SEEN),
                poll=beam.DoFn.TimerParam(POLL),
                poll_at_ms=beam.DoFn.StateParam(POLL_AT_MS),
                drain=beam.DoFn.TimerParam(DRAIN)) -> Iterator[Any]:
        shard, requests = element
        now = time.time()
        seen = SeenIds(seen_state)
        batch = uuid.uuid4().hex[:12]  # the batcher's batch stays one unit for an engine that generates it so
        accepted: list[dict] = []
        for request in requests:
            yield from guarded(STAGE_INFERENCE, request, lambda: self._accept(request, seen, batch, accepted, now))
        if next(iter(waiting.read()), None) is not None:  # once one waits, the rest queue behind it
            sent = 0
        else:
            sent = self._send(accepted, inflight)
        for entry in accepted[sent:]:
            waiting.add(json.dumps(entry))
            self.requests_queued.inc()
        seen.save(now)
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
            inflight.add(json.dumps(entry))
            sent += 1
        self.requests_sent.inc(sent)
        return sent

    @on_timer(POLL)
    def on_poll(self, waiting=beam.DoFn.StateParam(WAITING), inflight=beam.DoFn.StateParam(INFLIGHT),
                seen_state=beam.DoFn.StateParam(SEEN), poll=beam.DoFn.TimerParam(POLL),
                poll_at_ms=beam.DoFn.StateParam(POLL_AT_MS)) -> Iterator[Any]:
        poll_at_ms.clear()
        seen = SeenIds(seen_state)
        busy = yield from self._collect(inflight, seen)
        busy += yield from self._admit(waiting, inflight, seen)
        now = time.time()
        seen.save(now, prune=not busy)
        if busy:
            self._arm(poll, poll_at_ms, now + self._poll_interval_s)
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
                 seen_state=beam.DoFn.StateParam(SEEN)) -> Iterator[Any]:
        """The window is closing (or the job drains): serve what waits and streams, for as long as it progresses."""
        seen = SeenIds(seen_state)
        patience = self._settings.request_timeout_s + 30
        last_busy, last_progress = None, time.time()
        while True:
            busy = (yield from self._collect(inflight, seen)) + (yield from self._admit(waiting, inflight, seen))
            if not busy:
                break
            if last_busy is None or busy < last_busy:
                last_progress = time.time()
            elif time.time() - last_progress > patience:
                break
            last_busy = busy
            time.sleep(self._poll_interval_s)
        for state in (waiting, inflight):
            for entry in state.read():
                yield self._dead_letter(json.loads(entry)["request"],
                                        "the window closed (or the job drained) before the request finished")
            state.clear()
        seen_state.clear()

    def _submit(self, request_jsons: list[str], attempts: list[int]) -> list[str | None]:
        """The engine's keys for new streams; None for each it has no room for (or when it must be reconnected)."""
        try:
            return self._engine.submit_batch(request_jsons, attempts)
        except (ConnectionError, EOFError) as exc:
            LOGGER.warning("The worker's engine is unreachable (%s); reconnecting", exc)
            self._engine = acquire_engine(self._settings, self._shared_tag, fresh=True)
            return [None] * len(request_jsons)

    def _admit(self, waiting, inflight, seen: SeenIds) -> Iterator[Any]:
        """Sends waiting requests, batch by batch, while the engine has room; returns how many it sent or left."""
        waiting_entries = list(waiting.read())
        if not waiting_entries:
            return 0
        if self._engine.in_flight() >= self._settings.max_in_flight:
            return len(waiting_entries)  # full: nothing to decode
        now, live, expired = time.time(), [], False
        for entry in map(json.loads, waiting_entries):
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
                waiting.add(json.dumps(entry))
        return len(live)

    def _collect(self, inflight, seen: SeenIds) -> Iterator[Any]:
        """Emits what the engine has for each in-flight request; returns how many remain.

        The bag is rewritten only when an entry changed (finished, resent, new attempt).
        """
        entries = [json.loads(e) for e in inflight.read()]
        if not entries:
            return 0  # timers can fire twice for one setting
        keys = [e["key"] for e in entries if e["key"] is not None]
        try:
            ready = self._engine.poll(keys) if keys else {}
        except (ConnectionError, EOFError) as exc:
            # The SDK process hosting the shared engine died: its streams are gone with it.
            LOGGER.warning("The worker's engine is unreachable (%s); reconnecting and resending", exc)
            self._engine = acquire_engine(self._settings, self._shared_tag, fresh=True)
            ready = {key: [(UNKNOWN, "")] for key in keys}
        remaining, changed = [], False
        for entry in entries:
            before = (entry["key"], entry["attempt"])
            outcome: list[bool] = []
            items = ready.get(entry["key"], ())
            if not items and entry["key"] is not None:
                remaining.append(entry)  # nothing new for this request
                continue
            yield from guarded(STAGE_INFERENCE, InferenceRequest.from_json(entry["request"]),
                               lambda: self._outputs(entry, items, outcome), on_failure=lambda: outcome.append(True))
            if outcome:
                seen.release(json.loads(entry["request"])["id"], entry["fp"], time.time() + self._dedupe_window_s)
                changed = True
            else:
                remaining.append(entry)
                changed = changed or (entry["key"], entry["attempt"]) != before
        if changed:
            inflight.clear()
            for entry in remaining:
                inflight.add(json.dumps(entry))
        return len(remaining)

    def _outputs(self, entry: dict, items: Any, outcome: list[bool]) -> Iterator[Any]:
        """One request's outputs from a poll; appends to ``outcome`` when the request has ended."""
        if entry["key"] is None:  # its stream was lost while the engine was full: send it again
            items = [(UNKNOWN, "")]
        for kind, payload in items:
            if kind == CHUNK:
                self.chunks_out.inc()
                chunk = json.loads(payload)
                entry["attempt"] = max(entry["attempt"], chunk["attempt"])
                yield chunk
            elif kind == ATTEMPT:  # the engine retried the stream: a lost stream must be resent past it
                entry["attempt"] = max(entry["attempt"], int(payload))
            elif kind == COMPLETION:
                self.completions_out.inc()
                outcome.append(True)
                completion = json.loads(payload)
                if completion["time_to_first_token_ms"] is not None:
                    self.ttft.update(int(completion["time_to_first_token_ms"]))
                if completion["output_error"] is not None:
                    self.structured_invalid.inc()
                    if completion["finish_reason"] == "length":
                        self.structured_cut.inc()
                yield pvalue.TaggedOutput(TAG_COMPLETIONS, completion)
            elif kind == DEAD_LETTER:
                self.dead_letters_out.inc()
                outcome.append(True)
                yield pvalue.TaggedOutput(TAG_DEAD_LETTERS, json.loads(payload))
            elif kind == UNKNOWN:
                if entry["attempt"] >= MAX_ATTEMPTS:
                    outcome.append(True)
                    yield self._dead_letter(entry["request"], f"its stream was lost {entry['attempt']} times")
                    break
                key = self._submit([entry["request"]], [entry["attempt"] + 1])[0]
                if key is not None:
                    entry["attempt"] += 1
                    self.resubmitted.inc()
                    LOGGER.warning("Stream %s was lost; sent again as %s", entry["key"], key)
                entry["key"] = key

    def _dead_letter(self, request_json: str, reason: str) -> pvalue.TaggedOutput:
        self.dead_letters_out.inc()
        request = InferenceRequest.from_json(request_json)
        letter = DeadLetter(STAGE_INFERENCE, reason, request_json, id=request.id, at=time.time())
        return pvalue.TaggedOutput(TAG_DEAD_LETTERS, letter.to_record())


def _by_generate_key(batch: tuple[object, list[InferenceRequest]],
                     generate_shards: int) -> Iterator[tuple[int, list[InferenceRequest]]]:
    groups: dict[int, list[InferenceRequest]] = {}
    for request in batch[1]:
        groups.setdefault(generate_key(request.id, generate_shards), []).append(request)
    yield from groups.items()


class StreamingGenerate(beam.PTransform):
    """Batches of requests in, streamed chunks out.

    Input: ``(shard_key, [InferenceRequest, ...])``; with ``generate_shards``
    each request is first re-keyed by :func:`~pipeline.keying.generate_key`
    (see :mod:`pipeline.keying` for why). Outputs (a tuple of
    PCollections of JSON-ready dicts): ``chunks`` (main; empty when the engine
    publishes them to a ``chunk_topic`` and ``chunks_to_pipeline`` is off),
    ``completions`` and ``dead_letters``; see :mod:`pipeline.messages` for their fields.

    Example::

        results = batches | StreamingGenerate(EngineSettings(server=None, server_url="http://vllm:8000"))
        results.chunks | ...
    """

    def __init__(self, settings: EngineSettings, *, poll_interval_ms: float | None = None,
                 shared_tag: str | None = None, dedupe_window_s: float = DEFAULT_DEDUPE_WINDOW_S,
                 generate_shards: int | None = None) -> None:
        super().__init__()
        if dedupe_window_s < 0:
            raise ValueError(f"dedupe_window_s must be 0 or more, got {dedupe_window_s:g}")
        if generate_shards is not None and generate_shards < 1:
            raise ValueError(f"generate_shards must be at least 1, got {generate_shards}")
        if generate_shards is not None and settings.engine == "transformers":
            raise ValueError("engine 'transformers' generates each batch as it came from the batcher, on its "
                             "batcher key: it takes no generate_shards")
        self._settings = settings
        self._dedupe_window_s = dedupe_window_s
        self._generate_shards = generate_shards
        interval = settings.chunk_policy.interval_ms / 2 if poll_interval_ms is None else poll_interval_ms
        self._poll_interval_ms = min(max(interval, 10.0), 100.0)
        # One engine per worker for this pipeline, never shared with another job's.
        self._shared_tag = shared_tag or "streaming-llm-" + hashlib.sha1(
            (repr(settings) + uuid.uuid4().hex).encode()).hexdigest()[:16]

    def expand(self, batches):
        if self._generate_shards is not None:
            # Re-keyed by the id's generate shard: these keys decide which worker's GPU serves a request.
            batches = batches | "KeyByGenerateShard" >> beam.FlatMap(
                _by_generate_key, self._generate_shards).with_output_types(Tuple[int, Any])
        results = batches | "Generate" >> beam.ParDo(
            _StreamingGenerateFn(self._settings, self._shared_tag, self._poll_interval_ms, self._dedupe_window_s)
        ).with_outputs(TAG_COMPLETIONS, TAG_DEAD_LETTERS, main="chunks")
        return results

