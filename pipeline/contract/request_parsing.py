"""What makes a Pub/Sub message a request: parsing and validation at the pipeline's door.

Input is a Pub/Sub message whose data is either a JSON object or plain UTF-8
text, which is taken as the prompt (see :func:`payload_kind` for the rule, and
the ``content_type`` attribute that settles it explicitly). Anything that
cannot become a valid :class:`~pipeline.contract.messages.InferenceRequest`
becomes a :class:`~pipeline.contract.messages.DeadLetter` with a reason a
person can act on. Every value that later reaches a sink is bounded here (id
length, text sizes, metadata size and depth, finite numbers, valid Unicode), so
that the outputs of an accepted request can always be published.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.contract.messages import (
    LANE_LIVE,
    PREPARED_ATTRIBUTE,
    STAGE_PARSE,
    STAGE_VALIDATE,
    DeadLetter,
    InferenceRequest,
    lane_marked,
)
from pipeline.contract.parameters import default
from pipeline.contract.request_fields import BOUNDED_FIELDS, FIELD_NAMES
from pipeline.contract.structured_output import ResponseFormatError, checked_response_format

# vLLM takes a 64-bit seed.
SEED_RANGE = (-2**63, 2**63 - 1)
CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 256
# Pub/Sub refuses ordering keys over 1 KB; chunks use the id as theirs.
MAX_ID_BYTES = 512
MAX_METADATA_BYTES = 64 * 1024
MAX_JSON_DEPTH = 32
# The message attribute that says how to read the payload.
CONTENT_TYPE_ATTRIBUTE = "content_type"
CONTENT_TYPE_JSON, CONTENT_TYPE_TEXT = "application/json", "text/plain"


class RequestError(ValueError):
    """A request that cannot be served as written; the message is shown to users."""


# A LoRA adapter's name: it goes into requests, records and vLLM's --lora-modules name=path, and names a folder
# under lora_adapter_root, so no separators, no spaces, no "." or "..".
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


@dataclass(frozen=True)
class RequestLimits:
    """Pipeline-wide limits that a request's own parameters are checked against."""

    default_max_tokens: int = default("default_max_tokens")
    max_model_len: int = default("max_model_len")
    max_prompt_chars: int = 200_000
    # The LoRA adapters a request may name; None: any (a server the job does not run decides).
    adapters: tuple[str, ...] | None = ()
    # Whether a name not among them may name a folder of lora_adapter_root (its worker finds out whether it is one).
    adapter_root: bool = False


class Defaults(Protocol):
    """Template-level defaults applied to each message before validation (see pipeline.intake.request_defaults)."""

    def apply(self, fields: dict[str, Any], is_text: bool) -> dict[str, Any]: ...


def payload_kind(text: str, attributes: Mapping[str, str]) -> str:
    """How to read a payload: the ``content_type`` attribute if set, else its first characters.

    A payload is a JSON request when it starts (after white space) with ``{``
    followed by ``"`` or ``}``, as every JSON object does; anything else, for
    example ``[INST] ... [/INST]`` or ``{name} is ...``, is a plain-text prompt.
    Raises :class:`RequestError` for an unknown content type.
    """
    content_type = attributes.get(CONTENT_TYPE_ATTRIBUTE)
    if content_type is not None:
        kind = content_type.split(";", 1)[0].strip().lower()
        if kind not in (CONTENT_TYPE_JSON, CONTENT_TYPE_TEXT):
            raise RequestError(f"attribute {CONTENT_TYPE_ATTRIBUTE}={content_type[:100]!r} is not supported; "
                               f"use {CONTENT_TYPE_JSON} or {CONTENT_TYPE_TEXT}")
        return kind
    head = text.lstrip()[:1], text.lstrip()[1:].lstrip()[:1]
    return CONTENT_TYPE_JSON if head[0] == "{" and head[1] in ('"', "}") else CONTENT_TYPE_TEXT


def _reject_constant(name: str) -> Any:
    raise RequestError(f"{name} is not a JSON number; send finite numbers only")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestError(f"the number {text[:40]} is too large for a double")
    return value


