"""Parsing and validation of the input contract."""

from __future__ import annotations

import base64
import dataclasses
import json

import hypothesis
import hypothesis.strategies
import pytest

from pipeline.contract.messages import (
    FINGERPRINTED_WHEN_UNSET,
    STAGE_PARSE,
    STAGE_VALIDATE,
    DeadLetter,
    InferenceRequest,
)
from pipeline.contract.request_fields import BOUNDED_FIELDS, FIELD_NAMES
from pipeline.contract.request_parsing import RequestLimits, parse_request

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
    ('{"prompt": "x", "temperature": NaN}', STAGE_PARSE, "NaN is not a JSON number"),
    ('{"prompt": "x", "metadata": {"n": 1e999}}', STAGE_PARSE, "too large for a double"),
    ('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", STAGE_PARSE, "not a usable JSON request"),
    ('{"prompt": "x", "m": ' + "[" * 5000 + "]" * 5000 + "}", STAGE_PARSE, "nests"),
    ('{"prompt": "x", "metadata": ' + '{"a":' * 40 + "1" + "}" * 40 + "}", STAGE_PARSE, "nests deeper than 32"),
    ('{"prompt": "\\ud800 lone"}', STAGE_PARSE, "not valid Unicode"),
    ({"prompt": "x", "metadata": {"blob": "y" * 70_000}}, STAGE_VALIDATE, "'metadata' is 70011 bytes"),
    ({"prompt": "x", "stop": ["z" * 300]}, STAGE_VALIDATE, "at most 256 characters"),
    ({"messages": [{"role": "user", "content": "w" * 200_001}]}, STAGE_VALIDATE, "'messages' have 200001"),
    ({"id": "i" * 513, "prompt": "x"}, STAGE_VALIDATE, "longer than 512 bytes"),
    ({"prompt": "x", "deadline_ms": 0}, STAGE_VALIDATE, "'deadline_ms' must be"),
    ({"prompt": "x", "deadline_ms": 1.5}, STAGE_VALIDATE, "'deadline_ms' must be"),
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


@pytest.mark.parametrize("text", ["[INST] Summarise this ticket [/INST]", "{name} is late again",
                                  "[1, 2]", "{", "  [ {\"prompt\": 1} ]"])
def test_text_that_starts_like_json_but_is_no_json_object_is_a_prompt(text):
    request = parse(text)
    assert isinstance(request, InferenceRequest) and request.prompt == text


def test_the_content_type_attribute_settles_how_a_payload_is_read():
    as_text = parse('{"prompt": "this whole thing is the prompt"}', {"content_type": "text/plain"})
    assert as_text.prompt == '{"prompt": "this whole thing is the prompt"}'
    as_json = parse("[1, 2]", {"content_type": "application/json; charset=utf-8"})
    assert isinstance(as_json, DeadLetter) and "must be an object" in as_json.reason
    unknown = parse("hello", {"content_type": "image/png"})
    assert isinstance(unknown, DeadLetter) and "is not supported" in unknown.reason


def test_an_id_attribute_too_long_for_an_ordering_key_is_refused_not_truncated():
    letter = parse("hello", {"id": "x" * 600}, message_id="m-9")
    assert isinstance(letter, DeadLetter) and "longer than 512 bytes" in letter.reason and letter.id is None


def test_deadline_ms_is_kept_and_equal_requests_share_a_fingerprint():
    a = parse({"id": "d", "prompt": "x", "deadline_ms": 5000})
    b = parse_request(b'{"id": "d", "prompt": "x", "deadline_ms": 5000}', {}, "m-2", limits=LIMITS, now=2000.0)
    assert a.deadline_ms == 5000 and a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != parse({"id": "d", "prompt": "y", "deadline_ms": 5000}).fingerprint()


def test_a_dead_letter_too_large_for_pubsub_keeps_a_flagged_prefix_of_its_payload():
    payload = "\x01" * 3_000_000  # 3 MB that JSON-escape to 18 MB
    record = json.loads(DeadLetter("parse", "too big", payload, id="big").to_json())
    assert record["payload_truncated"] is True and payload.startswith(record["payload"])
    assert len(DeadLetter("parse", "too big", payload, id="big").to_json()) <= 8 * 1024 * 1024
    small = json.loads(DeadLetter("parse", "small", "abc").to_json())
    assert small["payload"] == "abc" and small["payload_truncated"] is False


def test_dead_letter_keeps_the_raw_payload_and_attributes():
    letter = parse('{"prompt": "x", "max_tokens": -1}', {"source": "app"})
    assert letter.payload == '{"prompt": "x", "max_tokens": -1}'
    assert letter.attributes == {"source": "app"} and letter.id == "m-1"


def test_non_utf8_payload_is_kept_as_base64():
    raw = b"\xff\xfe\x00bad"
    letter = parse(raw)
    assert isinstance(letter, DeadLetter) and "not UTF-8" in letter.reason
    assert letter.payload_encoding == "base64" and base64.b64decode(letter.payload) == raw


SCHEMA = {"type": "object", "properties": {"category": {"enum": ["billing", "bug"]}}, "required": ["category"]}


def test_response_format_and_sampling_extras_are_kept():
    request = parse({"prompt": "x", "seed": 7, "presence_penalty": 0.5, "frequency_penalty": -1,
                     "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True}}})
    assert (request.seed, request.presence_penalty, request.frequency_penalty) == (7, 0.5, -1.0)
    assert request.response_format["json_schema"]["schema"] == SCHEMA
    assert InferenceRequest.from_json(request.to_json()) == request
    assert parse({"prompt": "x", "response_format": {"type": "json_object"}}).response_format == {"type": "json_object"}


def test_min_tokens_is_kept_and_unset_it_leaves_the_fingerprint_as_earlier_versions_stored_it():
    fixed = parse({"prompt": "x", "max_tokens": 16, "min_tokens": 16})
    assert (fixed.max_tokens, fixed.min_tokens) == (16, 16)
    assert InferenceRequest.from_json(fixed.to_json()) == fixed and json.loads(fixed.to_payload())["min_tokens"] == 16
    assert parse({"prompt": "x", "min_tokens": 0}).min_tokens == 0
    assert parse({"prompt": "x", "max_tokens": 16}).min_tokens is None
    # The fingerprint a version without min_tokens stored (8dced2a, which hashed it as the first version did, by
    # sha256 over the fields but min_tokens and adapter): a redelivery after an update still matches.
    plain = parse({"prompt": "x", "max_tokens": 16})
    assert plain.fingerprint() == "d14db736b8d707df10e85559b10b76a1"
    assert fixed.fingerprint() != parse({"prompt": "x", "max_tokens": 16}).fingerprint()


def test_an_adapter_the_job_serves_is_kept_and_unset_it_leaves_the_fingerprint_as_earlier_versions_stored_it():
    limits = RequestLimits(adapters=("support", "extract"))
    request = parse_request(json.dumps({"prompt": "x", "adapter": "support"}).encode(), limits=limits)
    assert request.adapter == "support" and InferenceRequest.from_json(request.to_json()) == request
    assert json.loads(request.to_payload())["adapter"] == "support"  # a redrive asks for the same adapter
    plain = parse({"prompt": "x"})
    assert plain.adapter is None
    assert plain.fingerprint() == "825ee0840e7771432c0dd18aef257178", "as a version without adapters stored it"
    assert request.fingerprint() != parse_request(b'{"prompt": "x"}', limits=limits).fingerprint()


@pytest.mark.parametrize("adapters, adapter, reason", [
    (("support", "extract"), "billing", "adapter 'billing' is not served by this job: it serves 'support', 'extract'"),
    ((), "support", "it serves none (template parameters lora_adapters, lora_adapter_root)"),
    (("support",), 3, "'adapter' must be the name of a LoRA adapter"),
    (None, "x" * 300, "'adapter' must be the name of a LoRA adapter"),
])
def test_an_adapter_the_job_does_not_serve_is_a_dead_letter_naming_those_it_does(adapters, adapter, reason):
    letter = parse_request(json.dumps({"id": "r", "prompt": "x", "adapter": adapter}).encode(),
                           limits=RequestLimits(adapters=adapters))
    assert isinstance(letter, DeadLetter) and letter.stage == STAGE_VALIDATE and reason in letter.reason, letter


def test_any_adapter_goes_to_a_server_the_job_does_not_run():
    request = parse_request(b'{"prompt": "x", "adapter": "theirs"}', limits=RequestLimits(adapters=None))
    assert request.adapter == "theirs"


@pytest.mark.parametrize("fields, reason", [
    ({"response_format": {"type": "text"}}, "'response_format' must be"),
    ({"response_format": "json"}, "'response_format' must be"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "takes no other field"),
    ({"response_format": {"type": "json_schema"}}, "needs a 'json_schema' object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}}, "1-64 letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": [1]}}}, "must be a JSON object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nope"}}}},
     "is not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "object", "description": "d" * 20_000}}}}, "the limit is 16384"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "extra": 1}}},
     "unknown field(s) 'extra'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": "yes"}}},
     "'json_schema.strict' must be true or false"),
    ({"seed": 1.5}, "'seed' must be a whole number"),
    ({"seed": 2**64}, "'seed' must be a whole number"),
    ({"presence_penalty": 3}, "'presence_penalty' must be in [-2.0, 2.0]"),
    ({"frequency_penalty": "high"}, "'frequency_penalty' must be a number"),
    ({"max_tokens": 8, "min_tokens": 9}, "'min_tokens' must be a whole number from 0 to max_tokens (8)"),
    ({"min_tokens": -1}, "'min_tokens' must be a whole number"),
    ({"min_tokens": 2.5}, "'min_tokens' must be a whole number"),
    ({"min_tokens": True}, "'min_tokens' must be a whole number"),
    ({"min_tokens": 4, "response_format": {"type": "json_object"}}, "'min_tokens' cannot go with 'response_format'"),
])
def test_bad_structured_output_and_penalties_are_dead_letters_with_reasons(fields, reason):
    letter = parse({"prompt": "x", **fields})
    assert isinstance(letter, DeadLetter) and letter.stage == STAGE_VALIDATE and reason in letter.reason


