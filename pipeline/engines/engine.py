"""The engine contract: what the generate step may ask of the engine, and the one engine that answers it.

One engine per worker VM (shared through Beam's ``MultiProcessShared``, see
:mod:`pipeline.worker.runtime`) is a registry of streams (:mod:`pipeline.engines.stream_registry`, plain
logic behind the engine's lock) over a backend that generates them and an outlet that publishes their chunks
(:mod:`pipeline.engines.backend`, two small interfaces): ``submit_batch`` starts requests and returns at once;
``poll`` hands back whatever chunks, completions or dead letters have accumulated. Two backends exist:
:mod:`pipeline.engines.vllm_engine` (many requests in flight against a vLLM server, continuous batching) and
:mod:`pipeline.engines.transformers_engine` (the model in-process, each batch generated together).

The engine holds at most ``max_in_flight`` unfinished streams, and starts a bulk lane's request only beside fewer
than ``bulk_streams`` (:meth:`StreamRegistry.room`, the one rule for both engines): ``submit_batch`` refuses more
(None for those) rather than queueing them, so a backlog waits in the pipeline's keyed state, bounded here, and a
request's ``request_timeout_s`` runs from when it is actually sent, not from when it joined a queue.

Requests and outputs cross this boundary as JSON strings, which keeps the
cross-process proxy calls cheap and version-tolerant.

With a ``chunk_topic`` the engine publishes each chunk to Pub/Sub itself the
moment it is cut (see :mod:`pipeline.sinks.chunk_publisher`), and hands a request's
completion to ``poll`` only once Pub/Sub has confirmed all its chunks. Chunks are
cut on the engine's own threads: as text arrives, and by a clock for text that
waited past ``chunk_interval_ms`` (:meth:`Engine._cut_waiting_text`), so ``poll``
only reads, and a chunk published straight to Pub/Sub never waits for a poll.

The contract is shaped by the runner's commit semantics (Dataflow retries a
work item whose commit failed, and moves keys between workers):

* ``poll`` is idempotent. The caller says how many of a stream's outputs it
  has already committed (its position, kept in keyed state); outputs before it
  are released, the rest are handed over again until a later poll's position
  shows they were committed (both sides' arithmetic:
  :mod:`pipeline.contract.stream_progress`). A retried poll therefore gets what
  the failed one got, instead of finding the stream gone and generating it again.
* Streams are leased, and a pause is not a move (:mod:`pipeline.engines.leases`). A
  running stream is cancelled at the server (vLLM aborts a request whose
  connection closes, freeing its KV cache) and forgotten only on evidence that
  its key left this worker: for ``stream_lease_s`` the worker polled other
  streams and not this one, or none at all for several leases. A process
  that was paused finds its streams where it left them. A finished stream's
  outputs are kept until released or for ``request_timeout_s``, so a late
  poll collects them instead of generating the request again.

The worker's admission ledger is not the engine's: it sits beside it in the worker's runtime
(:mod:`pipeline.worker.runtime`) and asks the engine only how many streams are unfinished
(:meth:`Engine.in_flight`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from pipeline.contract.chunking import ChunkAssembler
from pipeline.contract.messages import STAGE_INFERENCE, Chunk, Completion, DeadLetter, InferenceRequest
from pipeline.contract.stream_progress import ATTEMPT, CHUNK, COMPLETION, DEAD_LETTER
from pipeline.contract.structured_output import parse_output
from pipeline.engines.backend import BackendFactory, ChunkOutlet
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.stream_registry import Stream, StreamRegistry
from pipeline.serving.lineage import ServingLineage
from pipeline.sinks.chunk_publisher import ChunkPublisher

LOGGER = logging.getLogger(__name__)


# The chunk clock's longest tick: how late past chunk_interval_ms a waiting text's chunk may be cut.
CHUNK_CLOCK_MAX_S = 0.05
CHUNK_CLOCK_MIN_S = 0.005  # and its shortest, whatever the interval


class Engine:
    """The registry of streams that ``poll`` reads, behind a lock, with the threads around it (the lease janitor,
    the chunk clock), over a backend that generates the streams and an outlet that publishes their chunks.

    An engine is built once per worker (see :func:`pipeline.worker.runtime.acquire_runtime`)
    and called through Beam's cross-process proxy: ``submit_batch`` starts requests
    and returns at once, ``poll`` hands back what they produced. The backend is built first, with this engine as
    the :class:`~pipeline.engines.backend.StreamEvents` it tells: one whose server never answers raises before
    the engine starts a thread or a publisher, and leaves nothing behind.
    """

    def __init__(self, settings: EngineSettings, backend: BackendFactory,
                 outlet: Callable[[str], ChunkOutlet] = ChunkPublisher) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._closed = False
        self.backend = backend(settings, self)
        self.model_name = self.backend.model_name
        self._chunk_publisher = outlet(settings.chunk_topic) if settings.chunk_topic else None
        self.instance = uuid.uuid4().hex[:12]  # in every key: no other engine, here or on another worker, has it
        # The streams, behind the lock: every touch of the registry holds it.
        self._registry = StreamRegistry(settings, self.instance, whole_batches=self.backend.whole_batches,
                                        preempts=self.backend.preempts)
        self._janitor = threading.Thread(target=self._expire_leases, name="engine-leases", daemon=True)
        self._janitor.start()
        threading.Thread(target=self._cut_waiting_text, name="engine-chunk-clock", daemon=True).start()

    # Public API (called through the cross-process proxy) ----------------------------

    def submit_batch(self, request_jsons: list[str], attempts: list[int], client: str = "") -> list[str | None]:
        """Starts a batch of requests; for each, the key to poll it with, or None where the engine had no room.

        A key names the request's content as well as its id and attempt, so two
        different requests that share an id never share a stream, and this engine
        instance, so a key that moved away and back never mistakes another
        worker's stream (or this worker's abandoned one) for its own. Submitting
        the same request and attempt again here (a retried bundle) returns the same key. ``client``: the
        calling process (:mod:`pipeline.engines.leases`).
        """
        requests = [InferenceRequest.from_json(text) for text in request_jsons]
        with self._lock:
            keys, started = self._registry.submit(requests, attempts, client, time.monotonic())
        if started:
            self.backend.start(started)
        return keys

    def poll(self, positions: dict[str, int], client: str = "") -> dict[str, list[tuple[str, str]]]:
        """For each key, its outputs from ``positions[key]`` on (the number the caller has committed).

        Outputs before the position are released (:class:`~pipeline.contract.stream_progress.OutputWindow`);
        a finished stream whose every output is released is forgotten (its result is then ``[]``). An unknown
        key, or a position outside what the stream holds (before what was
        released, or past what it produced), gets ``UNKNOWN``: the stream is lost
        to the caller and must be submitted again. ``client``: the calling process (:mod:`pipeline.engines.leases`).
        """
        with self._lock:
            return self._registry.poll(positions, client)

    def cancel(self, keys: list[str]) -> None:
        """Stops these streams now (at the server too) and forgets them: their outputs are not wanted."""
        with self._lock:
            streams = self._registry.take(keys)
        self._stop(streams)

    def heartbeat(self, client: str) -> None:
        """The calling process is alive (every SDK process says so while it runs: a paused one stops)."""
        with self._lock:
            self._registry.leases.heard(client)

    def hold_leases(self, for_s: float) -> None:
        """The job drains: no running stream is cancelled for want of polls for ``for_s`` (see
        :mod:`pipeline.engines.leases`)."""
        with self._lock:
            self._registry.leases.hold(for_s)

    def in_flight(self) -> int:
        """Streams sent and not finished; never more than ``max_in_flight`` (with the transformers engine,
        because the launch refuses a ``batch_size_target`` above it)."""
        with self._lock:
            return self._registry.unfinished

    def bulk_in_flight(self) -> int:
        """Of :meth:`in_flight`, the bulk lane's streams (those it shed included)."""
        with self._lock:
            return self._registry.bulk_unfinished

    def bulk_cap(self) -> int:
        """How many bulk streams the lane may run now (:mod:`.lane_governor`): what the worker's reader keeps at
        hand for it (:class:`~pipeline.worker.admission_ledger.AdmissionLedger`)."""
        with self._lock:
            return self._registry.bulk_cap(time.monotonic())

    def stats(self) -> dict[str, int | None]:
        """What the engine holds and has done, for the worker's load gauges: requests running and waiting at the
        model server (None where it cannot tell), the model's busy time so far (ms: what every request's
        ``accelerator_seconds`` adds up to), the bulk lane's governor (its cap, budget, percentiles and totals), and
        chunks published to the chunk topic, and of them not yet confirmed."""
        running, queued = self.backend.load()
        with self._lock:
            busy_ms = round(self._registry.busy.busy_s * 1000)
            lane = self._registry.lane
            now = time.monotonic()
            bulk_cap = self._registry.bulk_cap(now) if self.settings.bulk_lane else None
            lane_gauges = {"live_first_token_p95_ms": lane.percentile_ms(now),
                           "live_inter_token_p95_ms": lane.inter_token_percentile_ms(now),
                           "bulk_prompt_budget": -1 if lane.prompt_budget is None else lane.prompt_budget}
            lane_totals = dict(lane.totals)
        publisher = self._chunk_publisher
        return {"server_running": running, "server_waiting": queued, "busy_ms": busy_ms, "bulk_cap": bulk_cap,
                **{name: None if value is None else round(value) for name, value in lane_gauges.items()},
                **lane_totals,
                "chunks_published": publisher.published if publisher else 0,
                "chunks_unconfirmed": publisher.unconfirmed() if publisher else 0, **self.backend.stats()}

    @property
    def lineage(self) -> ServingLineage:
        return self.backend.lineage

    def server_restarts(self) -> int:
        return self.backend.restarts()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.backend.close()

    # Leases ----------------------------------------------------------------------------

    def _expire_leases(self) -> None:
        """Cancels and forgets the streams whose lease ran out (see the module docstring), and sheds the bulk
        streams past the lane's cap (:meth:`StreamRegistry.shed`): the lane shrinks within a tick."""
        lease = self.settings.stream_lease_s
        last = time.monotonic()
        while not self._closed:
            time.sleep(self._registry.tick_s)
            now = time.monotonic()
            with self._lock:
                streams = self._registry.expire(now - last)
                shed = self._registry.shed(now) if self.settings.bulk_lane else []
            last = now
            if shed:
                LOGGER.info("The bulk lane shed %d stream(s) past its cap of %d: each starts over when it has room",
                            len(shed), self._registry.lane.cap)
                self.backend.preempt(shed)
            finished = sum(stream.done for stream in streams)
            if len(streams) > finished:
                LOGGER.warning("%d stream(s) not polled for stream_lease_s=%g while this worker polled others, or "
                               "while it polled none (their keys moved away): cancelled", len(streams) - finished,
                               lease)
            if finished:
                LOGGER.warning("%d finished stream(s) not collected within request_timeout_s=%g, or past the %d kept "
                               "(their keys moved away): forgotten", finished, self.settings.request_timeout_s,
                               self._registry.finished_kept)
            if streams:
                self._stop(streams)

    def _stop(self, streams: list[Stream]) -> None:
        """Ends streams already taken out of the registry: counted as finished, cancelled where still running."""
        with self._lock:
            running = self._registry.stop(streams, time.monotonic())
        for stream in streams:
            if self._chunk_publisher is not None:
                self._chunk_publisher.forget(stream.key)
        if running:
            self.backend.cancel(running)

    def _emit(self, stream: Stream, kind: str, payload: str, *, final: bool = False) -> None:
        with self._lock:
            self._registry.emit(stream, (kind, payload), final=final)

    def _cut_waiting_text(self) -> None:
        """The chunk clock: cuts a chunk of each stream's text that has waited past ``chunk_interval_ms`` (a slow
        answer's text between events), at most ``CHUNK_CLOCK_MAX_S`` late."""
        tick = max(min(self.settings.chunk_policy.interval_ms / 2000.0, CHUNK_CLOCK_MAX_S), CHUNK_CLOCK_MIN_S)
        while not self._closed:
            time.sleep(tick)
            now = time.time()
            with self._lock:
                for stream in list(self._registry.streams.values()):
                    if stream.assembler is not None and not stream.done:
                        self._queue_chunks(stream, stream.assembler.due(now))

    # What the backend tells (pipeline.engines.backend.StreamEvents) -----------------------

    def attach(self, stream: Stream, assembler: ChunkAssembler) -> None:
        with self._lock:
            stream.assembler = assembler

    def cut(self, stream: Stream, step: Callable[[], list[Chunk]]) -> None:
        """Runs a step of the stream's chunk assembler and sends its chunks on, under the lock the chunk clock cuts
        under: the backend cuts a stream's chunks as its text arrives and the clock cuts text that waited, so one lock
        keeps their sequence numbers one gapless sequence, published in that order.
        """
        arrived = time.monotonic()  # before the lock: a wait for the chunk clock or a poll is not the server's
        with self._lock:
            self._queue_chunks(stream, step())
            if stream.assembler is not None:
                self._registry.tokens(stream, arrived, stream.assembler.tokens)

    def restart(self, stream: Stream) -> None:
        """The stream's attempt ended without its answer and the next starts over: one whose chunks went out makes
        a new attempt, and text its assembler still held is not cut (the chunk clock would cut it after the new
        attempt's mark, as the old attempt's)."""
        with self._lock:
            assembler, stream.assembler = stream.assembler, None
            if assembler is not None and assembler.chunks_emitted > 0:
                stream.attempt += 1
                stream.window.add((ATTEMPT, str(stream.attempt)))

    def may_run(self, stream: Stream) -> bool:
        """Whether the stream may start (again) now: False while the lane keeps it shed."""
        with self._lock:
            return self._registry.resume(stream, time.monotonic())

    def _queue_chunks(self, stream: Stream, chunks: list[Chunk]) -> None:
        """Publishes and/or queues chunks for poll(); the caller holds the lock."""
        if not self._registry.holds(stream):
            return  # cancelled: nobody will collect it
        if chunks:
            self._registry.first_chunk(stream, time.time(), time.monotonic())
        for chunk in chunks:
            if self._chunk_publisher is not None:
                self._chunk_publisher.publish(stream.key, chunk)
            if self.settings.chunks_to_pipeline:
                stream.window.add((CHUNK, chunk.to_json()))

    def chunks_pending(self, stream: Stream) -> bool:
        """Whether Pub/Sub has yet to confirm a chunk of the stream (failed ones are published again).

        Past ``chunk_publish_patience_s`` of failures the chunks are given up and the completion goes anyway.
        """
        if self._chunk_publisher is None or self._chunk_publisher.settled(stream.key):
            return False
        failing_since = self._chunk_publisher.failing_since(stream.key)
        if failing_since is not None and time.time() - failing_since > self.settings.chunk_publish_patience_s:
            LOGGER.error("Request %s: Pub/Sub did not confirm its chunks within chunk_publish_patience_s=%g; "
                         "its completion goes without them", stream.request.id, self.settings.chunk_publish_patience_s)
            self._chunk_publisher.forget(stream.key)
            return False
        return True

    def began(self, stream: Stream) -> None:
        """The model took the stream (an attempt of it) now: it shares the model's time from here."""
        with self._lock:
            self._registry.began(stream, time.time(), time.monotonic())

    def ended(self, stream: Stream) -> None:
        """The model no longer works on the stream (finished, failed or cancelled); idempotent."""
        with self._lock:
            self._registry.ended(stream, time.monotonic())

    def complete(self, stream: Stream, assembler: ChunkAssembler, finish_reason: str | None, prompt_tokens: int,
                 now: float) -> None:
        """Emits the stream's completion record (its final chunk is already cut and confirmed)."""
        self.ended(stream)
        request = stream.request
        output_json, output_error = parse_output(assembler.text, request.response_format, finish_reason)
        first_token_ms = assembler.time_to_first_token_ms
        sent_at = stream.sent_at if stream.sent_at is not None else request.received_at
        completion = Completion(
            id=request.id, attempt=stream.attempt, stream=assembler.stream, model=self.model_name,
            prompt=request.prompt,
            messages=request.messages, text=assembler.text, finish_reason=finish_reason,
            prompt_tokens=prompt_tokens, completion_tokens=assembler.tokens,
            time_to_first_token_ms=first_token_ms,
            total_ms=round((now - request.received_at) * 1000.0, 3), received_at=request.received_at,
            finished_at=now, metadata=request.metadata, output_json=output_json, output_error=output_error,
            adapter=request.adapter, queue_ms=round(max(sent_at - request.received_at, 0.0) * 1000.0, 3),
            decode_ms=None if first_token_ms is None else
            round(max((now - request.received_at) * 1000.0 - first_token_ms, 0.0), 3),
            accelerator_seconds=round(stream.accelerator_s, 6), lineage=self.backend.lineage.record(request),
            lane=request.lane_name())
        self._emit(stream, COMPLETION, completion.to_json(), final=True)

    def dead_letter(self, stream: Stream, reason: str) -> None:
        request = stream.request
        if self._chunk_publisher is not None:
            self._chunk_publisher.forget(stream.key)  # no completion will wait for its chunks
        self.ended(stream)
        consumed = round(stream.accelerator_s, 6) if stream.sent_at is not None else None  # None: never reached it
        letter = DeadLetter.of_request(STAGE_INFERENCE, reason, request, at=time.time(), accelerator_seconds=consumed)
        self._emit(stream, DEAD_LETTER, letter.to_json(), final=True)
