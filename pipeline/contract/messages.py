"""The message contract: inference requests in, chunks, completions and dead letters out.

Input is a Pub/Sub message whose data is either a JSON object or plain UTF-8
text, which is taken as the prompt (see :func:`payload_kind` for the rule, and
the ``content_type`` attribute that settles it explicitly). Anything that
cannot become a valid :class:`InferenceRequest` becomes a :class:`DeadLetter`
with a reason a person can act on. Every value that later reaches a sink is
bounded here (id length, text sizes, metadata size and depth, finite numbers,
valid Unicode), so that the outputs of an accepted request can always be
published.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from pipeline.contract.parameters import default
from pipeline.contract.structured_output import ResponseFormatError, checked_response_format

# Stages a dead letter can come from, so operators can filter by where it failed.
STAGE_PARSE = "parse"
STAGE_VALIDATE = "validate"
STAGE_MEASURE = "measure"
STAGE_BATCH = "batch"
STAGE_INFERENCE = "inference"
STAGE_DRAIN = "drain"  # the job drained before the request could be served; it can be redriven
STAGE_SINK = "sink"

ALLOWED_FIELDS = ("id", "prompt", "messages", "max_tokens", "min_tokens", "temperature", "top_p", "stop",
                  "metadata", "deadline_ms", "response_format", "seed", "presence_penalty", "frequency_penalty",
                  "adapter")
# Request fields newer than state written by earlier versions (an update reads that state; see fingerprint).
_FIELDS_ADDED_LATER = ("min_tokens", "adapter")
# vLLM takes a 64-bit seed.
SEED_RANGE = (-2**63, 2**63 - 1)
CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 256
# Pub/Sub refuses ordering keys over 1 KB; chunks use the id as theirs.
MAX_ID_BYTES = 512
MAX_METADATA_BYTES = 64 * 1024
MAX_JSON_DEPTH = 32
# Pub/Sub refuses messages over 10 MB; a dead letter keeps its payload whole up to this size.
MAX_DEAD_LETTER_BYTES = 8 * 1024 * 1024
# The message attribute that says how to read the payload.
CONTENT_TYPE_ATTRIBUTE = "content_type"
# Set by the redrive command on a request the template had already prepared (defaults applied): parsing
# applies system_prompt, prompt_template and response_schema only to requests without it.
PREPARED_ATTRIBUTE = "llm_template_prepared"
CONTENT_TYPE_JSON, CONTENT_TYPE_TEXT = "application/json", "text/plain"


class RequestError(ValueError):
    """A request that cannot be served as written; the message is shown to users."""


@dataclass(frozen=True)
class InferenceRequest:
    """One prompt with its own sampling parameters (None means the server's default)."""

    id: str
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    max_tokens: int | None = None
    # vLLM's min_tokens: no end token and no stop string before this many tokens (equal to max_tokens: a fixed
    # answer length, which is how benchmarks compare equal work).
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # Optional: the request must finish within this many ms of its receipt, or become a dead letter.
    deadline_ms: int | None = None
    # OpenAI's response_format: constrains the answer to JSON (see pipeline.contract.structured_output).
    response_format: Mapping[str, Any] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # A LoRA adapter the job serves (template parameter lora_adapters); None: the model itself.
    adapter: str | None = None
    received_at: float = 0.0
    # Filled in by length bucketing; the estimate is good enough for routing.
    prompt_tokens: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    def to_payload(self) -> str:
        """The request as a publisher would send it: what a redrive republishes to an input topic."""
        fields = {name: value for name, value in dataclasses.asdict(self).items()
                  if value is not None and name not in ("received_at", "prompt_tokens")}
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> InferenceRequest:
        """A request as :meth:`to_json` wrote it, possibly by another version of this code (a state cell
        after an update); raises ValueError, naming what does not fit, never a bare TypeError."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"a stored request is not JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ValueError("a stored request is not an object with a string id")
        unknown = sorted(set(data) - _DATACLASS_FIELDS)
        if unknown:
            raise ValueError(f"a stored request has fields this version does not know: {', '.join(unknown)[:200]}")
        for name in ("messages", "stop"):
            if data.get(name) is not None:
                if not isinstance(data[name], list):
                    raise ValueError(f"a stored request's {name!r} is not a list")
                data[name] = tuple(data[name])
        return cls(**data)

    def fingerprint(self) -> str:
        """What the request asks for, without when it arrived: equal for a redelivery or publisher retry."""
        fields = dataclasses.asdict(self)
        for name in ("received_at", "prompt_tokens"):
            fields.pop(name)
        for name in _FIELDS_ADDED_LATER:  # unset, they leave a fingerprint as earlier versions stored it
            if fields[name] is None:
                fields.pop(name)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()[:32]

    def prompt_text(self) -> str:
        """The text a length estimate should look at, for either prompt form."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or ())


_DATACLASS_FIELDS = frozenset(f.name for f in dataclasses.fields(InferenceRequest))


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed output; ``seq`` is gapless per ``stream``.

    ``stream`` names one generation of a request: random, so no other stream,
    on this worker or another, can share it. ``attempt`` counts a request's
    generations for people; two workers can both reach the same attempt.
    """

    id: str
    attempt: int
    stream: str
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
    """The final record of one request; ``stream`` names the chunks that add up to ``text``."""

    id: str
    attempt: int
    stream: str
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
    # With a response_format: the parsed answer, or why there is none.
    output_json: Any = None
    output_error: str | None = None
    # The LoRA adapter that answered; None: the model itself.
    adapter: str | None = None
    # What it cost: how long it waited before the model took it, how long the model then took from its first
    # token to its last, and its share of the model's busy time (docs/contract.md#what-each-answer-cost).
    queue_ms: float | None = None
    decode_ms: float | None = None
    accelerator_seconds: float | None = None
    # What produced it: weights, engine, image, settings and sampling as applied (docs/contract.md#lineage).
    lineage: Mapping[str, Any] | None = None

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
    payload_truncated: bool = False
    # For a request that reached the model: its share of the model's busy time, spent on an answer it did not get.
    accelerator_seconds: float | None = None

    @classmethod
    def from_bytes(cls, stage: str, reason: str, data: bytes, **kwargs: Any) -> DeadLetter:
        try:
            return cls(stage, reason, data.decode("utf-8"), "utf-8", at=kwargs.pop("at", time.time()), **kwargs)
        except UnicodeDecodeError:
            payload = base64.b64encode(data).decode("ascii")
            return cls(stage, reason, payload, "base64", at=kwargs.pop("at", time.time()), **kwargs)

    def to_json(self) -> str:
        """The record as JSON, its payload cut to fit :data:`MAX_DEAD_LETTER_BYTES` (and flagged) if need be."""
        text = json.dumps(dataclasses.asdict(self), separators=(",", ":"))
        if len(text) <= MAX_DEAD_LETTER_BYTES:
            return text
        # JSON escaping can grow a character to 12 bytes; cut with room to spare.
        keep = max(0, len(self.payload) - (len(text) - MAX_DEAD_LETTER_BYTES) - 1024)
        while True:
            text = json.dumps(dataclasses.asdict(dataclasses.replace(
                self, payload=self.payload[:keep], payload_truncated=True)), separators=(",", ":"))
            if len(text) <= MAX_DEAD_LETTER_BYTES:
                return text
            keep //= 2

    def to_record(self) -> dict[str, Any]:
        """The JSON-ready dict every stage emits as a dead letter: :meth:`to_json`'s record, cut to fit."""
        return json.loads(self.to_json())

    @classmethod
    def from_json(cls, data: str | bytes) -> DeadLetter:
        """A record as :meth:`to_json` wrote it (a dead-letter message); raises ValueError if it is not one."""
        try:
            record = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a JSON dead-letter record: {exc}") from None
        if not isinstance(record, dict) or not all(isinstance(record.get(name), str)
                                                    for name in ("stage", "reason", "payload")):
            raise ValueError("not a dead-letter record: stage, reason and payload must be strings")
        attributes = record.get("attributes") or {}
        if not isinstance(attributes, dict) or record.get("payload_encoding", "utf-8") not in ("utf-8", "base64"):
            raise ValueError("not a dead-letter record: attributes or payload_encoding of the wrong kind")
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {name: value for name, value in record.items() if name in known}
        fields["attributes"] = {str(k): str(v) for k, v in attributes.items()}
        return cls(**fields)

    def original_bytes(self) -> bytes:
        """The message as it arrived (or as a drain prepared it), decoded from its payload encoding."""
        if self.payload_encoding == "base64":
            return base64.b64decode(self.payload)
        return self.payload.encode("utf-8")


@dataclass(frozen=True)
class RequestLimits:
    """Pipeline-wide limits that a request's own parameters are checked against."""

    default_max_tokens: int = default("default_max_tokens")
    max_model_len: int = default("max_model_len")
    max_prompt_chars: int = 200_000
    # The LoRA adapters a request may name; None: any (a server the job does not run decides).
    adapters: tuple[str, ...] | None = ()


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

    def dead(stage: str, reason: str, request_id: str | None = fallback_id) -> DeadLetter:
        return DeadLetter.from_bytes(stage, reason, data, id=request_id, attributes=attributes, at=received_at)

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
        return _validated(fields, request_id, limits, received_at)
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
    temperature = _optional_number(fields, "temperature", low=0.0, high=2.0)
    top_p = _optional_number(fields, "top_p", low=0.0, high=1.0, low_inclusive=False)
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
    presence_penalty = _optional_number(fields, "presence_penalty", low=-2.0, high=2.0)
    frequency_penalty = _optional_number(fields, "frequency_penalty", low=-2.0, high=2.0)
    adapter = fields.get("adapter")
    if adapter is not None:
        if not isinstance(adapter, str) or not 0 < len(adapter) <= 256:
            raise RequestError(f"'adapter' must be the name of a LoRA adapter, got {str(adapter)[:40]}")
        if limits.adapters is not None and adapter not in limits.adapters:
            served = (f"it serves {', '.join(map(repr, limits.adapters))}" if limits.adapters
                      else "it serves none (template parameter lora_adapters)")
            raise RequestError(f"adapter {adapter[:80]!r} is not served by this job: {served}; "
                               "leave 'adapter' out for the model itself")
    deadline_ms = fields.get("deadline_ms")
    if deadline_ms is not None and (not _is_int(deadline_ms) or not 0 < deadline_ms <= 7 * 24 * 3600 * 1000):
        raise RequestError(f"'deadline_ms' must be a whole number of milliseconds from 1 to 604800000 "
                           f"(a week), got {deadline_ms!r}")
    return InferenceRequest(
        id=request_id, prompt=prompt, messages=messages, max_tokens=max_tokens, min_tokens=min_tokens,
        temperature=temperature, top_p=top_p, stop=stop, metadata=metadata, deadline_ms=deadline_ms,
        response_format=response_format, seed=seed, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, adapter=adapter, received_at=received_at)


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

