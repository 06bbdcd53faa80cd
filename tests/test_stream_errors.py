"""What the vLLM engine makes of an error the server streams mid-answer (pipeline/engines/server_events.py): vLLM
0.32 turns any exception in its stream generator into an ``{"error": ...}`` event whose ``code`` is the HTTP status
it would have answered (``vllm/entrypoints/serve/exception_handling/error_response.py``). A 4xx refuses the request
for what it is (a dead letter the backfill does not publish again); anything else is the server failing, and the
request is sent again."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.engines.server_events import RequestRejected, RetryableError, events


def stream(*events: dict) -> object:
    async def lines():
        yield b'data: {"choices": [{"index": 0, "text": "Hel"}]}\n'
        for event in events:
            yield f"data: {json.dumps(event)}\n".encode()
        yield b"data: [DONE]\n"
    return lines()


async def read(content) -> list[dict]:
    return [event async for event in events(content)]


@pytest.mark.parametrize("error, raised", [
    ({"message": "prompt too long", "type": "BadRequestError", "code": 400}, RequestRejected),
    ({"message": "no such adapter", "type": "NotFoundError", "code": 404}, RequestRejected),
    ({"message": "bad schema", "type": "UnprocessableEntityError", "code": 422}, RequestRejected),
    ({"message": "EngineCore died", "type": "InternalServerError", "code": 500}, RetryableError),
    ({"message": "busy", "type": "ServiceUnavailableError", "code": 503}, RetryableError),
    ({"message": "slow down", "type": "TooManyRequests", "code": 429}, RetryableError),
    ({"message": "old server", "type": "BadRequestError"}, RequestRejected),
    ({"message": "old server", "type": "InternalServerError"}, RetryableError),
    ("a bare string", RetryableError),
])
def test_an_error_the_server_streams_is_final_only_when_it_refuses_the_request(error, raised):
    with pytest.raises(raised):
        asyncio.run(read(stream({"error": error})))


def test_a_stream_without_an_error_is_read_whole():
    assert len(asyncio.run(read(stream({"choices": [{"index": 0, "text": "lo"}]})))) == 2
