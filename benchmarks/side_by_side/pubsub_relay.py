"""vLLM behind Pub/Sub with nothing between: the floor for any Pub/Sub-fed pipeline.

Raw vLLM's time to first token leaves out the two Pub/Sub hops every
Pub/Sub-fed system pays (publish → intake, chunk → subscriber). This relay
pays them and nothing else: a streaming-pull subscriber hands each prompt
straight to a streaming request (asyncio, one client session), and each chunk
is published the moment it is cut, by the template's default chunk policy
(``chunk_tokens``, ``chunk_interval_ms``), then the completion (ordering key =
id, 1 ms batching, like the template's chunk publisher): as many messages as
the template sends, since on a machine that also runs the Pub/Sub emulator each
costs CPU. The template's overhead of its own is then the difference between
it and this, hop by hop. Records carry the
fields the template's do for the benchmark's hops (``received_at``,
``time_to_first_token_ms``, ``emitted_at``).

    python -m benchmarks.side_by_side.pubsub_relay --input_subscription=... --chunks_topic=... \
        --completions_topic=... --base_url=http://127.0.0.1:8000 --model=NAME --max_tokens=96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import threading
import time

import aiohttp

from benchmarks.side_by_side.completions_stream import completion_events
from benchmarks.side_by_side.completions_stream import session as client_session
from pipeline.contract.chunking import ChunkAssembler, ChunkPolicy
from pipeline.contract.messages import Chunk
from pipeline.contract.parameters import PARAMETERS_BY_NAME

# The template's defaults, so that the relay publishes as many chunks as the template does.
CHUNK_POLICY = ChunkPolicy(PARAMETERS_BY_NAME["chunk_tokens"].default,
                           float(PARAMETERS_BY_NAME["chunk_interval_ms"].default))

LOGGER = logging.getLogger(__name__)


class Relay:
    """Pulls prompts, streams each from the server on one event loop, publishes each chunk as soon as it is cut."""

    def __init__(self, args: argparse.Namespace) -> None:
        from google.cloud import pubsub_v1

        self._args = args
        self._publisher = pubsub_v1.PublisherClient(
            batch_settings=pubsub_v1.types.BatchSettings(max_latency=0.001),
            publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True))
        self._subscriber = pubsub_v1.SubscriberClient()
        self._loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None

    def _publish(self, topic: str, data: str, request_id: str) -> None:
        self._publisher.publish(topic, data.encode(), ordering_key=request_id)

    def _publish_chunks(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self._publish(self._args.chunks_topic, chunk.to_json(), chunk.id)

    async def _serve(self, request: dict, received_at: float) -> None:
        args = self._args
        assembler = ChunkAssembler(request["id"], 1, CHUNK_POLICY, received_at)
        tokens, finish_reason = 0, None
        async for event in completion_events(self._session, args.base_url, args.model, request["prompt"],
                                             request.get("max_tokens", args.max_tokens), request.get("min_tokens")):
            if event.get("choices"):
                choice = event["choices"][0]
                text = choice.get("text") or ""
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens + (1 if text else 0))
                self._publish_chunks(assembler.add(text, tokens, time.time()))
                finish_reason = choice.get("finish_reason") or finish_reason
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        self._publish_chunks([assembler.finish(finish_reason, tokens, time.time())])
        self._publish(args.completions_topic, json.dumps({
            "id": request["id"], "text": assembler.text, "usage": {"completion_tokens": tokens},
            "received_at": received_at, "time_to_first_token_ms": assembler.time_to_first_token_ms}), request["id"])

    def _on_message(self, message) -> None:
        received_at = time.time()
        message.ack()
        future = asyncio.run_coroutine_threadsafe(self._serve(json.loads(message.data), received_at), self._loop)
        future.add_done_callback(_log_failure)

    def run(self, stop: threading.Event) -> None:
        async def open_session() -> None:
            self._session = client_session(900)

        threading.Thread(target=self._loop.run_forever, name="relay-loop", daemon=True).start()
        asyncio.run_coroutine_threadsafe(open_session(), self._loop).result()
        pull = self._subscriber.subscribe(self._args.input_subscription, callback=self._on_message)
        stop.wait()
        pull.cancel()
        self._publisher.stop()
        asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def _log_failure(done) -> None:
    if not done.cancelled() and done.exception() is not None:  # the run then misses this answer and says so
        LOGGER.error("request failed: %r", done.exception())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("input_subscription", "chunks_topic", "completions_topic", "base_url", "model"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--max_tokens", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    Relay(args).run(stop)


if __name__ == "__main__":
    main()
