"""Streaming generation as a Beam transform.

:class:`StreamingGenerate` takes batches of requests keyed by shard and emits
chunks as they arrive. Outputs of a DoFn are committed when its bundle ends,
so a DoFn that yielded chunks from inside ``process`` would release them only
once its longest request finished. Instead, ``process`` hands the requests to
the worker's :class:`~pipeline.engine.StreamingEngine` and returns; a
processing-time timer then polls the engine and emits whatever has arrived,
each firing its own small bundle. The requests stay in keyed state until they
end, so a worker that dies mid-stream is recovered: the next poll finds no
stream and sends the request again as a new attempt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from typing import Iterator

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.coders import StrUtf8Coder, VarIntCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import (BagStateSpec, ReadModifyWriteStateSpec, TimerSpec,
                                              on_timer)
from apache_beam.utils.multi_process_shared import MultiProcessShared
from apache_beam.utils.timestamp import Duration, Timestamp

from pipeline.engine import CHUNK, COMPLETION, DEAD_LETTER, UNKNOWN, EngineSettings, StreamingEngine
from pipeline.messages import STAGE_INFERENCE, DeadLetter, InferenceRequest

LOGGER = logging.getLogger(__name__)

TAG_COMPLETIONS = "completions"
TAG_DEAD_LETTERS = "dead_letters"
# A request whose stream is lost this many times (worker restarts) is given up.
MAX_ATTEMPTS = 4


# Engines this process has acquired, by tag. Runners may set up and tear down
# DoFn instances per bundle (the DirectRunner does), so the reference is held
# for the life of the process rather than released in teardown, which would
# stop the server; the engine closes itself (and its server) at exit.
_ACQUIRED: dict[str, StreamingEngine] = {}
_ACQUIRE_LOCK = threading.Lock()


def acquire_engine(settings: EngineSettings, tag: str, *, fresh: bool = False) -> StreamingEngine:
    """The worker-wide engine: the first process to ask builds it, the others proxy to it.

    ``fresh`` drops this process's cached handle first (its hosting process died).
    """
    with _ACQUIRE_LOCK:
        if fresh:
            _ACQUIRED.pop(tag, None)
        if tag not in _ACQUIRED:
            shared = MultiProcessShared(lambda: StreamingEngine(settings), tag=tag)
            _ACQUIRED[tag] = shared.acquire()
        return _ACQUIRED[tag]


class _StreamingGenerateFn(beam.DoFn):
    INFLIGHT = BagStateSpec("inflight", StrUtf8Coder())
    POLL = TimerSpec("poll", TimeDomain.REAL_TIME)
    POLL_ARMED = ReadModifyWriteStateSpec("poll_armed", VarIntCoder())
    DRAIN = TimerSpec("drain", TimeDomain.WATERMARK)

    def __init__(self, settings: EngineSettings, shared_tag: str, poll_interval_ms: float) -> None:
        self._settings = settings
        self._shared_tag = shared_tag
        self._poll_interval = Duration(micros=int(poll_interval_ms * 1000))
        self._engine: StreamingEngine | None = None
        self.requests_sent = Metrics.counter("streaming_generate", "requests_sent")
        self.chunks_out = Metrics.counter("streaming_generate", "chunks")
        self.completions_out = Metrics.counter("streaming_generate", "completions")
        self.dead_letters_out = Metrics.counter("streaming_generate", "dead_letters")
        self.resubmitted = Metrics.counter("streaming_generate", "lost_streams_resubmitted")
        self.ttft = Metrics.distribution("streaming_generate", "time_to_first_token_ms")

    def setup(self) -> None:
        self._engine = acquire_engine(self._settings, self._shared_tag)

    def process(self, element: tuple[object, list[InferenceRequest]],
                window=beam.DoFn.WindowParam,
                inflight=beam.DoFn.StateParam(INFLIGHT),
                poll=beam.DoFn.TimerParam(POLL),
                poll_armed=beam.DoFn.StateParam(POLL_ARMED),
                drain=beam.DoFn.TimerParam(DRAIN)) -> None:
        shard, requests = element
        LOGGER.debug("Shard %s: sending %s", shard, [r.id for r in requests])
        for request in requests:
            key = self._engine.submit(request.to_json(), 1)
            inflight.add(json.dumps({"key": key, "request": request.to_json(), "attempt": 1}))
            self.requests_sent.inc()
        if not poll_armed.read():
            poll.set(Timestamp.now() + self._poll_interval)
            poll_armed.write(1)
        drain.set(window.max_timestamp())

    @on_timer(POLL)
    def on_poll(self, inflight=beam.DoFn.StateParam(INFLIGHT), poll=beam.DoFn.TimerParam(POLL),
                poll_armed=beam.DoFn.StateParam(POLL_ARMED)) -> Iterator[object]:
        poll_armed.clear()
        remaining = yield from self._collect(inflight)
        if remaining:
            poll.set(Timestamp.now() + self._poll_interval)
            poll_armed.write(1)

    @on_timer(DRAIN)
    def on_drain(self, inflight=beam.DoFn.StateParam(INFLIGHT)) -> Iterator[object]:
        """The window is closing (or the job drains): wait for every request to end."""
        deadline = time.time() + self._settings.request_timeout_s + 30
        while (yield from self._collect(inflight)) and time.time() < deadline:
            time.sleep(self._poll_interval.micros / 1e6)
        for entry in inflight.read():
            request = json.loads(entry)["request"]
            yield self._given_up(request, "the window closed before the request finished")
        inflight.clear()

    def _collect(self, inflight) -> Iterator[object]:
        """Emits what the engine has for each in-flight request; returns how many remain."""
        entries = [json.loads(e) for e in inflight.read()]
        if not entries:
            return 0  # timers can fire twice for one setting
        keys = [e["key"] for e in entries]
        try:
            ready = self._engine.poll(keys)
        except (ConnectionError, EOFError) as exc:
            # The SDK process hosting the shared engine died: its streams are gone with it.
            LOGGER.warning("The worker's engine is unreachable (%s); reconnecting and resending", exc)
            self._engine = acquire_engine(self._settings, self._shared_tag, fresh=True)
            ready = {key: [(UNKNOWN, "")] for key in keys}
        remaining = []
        for entry in entries:
            done = False
            for kind, payload in ready.get(entry["key"], ()):
                if kind == CHUNK:
                    self.chunks_out.inc()
                    chunk = json.loads(payload)
                    entry["attempt"] = max(entry["attempt"], chunk["attempt"])
                    if chunk["seq"] == 0 and chunk["time_to_first_token_ms"] is not None:
                        self.ttft.update(int(chunk["time_to_first_token_ms"]))
                    yield chunk
                elif kind == COMPLETION:
                    self.completions_out.inc()
                    done = True
                    yield pvalue.TaggedOutput(TAG_COMPLETIONS, json.loads(payload))
                elif kind == DEAD_LETTER:
                    self.dead_letters_out.inc()
                    done = True
                    yield pvalue.TaggedOutput(TAG_DEAD_LETTERS, json.loads(payload))
                elif kind == UNKNOWN:
                    done = yield from self._resubmit(entry)
            if not done:
                remaining.append(entry)
        inflight.clear()
        for entry in remaining:
            inflight.add(json.dumps(entry))
        return len(remaining)

    def _resubmit(self, entry: dict) -> Iterator[object]:
        """The stream is gone (the worker or engine restarted): send it again, or give up."""
        if entry["attempt"] >= MAX_ATTEMPTS:
            yield self._given_up(entry["request"], f"its stream was lost {entry['attempt']} times")
            return True
        entry["attempt"] += 1
        self.resubmitted.inc()
        LOGGER.warning("Stream %s was lost; sending it again as attempt %d", entry["key"], entry["attempt"])
        entry["key"] = self._engine.submit(entry["request"], entry["attempt"])
        return False

    def _given_up(self, request_json: str, reason: str) -> pvalue.TaggedOutput:
        self.dead_letters_out.inc()
        request = InferenceRequest.from_json(request_json)
        letter = DeadLetter(STAGE_INFERENCE, reason, request_json, id=request.id, at=time.time())
        return pvalue.TaggedOutput(TAG_DEAD_LETTERS, json.loads(letter.to_json()))


class StreamingGenerate(beam.PTransform):
    """Batches of requests in, streamed chunks out.

    Input: ``(shard_key, [InferenceRequest, ...])``. Outputs (a tuple of
    PCollections of JSON-ready dicts): ``chunks`` (main), ``completions`` and
    ``dead_letters``; see :mod:`pipeline.messages` for their fields.

    Example::

        results = batches | StreamingGenerate(EngineSettings(server=None, server_url="http://vllm:8000"))
        results.chunks | ...
    """

    def __init__(self, settings: EngineSettings, *, poll_interval_ms: float | None = None,
                 shared_tag: str | None = None) -> None:
        super().__init__()
        self._settings = settings
        interval = settings.chunk_policy.interval_ms / 2 if poll_interval_ms is None else poll_interval_ms
        self._poll_interval_ms = min(max(interval, 10.0), 100.0)
        # One engine per worker for this pipeline, never shared with another job's.
        self._shared_tag = shared_tag or "streaming-llm-" + hashlib.sha1(
            (repr(settings) + uuid.uuid4().hex).encode()).hexdigest()[:16]

    def expand(self, batches):
        results = batches | "Generate" >> beam.ParDo(
            _StreamingGenerateFn(self._settings, self._shared_tag, self._poll_interval_ms)
        ).with_outputs(TAG_COMPLETIONS, TAG_DEAD_LETTERS, main="chunks")
        return results