def _decode_json(text: str) -> Any:
    """``json.loads`` with every way it can fail on hostile input turned into a :class:`RequestError`."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RequestError:
        raise
    except json.JSONDecodeError as exc:
        raise RequestError(f"payload starts like JSON but is not valid JSON: {exc.msg} "
                           f"at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise RequestError("payload is not a usable JSON request: it nests too deeply") from None
    except ValueError as exc:  # e.g. an integer literal with more digits than Python converts
        raise RequestError(f"payload is not a usable JSON request: {str(exc)[:200]}") from None


def parse_request(
    data: bytes,
    attributes: Mapping[str, str] | None = None,
    message_id: str | None = None,
    *,
    limits: RequestLimits = RequestLimits(),
    id_attribute: str = default("id_attribute"),
    now: float | None = None,
    defaults: Defaults | None = None,
) -> InferenceRequest | DeadLetter:
    """Turns one Pub/Sub payload into a request, or a dead letter saying why not."""
    attributes = dict(attributes or {})
    received_at = time.time() if now is None else now
    given_id = attributes.get(id_attribute) or message_id or uuid.uuid4().hex
    fallback_id = None if _too_long_id(given_id) else given_id

    lane = lane_marked(attributes)

    def dead(stage: str, reason: str, request_id: str | None = fallback_id) -> DeadLetter:
        return DeadLetter.from_bytes(stage, reason, data, id=request_id, attributes=attributes, at=received_at,
                                     lane=lane or LANE_LIVE)

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return dead(STAGE_PARSE, f"payload is not UTF-8 text ({exc.reason} at byte {exc.start})")
    if not text.strip():
        return dead(STAGE_PARSE, "payload is empty; send a JSON object with a 'prompt' or plain text")
    is_text = False
    try:
        is_text = payload_kind(text, attributes) == CONTENT_TYPE_TEXT
        if is_text:
            fields: dict[str, Any] = {"prompt": text}
        else:
            fields = _decode_json(text)
            if not isinstance(fields, dict):
                raise RequestError(f"JSON payload must be an object, got {type(fields).__name__}")
            _check_depth(fields)
            _check_unicode(fields)
    except RequestError as exc:
        return dead(STAGE_PARSE, str(exc))
    request_id = fields.get("id")
    if isinstance(request_id, (str, int)) and not isinstance(request_id, bool) and str(request_id).strip():
        request_id = str(request_id)
    elif request_id is None:
        request_id = fallback_id
    else:
        return dead(STAGE_VALIDATE, "'id' must be a non-empty string or an integer")
    if request_id is None or _too_long_id(request_id):
        return dead(STAGE_VALIDATE, f"the request id is longer than {MAX_ID_BYTES} bytes (UTF-8); "
                                    "Pub/Sub ordering keys, which carry it, are limited", None)
    try:
        if defaults is not None and attributes.get(PREPARED_ATTRIBUTE) != "1":
            fields = defaults.apply(fields, is_text)
        return _validated(fields, request_id, limits, received_at, lane)
    except RequestError as exc:
        return dead(STAGE_VALIDATE, str(exc), request_id)


def _too_long_id(request_id: str) -> bool:
    return len(request_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES


def _check_depth(value: Any) -> None:
    """Deeply nested values break recursive code downstream (encoders, coders); refuse them here."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"payload is not a usable JSON request: it nests deeper than {MAX_JSON_DEPTH} levels")
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]


def _check_unicode(fields: dict[str, Any]) -> None:
    """JSON escapes can spell lone surrogates, which no service downstream accepts as text."""
    try:
        json.dumps(fields, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"payload holds text that is not valid Unicode ({exc.reason}); "
                           "lone surrogate escapes such as \\ud800 are refused") from None


