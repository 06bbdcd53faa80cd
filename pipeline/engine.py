"""The worker's streaming engine: many requests in flight against one server.

One engine per worker VM (shared through Beam's ``MultiProcessShared``) holds a
registry of streams (:class:`EngineBase`): ``submit_batch`` starts requests and
returns at once; ``poll`` hands back whatever chunks, completions or dead
letters have accumulated. :class:`StreamingEngine` owns the model manager's
vLLM server and streams each request to it from an asyncio loop on a background
thread; vLLM's continuous batching sees every in-flight request, so a short
request never waits for a long one. :mod:`pipeline.static_engine` is the other
engine: the model in-process, each batch generated together.

The engine holds at most ``max_in_flight`` unfinished streams: ``submit_batch``
refuses more (None for those) rather than queueing them, so a backlog waits in
the pipeline's keyed state, bounded here, and a request's ``request_timeout_s``
runs from when it is actually sent, not from when it joined a queue.

Requests and outputs cross this boundary as JSON strings, which keeps the
cross-process proxy calls cheap and version-tolerant.

With a ``chunk_topic`` the engine publishes each chunk to Pub/Sub itself the
moment it is cut (see :mod:`pipeline.chunk_publisher`), and hands a request's
completion to ``poll`` only once Pub/Sub has confirmed all its chunks.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import aiohttp

from pipeline import core_placement
from pipeline.chunk_publisher import ChunkPublisher
from pipeline.chunking import ChunkAssembler, ChunkPolicy
from pipeline.keying import bucket_index
from pipeline.messages import STAGE_INFERENCE, Chunk, Completion, DeadLetter, InferenceRequest
from pipeline.model_manager import ServerSpec, VLLMServer
from pipeline.structured_output import parse_output

LOGGER = logging.getLogger(__name__)

# Output kinds handed back by poll(); ATTEMPT says the engine retried the stream as a new attempt.
CHUNK, COMPLETION, DEAD_LETTER, UNKNOWN, ATTEMPT = "chunk", "completion", "dead_letter", "unknown", "attempt"
ENGINES = ("vllm", "transformers")


# vLLM's HTTP server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a client that reuses one
# at that moment gets "Server disconnected" (seen at 0.25 requests/s). Dropping idle connections sooner avoids it.
IDLE_CONNECTION_REUSE_S = 2.0


class RetryableError(Exception):
    """The server was unreachable or broke off; the request can be sent again."""


@dataclass(frozen=True)
class EngineSettings:
    """Everything a worker needs to serve requests; picklable into the DoFn."""

    server: ServerSpec | None  # None: use server_url (with engine "transformers": the model to load)
    server_url: str | None = None
    # "vllm": the model manager's server (or server_url); "transformers": the model in-process,
    # each batch generated together (pipeline.static_engine).
    engine: str = "vllm"
    served_model_name: str | None = None
    prompt_format: str = "chat"
    max_in_flight: int = 64
    # How long one request may take once sent, retries included (its own deadline_ms may be shorter).
    request_timeout_s: float = 600.0
    chunk_policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    # A stream that sends nothing for this long is treated as broken and retried.
    stall_timeout_s: float = 120.0
    # With these length-bucket bounds, each request carries its bucket as vLLM priority
    # (the server must run --scheduling-policy priority); None sends no priority.
    priority_boundaries: tuple[int, ...] | None = None
    # Publish chunks to this Pub/Sub topic from the engine the moment they are cut ...
    chunk_topic: str | None = None
    # ... and hand them to the pipeline through poll() as well (always, without a chunk_topic).
    chunks_to_pipeline: bool = True
    # How long a finished request waits for Pub/Sub to confirm its chunks before its completion goes anyway.
    chunk_publish_patience_s: float = 300.0
    # With vLLM on this machine's CPUs: the pipeline's processes move off the cores its compute is bound to.
    keep_pipeline_off_model_cores: bool = True

    def __post_init__(self) -> None:
        if (self.server is None) == (self.server_url is None):
            raise ValueError("give exactly one of a server spec or a server_url")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "transformers" and self.server is None:
            raise ValueError("engine 'transformers' loads the model itself: give a model spec, not a server_url")
        if self.chunk_topic is None and not self.chunks_to_pipeline:
            raise ValueError("chunks must go somewhere: give a chunk_topic or keep chunks_to_pipeline")


@dataclass
class _Stream:
    key: str
    request: InferenceRequest
    attempt: int
    outputs: list[tuple[str, str]] = field(default_factory=list)
    assembler: ChunkAssembler | None = None
    done: bool = False


class EngineBase:
    """What every engine shares: the registry of streams that ``poll`` reads, chunk publishing and outcomes.

    An engine is built once per worker (see :func:`pipeline.inference.acquire_engine`)
    and called through Beam's cross-process proxy: ``submit_batch`` starts requests
    and returns at once, ``poll`` hands back what they produced. Subclasses say how
    many of a batch they take (``_room``) and how they generate (``_start``).
    """

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self._chunk_publisher = ChunkPublisher(settings.chunk_topic) if settings.chunk_topic else None
        self._streams: dict[str, _Stream] = {}
        self._unfinished = 0  # streams not yet done: what max_in_flight bounds
        self._lock = threading.Lock()
        self._closed = False

    # Public API (called through the cross-process proxy) ----------------------------

    def submit(self, request_json: str, attempt: int = 1) -> str | None:
        """One request: its key, or None while the engine is full."""
        return self.submit_batch([request_json], [attempt])[0]

    def submit_batch(self, request_jsons: list[str], attempts: list[int]) -> list[str | None]:
        """Starts a batch of requests; for each, the key to poll it with, or None where the engine had no room.

        A key names the request's content as well as its id and attempt, so two
        different requests that share an id never share a stream. Submitting the
        same request and attempt again (a retried bundle) returns the same key.
        """
        requests = [InferenceRequest.from_json(text) for text in request_jsons]
        keys: list[str | None] = [f"{r.id}#{r.fingerprint()}#{a}" for r, a in zip(requests, attempts)]
        started: list[_Stream] = []
        with self._lock:
            new = [i for i, key in enumerate(keys) if key not in self._streams]
            room = self._room(len(new))
            for n, i in enumerate(new):
                if n >= room:
                    keys[i] = None
                    continue
                stream = _Stream(keys[i], requests[i], attempts[i])
                self._streams[stream.key] = stream
                started.append(stream)
            self._unfinished += len(started)
        if started:
            self._start(started)
        return keys

    def poll(self, keys: list[str]) -> dict[str, list[tuple[str, str]]]:
        """Outputs ready for each key, in order; finished streams are forgotten once polled."""
        now = time.time()
        ready: dict[str, list[tuple[str, str]]] = {}
        with self._lock:
            for key in keys:
                stream = self._streams.get(key)
                if stream is None:
                    ready[key] = [(UNKNOWN, "")]
                    continue
                if stream.assembler is not None and not stream.done:
                    self._queue_chunks(stream, stream.assembler.due(now))
                ready[key], stream.outputs = stream.outputs, []
                if stream.done:
                    del self._streams[key]
        return ready

    def in_flight(self) -> int:
        """Streams sent and not finished; never more than ``max_in_flight``."""
        with self._lock:
            return self._unfinished

    @property
    def chunk_publisher(self) -> ChunkPublisher | None:
        """The publisher of the chunk topic, when the engine publishes chunks itself."""
        return self._chunk_publisher

    def server_pid(self) -> int | None:
        return None

    def server_restarts(self) -> int:
        return 0

    def model_cores(self) -> frozenset[int]:
        """The cores the model computes on that the pipeline's threads should leave to it."""
        return frozenset()

    def close(self) -> None:
        self._closed = True

    # For subclasses ----------------------------------------------------------------------

    def _room(self, new: int) -> int:
        """How many of ``new`` requests to take now; called under the lock."""
        raise NotImplementedError

    def _start(self, streams: list[_Stream]) -> None:
        """Begins generating these streams (registered, counted) without waiting for them."""
        raise NotImplementedError

    def _emit(self, stream: _Stream, kind: str, payload: str, *, final: bool = False) -> None:
        with self._lock:
            stream.outputs.append((kind, payload))
            if final and not stream.done:
                stream.done = True
                self._unfinished -= 1

    def _cut(self, stream: _Stream, cut: Callable[[], list[Chunk]]) -> None:
        """Runs a step of the stream's chunk assembler and sends its chunks on, under the lock poll() cuts under.

        poll() cuts interval chunks on the caller's thread, the engine cuts the
        stream's own on its thread: one lock keeps their sequence numbers one gapless
        sequence, published in that order.
        """
        with self._lock:
            self._queue_chunks(stream, cut())

    def _queue_chunks(self, stream: _Stream, chunks: list[Chunk]) -> None:
        """Publishes and/or queues chunks for poll(); the caller holds the lock."""
        for chunk in chunks:
            if self._chunk_publisher is not None:
                self._chunk_publisher.publish(stream.key, chunk)
            if self.settings.chunks_to_pipeline:
                stream.outputs.append((CHUNK, chunk.to_json()))

    def _awaiting_chunk_confirmation(self, stream: _Stream) -> bool:
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

    def _complete(self, stream: _Stream, assembler: ChunkAssembler, finish_reason: str | None, prompt_tokens: int,
                  now: float) -> None:
        """Emits the stream's completion record (its final chunk is already cut and confirmed)."""
        request = stream.request
        output_json, output_error = parse_output(assembler.text, request.response_format, finish_reason)
        completion = Completion(
            id=request.id, attempt=stream.attempt, model=self.model_name, prompt=request.prompt,
            messages=request.messages, text=assembler.text, finish_reason=finish_reason,
            prompt_tokens=prompt_tokens, completion_tokens=assembler.tokens,
            time_to_first_token_ms=assembler.time_to_first_token_ms,
            total_ms=round((now - request.received_at) * 1000.0, 3), received_at=request.received_at,
            finished_at=now, metadata=request.metadata, output_json=output_json, output_error=output_error)
        self._emit(stream, COMPLETION, completion.to_json(), final=True)

    def _dead_letter(self, stream: _Stream, reason: str) -> None:
        request = stream.request
        if self._chunk_publisher is not None:
            self._chunk_publisher.forget(stream.key)  # no completion will wait for its chunks
        letter = DeadLetter(STAGE_INFERENCE, reason, request.to_json(), id=request.id, at=time.time())
        self._emit(stream, DEAD_LETTER, letter.to_json(), final=True)


