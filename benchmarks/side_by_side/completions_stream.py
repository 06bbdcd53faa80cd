"""The streaming completions request that raw vLLM and the Pub/Sub relay both make, read event by event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp

from pipeline.engines.vllm_engine import IDLE_CONNECTION_REUSE_S


def session(timeout_s: float) -> aiohttp.ClientSession:
    """A client session that never reuses a connection the server may be closing (see IDLE_CONNECTION_REUSE_S)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(keepalive_timeout=IDLE_CONNECTION_REUSE_S))


async def completion_events(session: aiohttp.ClientSession, base_url: str, model: str, prompt: str,
                            max_tokens: int, min_tokens: int | None = None,
                            stream_interval: int | None = None) -> AsyncIterator[dict]:
    """Each server-sent event of a greedy streaming ``POST /v1/completions`` with usage at the end, parsed.

    ``min_tokens`` (vLLM's) equal to ``max_tokens`` fixes the answer's length; ``stream_interval`` (vLLM's)
    asks for one event per that many tokens after the first.
    """
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}}
    if min_tokens is not None:
        payload["min_tokens"] = min_tokens
    if stream_interval is not None:
        payload["stream_interval"] = stream_interval
    async with session.post(f"{base_url}/v1/completions", json=payload) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])