def _validated(fields: dict[str, Any], request_id: str, limits: RequestLimits, received_at: float,
               lane: str | None = None) -> InferenceRequest:
    unknown = sorted(set(fields) - set(FIELD_NAMES))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(FIELD_NAMES)}")
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
        chars = sum(len(m["content"]) for m in messages)
        if chars > limits.max_prompt_chars:
            raise RequestError(f"'messages' have {chars} characters; the limit is {limits.max_prompt_chars}")
    max_tokens = fields.get("max_tokens")
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    elif not _is_int(max_tokens) or max_tokens <= 0:
        raise RequestError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    elif max_tokens >= limits.max_model_len:
        raise RequestError(f"'max_tokens' is {max_tokens}, but the model's context is {limits.max_model_len} tokens")
    min_tokens = fields.get("min_tokens")
    if min_tokens is not None and (not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens):
        raise RequestError(f"'min_tokens' must be a whole number from 0 to max_tokens ({max_tokens}), "
                           f"got {str(min_tokens)[:40]}")
    bounded: dict[str, Any] = {f.name: _optional_number(fields, f.name, low=f.bounds[0], high=f.bounds[1],
                                                    low_inclusive=not f.low_open)
                               for f in BOUNDED_FIELDS if f.bounds is not None}
    stop = fields.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if (not isinstance(stop, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
                or len(stop) > MAX_STOP_SEQUENCES):
            raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOP_SEQUENCES} non-empty "
                               f"strings of at most {MAX_STOP_CHARS} characters")
        stop = tuple(stop)
    metadata = fields.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise RequestError("'metadata' must be a JSON object")
    size = len(json.dumps(metadata, separators=(",", ":")).encode("utf-8"))
    if size > MAX_METADATA_BYTES:
        raise RequestError(f"'metadata' is {size} bytes as JSON; the limit is {MAX_METADATA_BYTES}")
    response_format = fields.get("response_format")
    if response_format is not None:
        try:
            response_format = checked_response_format(response_format)
        except ResponseFormatError as exc:
            raise RequestError(str(exc)) from None
        if min_tokens:
            raise RequestError("'min_tokens' cannot go with 'response_format': the schema decides where the "
                               "answer ends, and no token may follow its end")
    seed = fields.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise RequestError(f"'seed' must be a whole number that fits in 64 bits, got {str(seed)[:40]}")
    adapter = fields.get("adapter")
    if adapter is not None:
        if not isinstance(adapter, str) or not 0 < len(adapter) <= 256:
            raise RequestError(f"'adapter' must be the name of a LoRA adapter, got {str(adapter)[:40]}")
        if limits.adapter_root and adapter not in (limits.adapters or ()):
            if not ADAPTER_NAME.match(adapter):
                raise RequestError(f"adapter {adapter[:80]!r} cannot name a folder of lora_adapter_root: 1-64 "
                                   "letters, digits, '_', '.' or '-', starting with a letter or digit")
        elif limits.adapters is not None and adapter not in limits.adapters:
            served = (f"it serves {', '.join(map(repr, limits.adapters))}" if limits.adapters
                      else "it serves none (template parameters lora_adapters, lora_adapter_root)")
            raise RequestError(f"adapter {adapter[:80]!r} is not served by this job: {served}; "
                               "leave 'adapter' out for the model itself")
    deadline_ms = fields.get("deadline_ms")
    if deadline_ms is not None and (not _is_int(deadline_ms) or not 0 < deadline_ms <= 7 * 24 * 3600 * 1000):
        raise RequestError(f"'deadline_ms' must be a whole number of milliseconds from 1 to 604800000 "
                           f"(a week), got {deadline_ms!r}")
    return InferenceRequest(
        id=request_id, prompt=prompt, messages=messages, max_tokens=max_tokens, min_tokens=min_tokens, stop=stop,
        metadata=metadata, deadline_ms=deadline_ms, response_format=response_format, seed=seed, adapter=adapter,
        received_at=received_at, lane=lane, **bounded)


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise RequestError(f"'{name}' must be a number, got {value!r}")
    above_low = value >= low if low_inclusive else value > low
    if not above_low or value > high:
        bracket = "[" if low_inclusive else "("
        raise RequestError(f"'{name}' must be in {bracket}{low}, {high}], got {str(value)[:40]}")
    return float(value)

