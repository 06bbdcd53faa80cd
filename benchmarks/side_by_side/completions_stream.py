"""The streaming completions request that raw vLLM and the Pub/Sub relay both make, read event by event."""

from __future__ import annotations

import json
from typing import AsyncIterator

import aiohttp


async def completion_events(session: aiohttp.ClientSession, base_url: str, payload: dict) -> AsyncIterator[dict]:
    """Each server-sent event of ``POST /v1/completions`` (``payload`` with ``"stream": true``), parsed."""
    async with session.post(f"{base_url}/v1/completions", json=payload) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])
