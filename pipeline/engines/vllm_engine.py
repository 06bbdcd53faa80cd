"""The vLLM engine: many requests in flight against one OpenAI-compatible server.

:class:`VLLMBackend` is the engine's backend (:mod:`pipeline.engines.backend`) for vLLM, and :func:`vllm_engine`
the engine over it. It owns the model manager's server (or calls ``server_url``) and streams each request to it
from an asyncio loop on a background thread; vLLM's continuous batching sees every in-flight request, so a short
request never waits for a long one. Each server-sent event is cut into chunks by the request's
:class:`~pipeline.contract.chunking.ChunkAssembler`.

The engine asks vLLM for the events it will publish: a request carries ``stream_interval`` = ``chunk_tokens``
(vLLM sends the first token at once, then one event per that many tokens, and the last at once), so neither the
server's API front end nor this client turns every token into an HTTP event only for the assembler to regroup
them. A server that refuses the field is asked per token from then on, after one warning.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import logging
import threading
import time
from typing import Any

import aiohttp

from pipeline.contract.chunking import ChunkAssembler
from pipeline.contract.messages import REFUSED_BY_SERVER, InferenceRequest
from pipeline.contract.request_fields import SENT_TO_SERVER
from pipeline.engines.adapter_slots import AdapterSlots
from pipeline.engines.backend import ServerLoad, StreamEvents
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.server_events import (
    RequestRejected,
    RetryableError,
    StreamIntervalRefused,
    error_message,
    sse_events,
)
from pipeline.engines.stream_registry import Stream
from pipeline.serving.adapter_root import AdapterUnavailable, AdapterUnreadable, root_fetch
from pipeline.serving.lineage import ServingLineage, adapter_lineage, after_restart, seed_for, server_lineage
from pipeline.serving.vllm_server import (
    RUNNING_METRIC,
    WAITING_METRIC,
    VLLMServer,
    optional_server_json,
    server_json,
    server_metrics,
)

LOGGER = logging.getLogger(__name__)

# vLLM's HTTP server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a client that reuses one
# at that moment gets "Server disconnected" (seen at 0.25 requests/s). Dropping idle connections sooner avoids it.
IDLE_CONNECTION_REUSE_S = 2.0
SERVER_LOAD_INTERVAL_S = 1.0  # how often the engine reads the server's own load gauges
SHED_POLL_S = 0.05  # how often a stream the bulk lane shed asks whether it may run again
LINEAGE_RETRY_S = 10.0  # a restarted server's lineage that failed to read is read again no sooner than this


def vllm_engine(settings: EngineSettings) -> Engine:
    """The engine over a vLLM server: the one ``settings.server`` manages, or the one at ``settings.server_url``."""
    return Engine(settings, VLLMBackend)


class VLLMBackend:
    """Hosts the vLLM server (if managed) and streams requests to it concurrently."""

    whole_batches = False  # any requests that fit are taken: the server batches continuously
    preempts = True  # an attempt is a connection: closing it makes vLLM abort the request, and the next starts over

    def __init__(self, settings: EngineSettings, events: StreamEvents) -> None:
        # The server first: a backend whose server never answers (a rebuild that fails, again and again) must leave
        # nothing behind, so its threads start only once it has answered, and the engine's after them.
        self.settings = settings
        self._events = events
        self._closed = False
        self._server: VLLMServer | None = None
        if settings.server is not None:
            self._server = VLLMServer(settings.server)
            self.base_url = self._server.base_url
        else:
            assert settings.server_url is not None, "EngineSettings gives a server spec or a server_url"
            self.base_url = settings.server_url.rstrip("/")
        try:
            if self._server is not None:
                self._server.start()
            self.model_name = settings.served_model_name or self._discover_model_name(settings)
            self.lineage = self._read_lineage(settings)
        except BaseException:
            if self._server is not None:
                self._server.stop()
            raise
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="engine-loop", daemon=True)
        self._loop_thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, concurrent.futures.Future] = {}
        self._attempts: dict[str, asyncio.Task[None]] = {}  # each running stream's attempt (on the loop)
        self._server_load_cache: ServerLoad = (None, None)
        self._load_reader = threading.Thread(target=self._read_server_load, name="engine-server-load", daemon=True)
        self._load_reader.start()
        # vLLM's stream_interval: events of chunk_tokens tokens each, until a server refuses the field (None: every
        # token).
        self._stream_interval = settings.chunk_policy.chunk_tokens if settings.chunk_policy.chunk_tokens > 1 else None
        # A root's adapters (lora_adapter_root), loaded into the server on first use; those of lora_adapters it
        # loaded when it started.
        self._adapter_slots: AdapterSlots | None = None
        spec = settings.server
        self._static_adapters = frozenset(adapter.name for adapter in spec.adapters) if spec else frozenset()
        self._server_starts = self._server.stats.starts if self._server else 0
        self._lineage_read: asyncio.Future[None] | None = None  # a restarted server's lineage, being read
        self._lineage_stale = False  # the last read of a restarted server's lineage failed: read again
        self._lineage_failed_at = float("-inf")  # when it failed (monotonic): read again no sooner than a while
        self._lineage_reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-lineage")
        if spec is not None and spec.adapter_root is not None and self._server is not None:
            fetch = root_fetch(spec.adapter_root, model_folder=self._server.model_path, cache_dir=spec.model_cache_dir,
                               max_lora_rank=spec.max_lora_rank, disk_gb=spec.adapter_disk_gb,
                               base_model=spec.model if spec.lora_base_model_check else None,
                               also_base=spec.lora_base_model,
                               in_use=lambda: slots.needing_copies(), keep=self._server.local_paths)
            self._adapter_slots = slots = AdapterSlots(spec.root_adapters, fetch, self._load_adapter,
                                                       self._unload_adapter)
        atexit.register(self.close)

    def _discover_model_name(self, settings: EngineSettings) -> str:
        if settings.server is not None:
            return settings.server.model_name
        models = server_json(f"{self.base_url}/v1/models").get("data")
        if not models:
            raise RuntimeError(f"{self.base_url} serves no models")
        return models[0]["id"]

    def _read_lineage(self, settings: EngineSettings, strict: bool = False) -> ServingLineage:
        """What the server loaded, as it says itself (``/version``, ``/v1/models``) and, managed, as its engine
        logged it (:func:`~pipeline.serving.lineage.server_lineage`); ``strict``: raises where it does not say."""
        read = server_json if strict else optional_server_json
        listed = read(f"{self.base_url}/v1/models").get("data")
        cards = {card["id"]: card for card in (listed if isinstance(listed, list) else [])
                 if isinstance(card, dict) and isinstance(card.get("id"), str)}
        spec, server = settings.server, self._server
        return server_lineage(
            cards, self.model_name, read(f"{self.base_url}/version").get("version"),
            model=spec.model if spec else None, adapters={a.name: a.location for a in spec.adapters} if spec else {},
            prompt_format=settings.prompt_format, image=settings.image, server_args=spec.extra_args if spec else (),
            loaded=server.loaded if server else None, command=server.command if server else ())

    async def _refresh_lineage(self) -> None:
        """A restarted server's lineage: read on a thread of its own, adopted on the loop unless a newer one started."""
        starts = self._server.stats.starts if self._server else 0
        try:
            fresh = await asyncio.get_running_loop().run_in_executor(self._lineage_reader, self._read_lineage,
                                                                     self.settings, True)
        except Exception:  # noqa: BLE001 - the answers keep the lineage read before, until a read succeeds
            LOGGER.exception("Reading the restarted server's lineage failed; answers keep the one read before, and "
                             "the next stream reads it again")
            self._lineage_stale, self._lineage_failed_at = True, time.monotonic()
            return
        if (self._server.stats.starts if self._server else 0) == starts:
            self._lineage_stale = False
            self.lineage = after_restart(fresh, self.lineage, self._static_adapters)  # one assignment

    def restarts(self) -> int:
        return self._server.stats.restarts if self._server else 0

    def stats(self) -> dict[str, int | None]:
        return {}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():  # a loop that no longer runs has nothing to end
            asyncio.run_coroutine_threadsafe(self._shut_down(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._server is not None:
            self._server.stop()

    async def _shut_down(self) -> None:
        """Ends the streams still running (their connections close, so the server stops them too) before the loop
        stops: a task left pending on a stopped loop is only destroyed, with a warning, when it is collected."""
        running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def load(self) -> ServerLoad:
        return self._server_load_cache

    def _read_server_load(self) -> None:
        """vLLM's running and waiting gauges, read every :data:`SERVER_LOAD_INTERVAL_S` (None while it does not
        answer) on a thread of their own: a work item waiting on a busy server's ``/metrics`` would poll none of its
        streams, whose leases then run out (:mod:`pipeline.engines.leases`)."""
        while not self._closed:
            try:
                figures = server_metrics(self.base_url, timeout_s=SERVER_LOAD_INTERVAL_S)
                self._server_load_cache = (int(figures[RUNNING_METRIC]), int(figures[WAITING_METRIC]))
            except (OSError, ValueError):
                self._server_load_cache = (None, None)
            time.sleep(SERVER_LOAD_INTERVAL_S)

    def start(self, streams: list[Stream]) -> None:
        for stream in streams:
            task = asyncio.run_coroutine_threadsafe(self._run(stream), self._loop)
            self._tasks[stream.key] = task
            task.add_done_callback(functools.partial(self._forget_task, stream.key))

    def _forget_task(self, key: str, task: concurrent.futures.Future) -> None:
        if self._tasks.get(key) is task:  # not a newer stream's under the same key
            self._tasks.pop(key, None)

    def cancel(self, streams: list[Stream]) -> None:
        """Cancels the streams' tasks: their connections close, and vLLM aborts a request whose client left."""
        for stream in streams:
            task = self._tasks.get(stream.key)
            if task is not None:
                task.cancel()

    def preempt(self, streams: list[Stream]) -> None:
        """Stops the streams' attempts (their connections close, so vLLM aborts them); each starts over when the
        engine lets it (:meth:`_run`)."""
        for stream in streams:  # (an answer made whole since the shed goes on: it holds no row at the server)
            self._loop.call_soon_threadsafe(self._stop_attempt, stream)

    def _stop_attempt(self, stream: Stream) -> None:
        if (attempt := self._attempts.get(stream.key)) and not (stream.assembler and stream.assembler.finished):
            attempt.cancel()

    # Streaming ---------------------------------------------------------------------

    async def _chunks_confirmed(self, stream: Stream) -> None:
        while self._events.chunks_pending(stream):
            await asyncio.sleep(0.002)

    async def _run(self, stream: Stream) -> None:
        request = stream.request
        last_error = "no attempt was made"
        delay = 0.5
        timed_out_at = time.time() + self.settings.request_timeout_s  # from sending, not from queueing
        own = float("inf") if request.deadline_ms is None else request.received_at + request.deadline_ms / 1000
        while True:
            timed_out_at += await self._while_shed(stream, own)  # time shed is not the server's (its own holds)
            deadline = min(timed_out_at, own)
            limit = f"request_timeout_s={self.settings.request_timeout_s:g}" if deadline < own else \
                f"its deadline_ms={request.deadline_ms}"
            if time.time() >= deadline:
                break
            attempt, began = asyncio.ensure_future(self._stream_once(stream, deadline)), time.time()
            self._attempts[stream.key] = attempt
            try:
                await asyncio.wait_for(attempt, timeout=deadline - time.time())
                return
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is None or current.cancelling() or not attempt.cancelled():
                    raise  # the stream itself was cancelled, not the attempt
                self._events.restart(stream)  # shed by the bulk lane: starts over when it has room
                timed_out_at += time.time() - began  # an attempt thrown away by a shed is not its time either
                continue
            except TimeoutError:
                last_error = "generation was still running"
                break
            except RetryableError as exc:
                last_error = str(exc)
            except StreamIntervalRefused as exc:
                if self._stream_interval is not None:
                    self._stream_interval = None
                    LOGGER.warning("The model server refused stream_interval (%s); streaming every token from "
                                   "now on, which costs more CPU per token on both sides", exc)
                continue  # at once: nothing was generated
            except RequestRejected as exc:
                self._events.dead_letter(stream, f"{REFUSED_BY_SERVER}: {exc}")
                return
            except Exception as exc:  # a bug must not leave a request without an outcome
                LOGGER.exception("Unexpected error streaming request %s", request.id)
                self._events.dead_letter(stream, f"internal error: {type(exc).__name__}: {exc}")
                return
            finally:
                if self._attempts.get(stream.key) is attempt:
                    del self._attempts[stream.key]
            self._events.restart(stream)
            LOGGER.warning("Request %s: %s; retrying in %.1f s", request.id, last_error, delay)
            await asyncio.sleep(min(delay, max(deadline - time.time(), 0)))
            delay = min(delay * 2, 10.0)
        self._events.dead_letter(stream, f"no answer within {limit}: {last_error}")

    async def _while_shed(self, stream: Stream, own_deadline: float) -> float:
        started = time.monotonic()  # returns how long the bulk lane kept the stream shed (s), its deadline at most
        while time.time() < own_deadline and not self._events.may_run(stream):
            await asyncio.sleep(SHED_POLL_S)
        return time.monotonic() - started

    async def _stream_once(self, stream: Stream, deadline: float) -> None:
        await self._wait_for_server(deadline)
        if self._server is not None and self._server.stats.starts != self._server_starts:
            self._server_starts = self._server.stats.starts  # a new server, which holds no root adapter yet
            if self._adapter_slots is not None:
                self._adapter_slots.forget()
            self._lineage_read = asyncio.ensure_future(self._refresh_lineage())
        elif self._lineage_stale and self._lineage_read is not None and self._lineage_read.done() \
                and time.monotonic() - self._lineage_failed_at >= LINEAGE_RETRY_S:
            self._lineage_read = asyncio.ensure_future(self._refresh_lineage())  # the last read failed: again
        if self._lineage_read is not None and not self._lineage_read.done():
            await asyncio.shield(self._lineage_read)  # what this stream's answer records comes from the new server
        adapter = stream.request.adapter
        if self._adapter_slots is None or adapter is None or adapter in self._static_adapters:
            await self._stream_from_server(stream)
            return
        try:
            load = await self._adapter_slots.acquire(adapter, bulk=stream.request.bulk)
        except AdapterUnavailable as exc:
            raise RequestRejected(str(exc)) from None
        except (TimeoutError, aiohttp.ClientError, ConnectionError, AdapterUnreadable) as exc:
            raise RetryableError(f"loading adapter {adapter}: {type(exc).__name__}: {exc}") from exc
        try:
            await self._stream_from_server(stream)
        except RequestRejected as exc:
            if not str(exc).startswith("HTTP 404"):
                raise
            self._adapter_slots.forget_one(adapter, load)  # the server lost it (a restart in between): loaded again
            raise RetryableError(f"the server no longer had adapter {adapter}: {exc}") from exc
        finally:
            self._adapter_slots.release(adapter, load)

    async def _load_adapter(self, name: str, path: str) -> None:
        """Loads a root's adapter into the server from ``path``; one the server refuses is a dead letter with its
        reason. One the server still holds (an unload that failed) is unloaded and loaded again from ``path``, so
        that what it serves is the copy the lineage records, not an older one."""
        session = await self._get_session()
        for attempt in range(2):
            async with session.post(f"{self.base_url}/v1/load_lora_adapter",
                                    json={"lora_name": name, "lora_path": path}) as response:
                body = (await response.text())[:2000]
                if response.status >= 500 or response.status in (408, 429):
                    raise RetryableError(f"loading adapter {name}: HTTP {response.status}: {body}")
                if response.status < 400:
                    break
                if "already been loaded" not in body or attempt:
                    raise AdapterUnavailable(f"adapter {name!r}: the server refused it: {error_message(body)}")
            LOGGER.warning("The server still held adapter %s (an unload that failed): unloading it to load %s", name,
                           path)
            try:
                await self._unload_adapter(name)
            except RuntimeError as exc:
                raise RetryableError(f"unloading adapter {name} to load it again: {exc}") from exc
        spec = self.settings.server
        assert spec is not None and spec.adapter_root is not None
        self.lineage.adapters[name] = await asyncio.get_running_loop().run_in_executor(  # a digest of every file
            None, adapter_lineage, spec.adapter_root.location_of(name), path)
        LOGGER.info("Loaded adapter %s from %s", name, path)

    async def _unload_adapter(self, name: str) -> None:
        session = await self._get_session()
        async with session.post(f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": name}) as response:
            if response.status >= 400:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        loaded = self._adapter_slots.loaded() if self._adapter_slots else []
        LOGGER.info("Unloaded adapter %s, the least recently used (loaded again on its next use); loaded now: %s",
                    name, ", ".join(loaded) or "none")

    async def _stream_from_server(self, stream: Stream) -> None:
        request = stream.request
        assembler = ChunkAssembler(request.id, stream.attempt, self.settings.chunk_policy, request.received_at)
        self._events.attach(stream, assembler)
        path, payload = self.payload(request)
        session = await self._get_session()
        prompt_tokens, tokens, finish_reason, finished = 0, 0, None, False
        try:
            async with session.post(f"{self.base_url}{path}", json=payload) as response:
                self._events.began(stream)  # the server answered: it has the request (vLLM answers before it generates)
                if response.status >= 400:
                    body = (await response.text())[:2000]
                    if response.status in (401, 403, 408, 429) or response.status >= 500:  # 401/403: a proxy's
                        raise RetryableError(f"HTTP {response.status}: {body}")
                    if "stream_interval" in payload and "stream_interval" in body:
                        raise StreamIntervalRefused(f"HTTP {response.status}: {error_message(body)}")
                    raise RequestRejected(f"HTTP {response.status}: {error_message(body)}")
                async for event in sse_events(response.content, response):
                    usage = event.get("usage") or {}
                    prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                    for choice in event.get("choices") or ():
                        delta = choice.get("text")
                        if delta is None:
                            delta = (choice.get("delta") or {}).get("content") or ""
                        tokens = usage.get("completion_tokens", tokens + (1 if delta else 0))
                        # cut runs the step at once, under its lock: the loop's variables are the ones meant.
                        self._events.cut(stream, lambda: assembler.add(delta, tokens, time.time()))  # noqa: B023
                        finish_reason = choice.get("finish_reason") or finish_reason
                        finished = finished or choice.get("finish_reason") is not None
                    if not event.get("choices") and usage:
                        tokens = usage.get("completion_tokens", tokens)
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc or 'connection lost'}") from exc
        finally:
            self._events.ended(stream)  # the server is done with this attempt, however it ended (a cancel included)
        if not finished:
            raise RetryableError("the stream ended before a finish reason")
        now = time.time()
        self._events.cut(stream, lambda: [assembler.finish(finish_reason, tokens, now)])
        await self._chunks_confirmed(stream)
        self._events.complete(stream, assembler, finish_reason, prompt_tokens, now)

    def payload(self, request: InferenceRequest) -> tuple[str, dict[str, Any]]:
        """The API path and body this request is streamed with."""
        payload: dict[str, Any] = {
            "model": request.adapter or self.model_name, "stream": True,  # vLLM picks a LoRA adapter by name
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        for name in SENT_TO_SERVER:
            if getattr(request, name) is not None:
                payload[name] = getattr(request, name)
        seed = seed_for(request)  # its own, or one drawn from its id, as its lineage records
        if seed is not None:
            payload["seed"] = seed
        if request.stop:
            payload["stop"] = list(request.stop)
        if self._stream_interval is not None:
            payload["stream_interval"] = self._stream_interval
        priority = self.settings.priority_of(request)
        if priority is not None:
            payload["priority"] = priority
        if self._adapter_slots is not None and request.adapter not in self._static_adapters and \
                (salt := self.lineage.cache_salt(request.adapter)) is not None:  # a root's: copied again when changed
            payload["cache_salt"] = salt
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
