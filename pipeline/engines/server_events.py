"""What an OpenAI-compatible server streams, as the vLLM engine reads it: server-sent events until ``[DONE]``, and
what each way of failing means for the request. Kept apart from the engine (:mod:`pipeline.engines.vllm_engine`),
which decides what to do: send the request again, or end it with a dead letter.

vLLM 0.32 turns any exception in its stream generator into an ``{"error": ...}`` event whose ``code`` is the HTTP
status it would have answered (``vllm/entrypoints/serve/exception_handling/error_response.py``): a 4xx refuses the
request for what it is, anything else is the server failing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


class RetryableError(Exception):
    """The server was unreachable or broke off; the request can be sent again."""


class RequestRejected(Exception):
    """The server refused the request itself (HTTP 4xx); sending it again will not help."""


class StreamIntervalRefused(Exception):
    """The server refused ``stream_interval`` itself (a server without it that checks fields): ask per token."""


def error_message(body: str) -> str:
    """The message of an error body the server answered or streamed (OpenAI's ``{"error": {"message": ...}}``)."""
    try:
        error = json.loads(body)
    except json.JSONDecodeError:
        return body
    error = error.get("error", error) if isinstance(error, dict) else error
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


async def sse_events(content: aiohttp.StreamReader,
                     response: aiohttp.ClientResponse | None = None) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events of an OpenAI-style stream, until ``[DONE]``. Cancelled while reading (the stream was
    abandoned), it closes the connection, not returns it to the pool: a closed connection makes vLLM abort it."""
    try:
        async for event in events(content):
            yield event
    except asyncio.CancelledError:
        if response is not None:
            response.close()
        raise


async def events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The events of a stream; an error event raises :class:`RequestRejected` or :class:`RetryableError`."""
    async for raw in content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event and "choices" not in event:
            if refused(event["error"]):
                raise RequestRejected(error_message(data))
            # The server failed while it streamed (vLLM turns any exception in its generator into this event):
            # the request was not refused for what it is, and is sent again.
            raise RetryableError(f"the server failed mid-stream: {error_message(data)}")
        yield event


def refused(error: Any) -> bool:
    """Whether an error event the server streamed refuses the request for what it is: a 4xx code (vLLM's
    ``ErrorResponse`` carries the HTTP status it would have answered), or a bad request by its type."""
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        return 400 <= code < 500 and code not in (408, 429)
    return str(error.get("type", "")).lower() in ("badrequesterror", "bad_request", "invalid_request_error")