@pytest.mark.parametrize("data", [b'{"id": "x", "prompt": "caf\xc3\xa9"}', b"\xff\xfe not text"])
def test_a_dead_letter_record_reads_back_to_the_message_it_came_from(data):
    letter = DeadLetter.from_bytes(STAGE_PARSE, "why", data, attributes={"k": "v"}, id="x")
    again = DeadLetter.from_json(letter.to_json())
    assert again == letter and again.original_bytes() == data


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(hypothesis.strategies.binary(max_size=200) | hypothesis.strategies.text(max_size=200).map(str.encode))
def test_anything_else_on_a_dead_letter_subscription_is_refused_with_a_value_error(data):
    try:
        DeadLetter.from_json(data).original_bytes()
    except ValueError:
        pass


def test_a_request_crosses_a_shuffle_as_a_version_byte_and_its_json_and_an_unknown_version_is_refused():
    from typing import List, Tuple

    from apache_beam import coders
    from apache_beam.typehints.native_type_compatibility import convert_to_beam_type

    from pipeline.contract.request_coder import InferenceRequestCoder

    request = InferenceRequest(id="r1", prompt="Say yes.", max_tokens=4, metadata={"k": [1, 2]}, received_at=12.5)
    coder = InferenceRequestCoder()
    assert coder.decode(coder.encode(request)) == request
    # Version 1's bytes as this code first wrote them: a later version must still read them.
    written = b'\x01{"id":"old","prompt":"Hi","max_tokens":3,"received_at":1.0}'
    assert coder.decode(written) == InferenceRequest(id="old", prompt="Hi", max_tokens=3, received_at=1.0)
    with pytest.raises(ValueError, match="version 2"):
        coder.decode(b"\x02{}")
    # What Beam picks for the elements that cross the template's two shuffles.
    for hint in (Tuple[str, InferenceRequest], Tuple[int, List[InferenceRequest]]):
        assert "InferenceRequestCoder" in repr(coders.registry.get_coder(convert_to_beam_type(hint)))


