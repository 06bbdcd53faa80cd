"""Parsing and validation of the input contract."""

from __future__ import annotations

import base64
import json

import pytest

from pipeline.messages import (STAGE_PARSE, STAGE_VALIDATE, DeadLetter, InferenceRequest, RequestLimits,
                               parse_request)

LIMITS = RequestLimits(default_max_tokens=64, max_model_len=2048)


def parse(payload, attributes=None, message_id="m-1"):
    data = payload if isinstance(payload, bytes) else (
        json.dumps(payload) if not isinstance(payload, str) else payload).encode()
    return parse_request(data, attributes, message_id, limits=LIMITS, now=1000.0)


def test_full_json_request_keeps_every_parameter():
    request = parse({"id": "r1", "prompt": "Hi", "max_tokens": 5, "temperature": 0.2, "top_p": 0.9,
                     "stop": ["\n", "END"], "metadata": {"user": "u7"}})
    assert request == InferenceRequest(id="r1", prompt="Hi", max_tokens=5, temperature=0.2, top_p=0.9,
                                       stop=("\n", "END"), metadata={"user": "u7"}, received_at=1000.0)


def test_defaults_fill_max_tokens_and_leave_sampling_to_the_server():
    request = parse({"prompt": "Hi"})
    assert (request.max_tokens, request.temperature, request.top_p, request.stop) == (64, None, None, None)


def test_plain_text_is_a_prompt_and_the_id_comes_from_the_attribute_then_the_message_id():
    assert parse("Tell me a joke", {"id": "from-attr"}).id == "from-attr"
    request = parse("Tell me a joke")
    assert (request.id, request.prompt) == ("m-1", "Tell me a joke")


def test_integer_ids_become_strings_and_json_id_wins_over_attribute():
    assert parse({"id": 42, "prompt": "x"}, {"id": "attr"}).id == "42"


def test_chat_messages_are_accepted():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = parse({"messages": messages})
    assert request.messages == tuple(messages) and request.prompt is None
    assert request.prompt_text() == "Be brief.\nHi"


def test_request_round_trips_through_json():
    request = parse({"id": "r", "messages": [{"role": "user", "content": "Hi"}], "stop": "x"})
    assert InferenceRequest.from_json(request.to_json()) == request


@pytest.mark.parametrize("payload, stage, reason", [
    ('{"prompt": "unterminated', STAGE_PARSE, "not valid JSON"),
    ("[1, 2]", STAGE_PARSE, "must be an object"),
    ("   ", STAGE_PARSE, "empty"),
    ({"id": "a"}, STAGE_VALIDATE, "exactly one of 'prompt'"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, STAGE_VALIDATE, "exactly one of"),
    ({"prompt": 7}, STAGE_VALIDATE, "'prompt' must be a non-empty string"),
    ({"prompt": "x", "max_tokens": -1}, STAGE_VALIDATE, "'max_tokens' must be a positive integer"),
    ({"prompt": "x", "max_tokens": "5"}, STAGE_VALIDATE, "'max_tokens' must be a positive integer"),
    ({"prompt": "x", "max_tokens": True}, STAGE_VALIDATE, "'max_tokens' must be a positive integer"),
    ({"prompt": "x", "max_tokens": 4096}, STAGE_VALIDATE, "context is 2048"),
    ({"prompt": "x", "temperature": "hot"}, STAGE_VALIDATE, "'temperature' must be a number"),
    ({"prompt": "x", "temperature": 3}, STAGE_VALIDATE, "'temperature' must be in [0.0, 2.0]"),
    ({"prompt": "x", "top_p": 0}, STAGE_VALIDATE, "'top_p' must be in (0.0, 1.0]"),
    ({"prompt": "x", "stop": [1]}, STAGE_VALIDATE, "'stop' must be"),
    ({"prompt": "x", "metadata": [1]}, STAGE_VALIDATE, "'metadata' must be a JSON object"),
    ({"prompt": "x", "max_token": 5}, STAGE_VALIDATE, "unknown field(s) 'max_token'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, STAGE_VALIDATE, "'messages'[0] must be"),
    ({"messages": []}, STAGE_VALIDATE, "non-empty list"),
    ({"id": "", "prompt": "x"}, STAGE_VALIDATE, "'id' must be"),
])
def test_malformed_input_becomes_a_dead_letter_with_a_reason(payload, stage, reason):
    letter = parse(payload)
    assert isinstance(letter, DeadLetter)
    assert letter.stage == stage
    assert reason in letter.reason


def test_dead_letter_keeps_the_raw_payload_and_attributes():
    letter = parse('{"prompt": "x", "max_tokens": -1}', {"source": "app"})
    assert letter.payload == '{"prompt": "x", "max_tokens": -1}'
    assert letter.attributes == {"source": "app"} and letter.id == "m-1"


def test_non_utf8_payload_is_kept_as_base64():
    raw = b"\xff\xfe\x00bad"
    letter = parse(raw)
    assert isinstance(letter, DeadLetter) and "not UTF-8" in letter.reason
    assert letter.payload_encoding == "base64" and base64.b64decode(letter.payload) == raw
