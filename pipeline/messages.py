"""The message contract: inference requests in, chunks, completions and dead letters out.

Input is a Pub/Sub message whose data is either a JSON object (it starts with
``{``) or plain UTF-8 text, which is taken as the prompt. Anything that cannot
become a valid :class:`InferenceRequest` becomes a :class:`DeadLetter` with a
reason a person can act on; parsing never raises into a bundle.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

# Stages a dead letter can come from, so operators can filter by where it failed.
STAGE_PARSE = "parse"
STAGE_VALIDATE = "validate"
STAGE_INFERENCE = "inference"
STAGE_SINK = "sink"

ALLOWED_FIELDS = ("id", "prompt", "messages", "max_tokens", "temperature", "top_p", "stop", "metadata")
CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_SEQUENCES = 8


class RequestError(ValueError):
    """A request that cannot be served as written; the message is shown to users."""


@dataclass(frozen=True)
class InferenceRequest:
    """One prompt with its own sampling parameters (None means the server's default)."""

    id: str
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    received_at: float = 0.0
    # Filled in by length bucketing; the estimate is good enough for routing.
    prompt_tokens: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> InferenceRequest:
        data = json.loads(text)
        if data.get("messages") is not None:
            data["messages"] = tuple(data["messages"])
        if data.get("stop") is not None:
            data["stop"] = tuple(data["stop"])
        return cls(**data)

    def prompt_text(self) -> str:
        """The text a length estimate should look at, for either prompt form."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or ())


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed output; ``seq`` is gapless per (id, attempt)."""

    id: str
    attempt: int
    seq: int
    text: str
    tokens: int  # cumulative completion tokens so far
    final: bool
    finish_reason: str | None
    time_to_first_token_ms: float | None
    elapsed_ms: float
    emitted_at: float  # wall-clock seconds since the epoch

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


@dataclass(frozen=True)
class Completion:
    """The final record of one request."""

    id: str
    attempt: int
    model: str
    prompt: str | None
    messages: tuple[Mapping[str, str], ...] | None
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float | None
    total_ms: float
    received_at: float
    finished_at: float
    metadata: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["usage"] = {
            "prompt_tokens": record.pop("prompt_tokens"),
            "completion_tokens": record.pop("completion_tokens"),
        }
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


@dataclass(frozen=True)
class DeadLetter:
    """Something that could not be served, with where and why."""

    stage: str
    reason: str
    payload: str
    payload_encoding: str = "utf-8"  # or "base64" when the bytes were not text
    id: str | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)
    at: float = 0.0

    @classmethod
    def from_bytes(cls, stage: str, reason: str, data: bytes, **kwargs: Any) -> DeadLetter:
        try:
            return cls(stage, reason, data.decode("utf-8"), "utf-8", at=kwargs.pop("at", time.time()), **kwargs)
        except UnicodeDecodeError:
            payload = base64.b64encode(data).decode("ascii")
            return cls(stage, reason, payload, "base64", at=kwargs.pop("at", time.time()), **kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


@dataclass(frozen=True)
class RequestLimits:
    """Pipeline-wide limits that a request's own parameters are checked against."""

    default_max_tokens: int = 256
    max_model_len: int = 2048
    max_prompt_chars: int = 200_000


def parse_request(
    data: bytes,
    attributes: Mapping[str, str] | None = None,
    message_id: str | None = None,
    *,
    limits: RequestLimits = RequestLimits(),
    id_attribute: str = "id",
    now: float | None = None,
) -> InferenceRequest | DeadLetter:
    """Turns one Pub/Sub payload into a request, or a dead letter saying why not."""
    attributes = dict(attributes or {})
    received_at = time.time() if now is None else now
    fallback_id = attributes.get(id_attribute) or message_id or uuid.uuid4().hex

    def dead(stage: str, reason: str, request_id: str | None = fallback_id) -> DeadLetter:
        return DeadLetter.from_bytes(stage, reason, data, id=request_id, attributes=attributes, at=received_at)

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return dead(STAGE_PARSE, f"payload is not UTF-8 text ({exc.reason} at byte {exc.start})")
    if not text.strip():
        return dead(STAGE_PARSE, "payload is empty; send a JSON object with a 'prompt' or plain text")
    if not text.lstrip().startswith(("{", "[")):
        fields: dict[str, Any] = {"prompt": text}
    else:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            return dead(STAGE_PARSE, f"payload starts like JSON but is not valid JSON: {exc.msg} "
                                     f"at line {exc.lineno} column {exc.colno}")
        if not isinstance(fields, dict):
            return dead(STAGE_PARSE, f"JSON payload must be an object, got {type(fields).__name__}")
    request_id = fields.get("id")
    if isinstance(request_id, (str, int)) and not isinstance(request_id, bool) and str(request_id).strip():
        request_id = str(request_id)
    elif request_id is None:
        request_id = fallback_id
    else:
        return dead(STAGE_VALIDATE, "'id' must be a non-empty string or an integer")
    try:
        return _validated(fields, request_id, limits, received_at)
    except RequestError as exc:
        return dead(STAGE_VALIDATE, str(exc), request_id)


def _validated(fields: dict[str, Any], request_id: str, limits: RequestLimits, received_at: float) -> InferenceRequest:
    unknown = sorted(set(fields) - set(ALLOWED_FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(ALLOWED_FIELDS)}")
    prompt, messages = fields.get("prompt"), fields.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("exactly one of 'prompt' (text) or 'messages' (chat) is required")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError("'prompt' must be a non-empty string")
        if len(prompt) > limits.max_prompt_chars:
            raise RequestError(f"'prompt' has {len(prompt)} characters; the limit is {limits.max_prompt_chars}")
    else:
        messages = _validated_messages(messages)
    max_tokens = fields.get("max_tokens")
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    elif not _is_int(max_tokens) or max_tokens <= 0:
        raise RequestError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    elif max_tokens >= limits.max_model_len:
        raise RequestError(f"'max_tokens' is {max_tokens}, but the model's context is {limits.max_model_len} tokens")
    temperature = _optional_number(fields, "temperature", low=0.0, high=2.0)
    top_p = _optional_number(fields, "top_p", low=0.0, high=1.0, low_inclusive=False)
    stop = fields.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                or len(stop) > MAX_STOP_SEQUENCES):
            raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings")
        stop = tuple(stop)
    metadata = fields.get("metadata", {})
    if not isinstance(metadata, dict):
        raise RequestError("'metadata' must be a JSON object")
    return InferenceRequest(
        id=request_id, prompt=prompt, messages=messages, max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, stop=stop, metadata=metadata, received_at=received_at)


def _validated_messages(messages: Any) -> tuple[Mapping[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {'role', 'content'} objects")
    for index, message in enumerate(messages):
        if (not isinstance(message, dict) or set(message) != {"role", "content"}
                or message["role"] not in CHAT_ROLES or not isinstance(message["content"], str)):
            raise RequestError(f"'messages'[{index}] must be {{'role': one of {', '.join(CHAT_ROLES)}, "
                               "'content': text}")
    return tuple(messages)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_number(fields: Mapping[str, Any], name: str, *, low: float, high: float,
                     low_inclusive: bool = True) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a number, got {value!r}")
    above_low = value >= low if low_inclusive else value > low
    if not above_low or value > high:
        bracket = "[" if low_inclusive else "("
        raise RequestError(f"'{name}' must be in {bracket}{low}, {high}], got {value}")
    return float(value)