# Fingerprints as the code before the request-field table stored them (commit 8dced2a, whose messages.py hashed
# every field but min_tokens and adapter even when unset): state written then must still match after an update.
STORED_BEFORE = {
    "649ba49e3050cf8cecbe8045ce404206": InferenceRequest(id="req-7", prompt="Classify: charged twice.",
                                                         max_tokens=64, temperature=0.2, metadata={"k": "v"}),
    "ceb4b6cca52d433ccf2fa9760ead6a3a": InferenceRequest(
        id="req-8", messages=({"role": "user", "content": "hi"},), max_tokens=16, min_tokens=4, adapter="orders",
        seed=3, presence_penalty=0.5),
}


@pytest.mark.parametrize("stored", sorted(STORED_BEFORE))
def test_a_field_added_since_leaves_every_stored_fingerprint_as_it_was(stored):
    request = STORED_BEFORE[stored]
    assert request.fingerprint() == stored
    assert dataclasses.replace(request, repetition_penalty=1.1).fingerprint() != stored, "set, it counts"


@hypothesis.given(field=hypothesis.strategies.sampled_from(BOUNDED_FIELDS),
                  value=hypothesis.strategies.one_of(
                      hypothesis.strategies.floats(allow_nan=True, allow_infinity=True),
                      hypothesis.strategies.integers(-10, 10), hypothesis.strategies.booleans(),
                      hypothesis.strategies.text(max_size=4), hypothesis.strategies.none()))
