"""Structured output: a request's ``response_format``, checked on the way in and applied to the answer.

Classification and extraction over a stream want answers that land as data.
vLLM constrains generation to a JSON schema (or to any JSON object) when a
request carries OpenAI's ``response_format``; this module validates that field
at parse time, so a bad schema is a dead letter with a reason rather than a
server error, and parses each finished answer into the completion's
``output_json``, or says in ``output_error`` why it could not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

MAX_SCHEMA_BYTES = 16 * 1024
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JSON_OBJECT, JSON_SCHEMA = "json_object", "json_schema"


class ResponseFormatError(ValueError):
    """A response_format (or schema) that cannot be used; the message says why."""


def checked_schema(schema: Any, where: str = "the schema") -> dict[str, Any]:
    """A JSON Schema object, checked against its metaschema and the size limit."""
    from jsonschema import SchemaError, validators

    if not isinstance(schema, dict):
        raise ResponseFormatError(f"{where} must be a JSON object (a JSON Schema)")
    size = len(json.dumps(schema, separators=(",", ":")).encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise ResponseFormatError(f"{where} is {size} bytes as JSON; the limit is {MAX_SCHEMA_BYTES}")
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise ResponseFormatError(f"{where} is not a valid JSON Schema: {exc.message}") from None
    return schema


def checked_response_format(value: Any) -> dict[str, Any]:
    """OpenAI's ``response_format``: ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {...}}``."""
    if not isinstance(value, dict) or value.get("type") not in (JSON_OBJECT, JSON_SCHEMA):
        raise ResponseFormatError("'response_format' must be {\"type\": \"json_object\"} or "
                                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}")
    if value["type"] == JSON_OBJECT:
        if set(value) != {"type"}:
            raise ResponseFormatError("'response_format' of type json_object takes no other field")
        return {"type": JSON_OBJECT}
    spec = value.get("json_schema")
    if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise ResponseFormatError("'response_format' of type json_schema needs a 'json_schema' object, "
                                  "and nothing else")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ResponseFormatError(f"'json_schema' has unknown field(s) {', '.join(map(repr, unknown))}")
    if not isinstance(spec.get("name"), str) or not SCHEMA_NAME.match(spec["name"]):
        raise ResponseFormatError("'json_schema.name' must be 1-64 letters, digits, '_' or '-'")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        raise ResponseFormatError("'json_schema.strict' must be true or false")
    if "description" in spec and not isinstance(spec["description"], str):
        raise ResponseFormatError("'json_schema.description' must be text")
    checked_schema(spec.get("schema"), "'json_schema.schema'")
    return {"type": JSON_SCHEMA, "json_schema": dict(spec)}


def schema_response_format(schema: dict[str, Any], name: str = "response") -> dict[str, Any]:
    """The response_format that constrains an answer to ``schema``."""
    return {"type": JSON_SCHEMA, "json_schema": {"name": name, "schema": schema, "strict": True}}


def parse_output(text: str, response_format: Mapping[str, Any] | None,
                 finish_reason: str | None) -> tuple[Any, str | None]:
    """(output_json, output_error) for a finished answer; (None, None) when no structure was asked for."""
    if response_format is None:
        return None, None
    cut = (" The answer was cut at max_tokens (finish_reason=length): raise max_tokens, or bound what the schema "
           "leaves open (an integer's maximum, a string's maxLength, an array's maxItems)."
           if finish_reason == "length" else "")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return None, f"the answer is not valid JSON ({str(exc)[:120]}).{cut}"
    if response_format.get("type") == JSON_OBJECT and not isinstance(value, dict):
        return None, f"the answer is JSON but not an object.{cut}"
    if response_format.get("type") == JSON_SCHEMA:
        from jsonschema import validators

        schema = response_format["json_schema"]["schema"]
        error = next(iter(validators.validator_for(schema)(schema).iter_errors(value)), None)
        if error is not None:
            return None, f"the answer does not match the schema: {error.message[:200]}.{cut}"
    return value, None
