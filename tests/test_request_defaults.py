"""Template-level request defaults: system prompt, prompt template and response schema."""

from __future__ import annotations

import json

import pytest

from pipeline.contract.messages import DeadLetter, InferenceRequest
from pipeline.contract.request_parsing import parse_request
from pipeline.contract.structured_output import parse_output, schema_response_format
from pipeline.intake.request_defaults import RequestDefaults, template_fields

SCHEMA = {"type": "object", "properties": {"category": {"enum": ["billing", "bug"]}, "urgency": {"type": "integer"}},
          "required": ["category", "urgency"]}


def parse(payload: bytes, defaults: RequestDefaults, attributes=None):
    return parse_request(payload, attributes or {}, "m-1", defaults=defaults, now=1.0)


def test_a_plain_text_record_becomes_a_structured_chat_request():
    defaults = RequestDefaults(system_prompt="You triage tickets.", prompt_template="Ticket: {text}",
                               response_schema=json.dumps(SCHEMA))
    request = parse(b"My card was charged twice", defaults)
    assert isinstance(request, InferenceRequest) and request.prompt is None
    assert request.messages == ({"role": "system", "content": "You triage tickets."},
                                {"role": "user", "content": "Ticket: My card was charged twice"})
    assert request.response_format == schema_response_format(SCHEMA)


def test_json_requests_fill_the_template_from_metadata_and_keep_their_own_choices():
    defaults = RequestDefaults(prompt_template="Review of {product}: {text}", response_schema=json.dumps(SCHEMA))
    request = parse(json.dumps({"prompt": "Broke in a day.", "metadata": {"product": "kettle"},
                                "response_format": {"type": "json_object"}}).encode(), defaults)
    assert request.prompt == "Review of kettle: Broke in a day." and request.response_format == {"type": "json_object"}
    chat = parse(json.dumps({"messages": [{"role": "system", "content": "Mine."},
                                          {"role": "user", "content": "Hi"}]}).encode(),
                 RequestDefaults(system_prompt="Template's.", prompt_template="{text}"))
    assert chat.messages[0]["content"] == "Mine." and len(chat.messages) == 2  # chat requests are left as sent


def test_a_message_without_a_placeholder_is_a_dead_letter_naming_it():
    letter = parse(json.dumps({"metadata": {"title": "x"}}).encode(), RequestDefaults(prompt_template="{body}"))
    assert isinstance(letter, DeadLetter) and "prompt_template needs {body}" in letter.reason
    assert "it has: title" in letter.reason


def test_with_the_completions_api_the_system_prompt_is_prepended_to_the_text():
    request = parse(b"hello", RequestDefaults(system_prompt="Be brief.", prompt_format="completion"))
    assert request.prompt == "Be brief.\n\nhello" and request.messages is None


@pytest.mark.parametrize("template, problem", [
    ("{text.__class__}", "is not allowed"), ("{0}", "is not allowed"), ("{text!r}", "is not allowed"),
    ("{text:>10}", "is not allowed"), ("no placeholder", "has no placeholder"), ("{unclosed", "not a valid template"),
])
def test_unsafe_or_useless_templates_are_refused(template, problem):
    with pytest.raises(ValueError, match=problem):
        template_fields(template)


def test_a_bad_response_schema_is_refused_at_launch():
    with pytest.raises(ValueError, match="not valid JSON"):
        RequestDefaults(response_schema="{nope")
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        RequestDefaults(response_schema='{"type": 12}')


@pytest.mark.parametrize("text, finish, value, error", [
    ('{"category": "bug", "urgency": 2}', "stop", {"category": "bug", "urgency": 2}, None),
    ('{"category": "bug", "urg', "length", None, "cut at max_tokens"),
    ('{"category": "other", "urgency": 2}', "stop", None, "does not match the schema"),
    ("[1]", "stop", None, "does not match the schema"),
])
def test_answers_are_parsed_and_checked_against_the_schema(text, finish, value, error):
    parsed, problem = parse_output(text, schema_response_format(SCHEMA), finish)
    assert parsed == value and (error is None) == (problem is None)
    if error:
        assert error in problem
    assert parse_output("not json", None, "stop") == (None, None)