@hypothesis.settings(max_examples=400, deadline=None)
def test_every_bounded_field_takes_exactly_the_numbers_its_bounds_allow(field, value):
    """Derived from the table alone: a number inside a field's bounds is kept, as a float, and reaches the
    request and its JSON form; anything else is a validate dead letter naming the field (NaN and infinities are
    refused earlier, as JSON that is not, by the parse stage)."""
    low, high = field.bounds
    try:
        payload = json.dumps({"prompt": "x", field.name: value})
    except ValueError:
        return
    parsed = parse(payload)
    inside = (not isinstance(value, bool) and isinstance(value, (int, float)) and value == value
              and abs(value) != float("inf") and (value > low if field.low_open else value >= low) and value <= high)
    if value is None or inside:
        assert isinstance(parsed, InferenceRequest), parsed
        assert getattr(parsed, field.name) == (None if value is None else float(value))
        assert InferenceRequest.from_json(parsed.to_json()) == parsed
    else:
        assert isinstance(parsed, DeadLetter) and f"'{field.name}'" in parsed.reason or "not JSON" in parsed.reason \
            or "NaN" in parsed.reason or "finite" in parsed.reason, parsed


def test_a_request_without_the_fields_added_since_is_written_as_the_first_state_was():
    """A rollback update reads the state this version writes with older code, whose from_json refuses fields it
    does not know: an unset field that the first stored state did not have is not written at all, and a set one
    is, and is read back."""
    request = parse({"prompt": "x", "temperature": 0.5})
    assert set(json.loads(request.to_json())) <= FINGERPRINTED_WHEN_UNSET | {"received_at"}
    penalised = dataclasses.replace(request, repetition_penalty=1.1, min_tokens=2, lane="bulk")
    assert {"repetition_penalty", "min_tokens", "lane"} <= set(json.loads(penalised.to_json()))
    for each in (request, penalised):
        assert InferenceRequest.from_json(each.to_json()) == each


def test_every_field_of_the_table_is_a_field_of_the_request_whose_unset_value_is_none():
    """The fingerprint and the state's JSON leave out unset fields added since the first state: that holds only if
    a new field's default is None, and the table and the record name the same fields."""
    defaults = {f.name: f.default for f in dataclasses.fields(InferenceRequest)}
    internal = {"received_at", "prompt_tokens", "lane"}  # set by the pipeline, never by a message
    assert set(defaults) - internal == set(FIELD_NAMES)
    assert all(defaults[name] is None for name in FIELD_NAMES if name not in ("id", "metadata"))


def test_the_fields_fingerprinted_when_unset_are_the_first_stored_states_and_no_field_added_since():
    """Derived from the table of request fields, the set is exactly the first stored state's: a field marked
    first_stored after it came would change every fingerprint stored before (an update would dead-letter each
    redelivered request as another with its id)."""
    assert FINGERPRINTED_WHEN_UNSET == {"id", "prompt", "messages", "max_tokens", "temperature", "top_p", "stop",
                                        "metadata", "deadline_ms", "response_format", "seed", "presence_penalty",
                                        "frequency_penalty"}