class StreamingEngine(EngineBase):
    """Hosts the vLLM server (if managed) and streams requests to it concurrently."""

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        self._server: VLLMServer | None = None
        if settings.server is not None:
            self._server = VLLMServer(settings.server).start()
            self.base_url = self._server.base_url
        else:
            self.base_url = settings.server_url.rstrip("/")
        self.model_name = settings.served_model_name or self._discover_model_name()
        self._model_cores = self._find_model_cores()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="engine-loop", daemon=True)
        self._loop_thread.start()
        self._semaphore = asyncio.run_coroutine_threadsafe(self._make_semaphore(), self._loop).result()
        self._session: aiohttp.ClientSession | None = None
        atexit.register(self.close)

    async def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.settings.max_in_flight)

    def _find_model_cores(self) -> frozenset[int]:
        """The cores this machine's vLLM binds its compute to (none with a GPU, or a server elsewhere).

        Read from the server's threads, not from torch: importing torch here cost the pipeline's
        process 180 MiB (measured), and a GPU vLLM binds no threads.
        """
        if not self.settings.keep_pipeline_off_model_cores:
            return frozenset()
        if self._server is not None:
            pid = self._server.pid
        else:
            url = urllib.parse.urlsplit(self.base_url)
            local = url.hostname in ("localhost", "127.0.0.1", "::1") and url.port is not None
            pid = core_placement.listening_pid(url.port) if local else None
        return core_placement.bound_cores(pid) if pid is not None else frozenset()

    def _discover_model_name(self) -> str:
        if self.settings.server is not None:
            return self.settings.server.model_name
        with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=30) as response:
            models = json.load(response)["data"]
        if not models:
            raise RuntimeError(f"{self.base_url} serves no models")
        return models[0]["id"]

    def server_pid(self) -> int | None:
        return self._server.pid if self._server else None

    def server_restarts(self) -> int:
        return self._server.stats.restarts if self._server else 0

    def model_cores(self) -> frozenset[int]:
        return self._model_cores

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._server is not None:
            self._server.stop()

    def _room(self, new: int) -> int:
        return max(self.settings.max_in_flight - self._unfinished, 0)  # vLLM batches continuously: any that fit

    def _start(self, streams: list[_Stream]) -> None:
        for stream in streams:
            asyncio.run_coroutine_threadsafe(self._run(stream.key), self._loop)

    # Streaming ---------------------------------------------------------------------

    async def _chunks_confirmed(self, stream: _Stream) -> None:
        while self._awaiting_chunk_confirmation(stream):
            await asyncio.sleep(0.002)

    async def _run(self, key: str) -> None:
        stream = self._streams[key]
        request = stream.request
        last_error = "no attempt was made"
        delay = 0.5
        async with self._semaphore:
            deadline = time.time() + self.settings.request_timeout_s  # from sending, not from queueing
            limit = f"request_timeout_s={self.settings.request_timeout_s:g}"
            if request.deadline_ms is not None:
                own_deadline = request.received_at + request.deadline_ms / 1000
                if own_deadline < deadline:
                    deadline, limit = own_deadline, f"its deadline_ms={request.deadline_ms}"
            while time.time() < deadline:
                try:
                    await asyncio.wait_for(self._stream_once(stream, deadline), timeout=deadline - time.time())
                    return
                except TimeoutError:
                    last_error = "generation was still running"
                    break
                except RetryableError as exc:
                    last_error = str(exc)
                except _RequestRejected as exc:
                    self._dead_letter(stream, f"the server rejected the request: {exc}")
                    return
                except Exception as exc:  # a bug must not leave a request without an outcome
                    LOGGER.exception("Unexpected error streaming request %s", request.id)
                    self._dead_letter(stream, f"internal error: {type(exc).__name__}: {exc}")
                    return
                if stream.assembler is not None and stream.assembler.chunks_emitted > 0:
                    # Chunks of this attempt are already out: restart as a new attempt.
                    with self._lock:
                        stream.attempt += 1
                        stream.outputs.append((ATTEMPT, str(stream.attempt)))
                LOGGER.warning("Request %s: %s; retrying in %.1f s", request.id, last_error, delay)
                await asyncio.sleep(min(delay, max(deadline - time.time(), 0)))
                delay = min(delay * 2, 10.0)
        self._dead_letter(stream, f"no answer within {limit}: {last_error}")

    async def _stream_once(self, stream: _Stream, deadline: float) -> None:
        request = stream.request
        await self._wait_for_server(deadline)
        assembler = ChunkAssembler(request.id, stream.attempt, self.settings.chunk_policy, request.received_at)
        with self._lock:
            stream.assembler = assembler
        path, payload = self._payload(request)
        session = await self._get_session()
        prompt_tokens, tokens, finish_reason, finished = 0, 0, None, False
        try:
            async with session.post(f"{self.base_url}{path}", json=payload) as response:
                if response.status >= 400:
                    body = (await response.text())[:2000]
                    if response.status in (408, 429) or response.status >= 500:
                        raise RetryableError(f"HTTP {response.status}: {body}")
                    raise _RequestRejected(f"HTTP {response.status}: {_error_message(body)}")
                async for event in _sse_events(response.content):
                    usage = event.get("usage") or {}
                    prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                    for choice in event.get("choices") or ():
                        delta = choice.get("text")
                        if delta is None:
                            delta = (choice.get("delta") or {}).get("content") or ""
                        tokens = usage.get("completion_tokens", tokens + (1 if delta else 0))
                        self._cut(stream, lambda: assembler.add(delta, tokens, time.time()))
                        finish_reason = choice.get("finish_reason") or finish_reason
                        finished = finished or choice.get("finish_reason") is not None
                    if not event.get("choices") and usage:
                        tokens = usage.get("completion_tokens", tokens)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc or 'connection lost'}") from exc
        if not finished:
            raise RetryableError("the stream ended before a finish reason")
        now = time.time()
        self._cut(stream, lambda: [assembler.finish(finish_reason, tokens, now)])
        await self._chunks_confirmed(stream)
        self._complete(stream, assembler, finish_reason, prompt_tokens, now)

    def _payload(self, request: InferenceRequest) -> tuple[str, dict[str, Any]]:
        payload: dict[str, Any] = {
            "model": self.model_name, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        for name in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                     "response_format"):
            if getattr(request, name) is not None:
                payload[name] = getattr(request, name)
        if request.stop:
            payload["stop"] = list(request.stop)
        if self.settings.priority_boundaries is not None and request.prompt_tokens is not None:
            payload["priority"] = bucket_index(self.settings.priority_boundaries, request.prompt_tokens)
        if request.messages is not None or self.settings.prompt_format == "chat":
            payload["messages"] = list(request.messages or [{"role": "user", "content": request.prompt}])
            return "/v1/chat/completions", payload
        payload["prompt"] = request.prompt
        return "/v1/completions", payload

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.settings.stall_timeout_s)
            connector = aiohttp.TCPConnector(limit=self.settings.max_in_flight + 8,
                                             keepalive_timeout=IDLE_CONNECTION_REUSE_S)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    async def _wait_for_server(self, deadline: float) -> None:
        if self._server is None:
            return
        while not self._server.healthy:
            if time.time() > deadline:
                raise RetryableError("the model server is not healthy (restarting or failed to start)")
            await asyncio.sleep(0.5)


class _RequestRejected(Exception):
    """The server refused the request itself (HTTP 4xx); sending it again will not help."""


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body
    error = data.get("error", data)
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


async def _sse_events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events of an OpenAI-style stream, until ``[DONE]``."""
    async for raw in content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event and "choices" not in event:
            raise _RequestRejected(_error_message(data))
        yield event
