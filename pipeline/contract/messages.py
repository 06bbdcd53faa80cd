"""The message contract's records: inference requests in, chunks, completions and dead letters out.

Each record is a frozen dataclass with its JSON form; how a Pub/Sub message
becomes an :class:`InferenceRequest` (or a :class:`DeadLetter` with a reason a
person can act on) is :mod:`pipeline.contract.request_parsing`. A dead letter
keeps its payload whole up to what Pub/Sub and BigQuery take.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.contract.request_fields import FINGERPRINTED_WHEN_UNSET

# Stages a dead letter can come from, so operators can filter by where it failed.
STAGE_PARSE = "parse"
STAGE_VALIDATE = "validate"
STAGE_MEASURE = "measure"
STAGE_BATCH = "batch"
STAGE_INFERENCE = "inference"
STAGE_DRAIN = "drain"  # the job drained before the request could be served; it can be redriven
STAGE_SINK = "sink"
# How an inference letter's reason begins when the model server refused the request for what it is (an HTTP 4xx
# answer: too long for its context, a schema it cannot use, an adapter it does not have): sent again unchanged, it
# gets the same answer (ops/backfill.py does not resend it).
REFUSED_BY_SERVER = "the server rejected the request"

# Pub/Sub refuses messages over 10 MB; a dead letter keeps its payload whole up to this size.
MAX_DEAD_LETTER_BYTES = 8 * 1024 * 1024
# Set by the redrive command on a request the template had already prepared (defaults applied): parsing
# applies system_prompt, prompt_template and response_schema only to requests without it.
PREPARED_ATTRIBUTE = "llm_template_prepared"
# The two lanes a job serves (docs/operations.md#the-bulk-lane): live, its input subscription, and bulk, its
# bulk_subscription, served with what live traffic leaves. The bulk read marks its messages with the attribute; a
# publisher may mark a live message bulk too (it only lowers its own place), never a bulk one live.
LANE_LIVE = "live"
LANE_BULK = "bulk"
LANE_ATTRIBUTE = "llm_template_lane"


def lane_marked(attributes: Mapping[str, str] | None) -> str | None:
    """The lane a message's attributes mark: LANE_BULK, or None (live)."""
    return LANE_BULK if (attributes or {}).get(LANE_ATTRIBUTE) == LANE_BULK else None


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
    repetition_penalty: float | None = None
    # A LoRA adapter the job serves (template parameter lora_adapters); None: the model itself.
    adapter: str | None = None
    received_at: float = 0.0
    # Filled in by length bucketing; the estimate is good enough for routing.
    prompt_tokens: int | None = None
    # LANE_BULK for a request of the bulk lane; None: live. Set by the read, not by the message's fields.
    lane: str | None = None

    @property
    def bulk(self) -> bool:
        return self.lane == LANE_BULK

    def lane_name(self) -> str:
        """The lane as completions and dead letters record it."""
        return self.lane or LANE_LIVE

    def _fields(self) -> dict[str, Any]:
        """The fields by name, in order, values as they are: what ``dataclasses.asdict`` gives for this record
        (no field is a dataclass), without its deep copy, which the key machine paid on every step."""
        return {name: getattr(self, name) for name in _FIELD_ORDER}

    def to_json(self) -> str:
        """Every field, but an unset one the first stored state did not have: code from before it came reads this
        too (a rollback update reads the state this wrote, and refuses fields it does not know)."""
        return json.dumps({name: value for name, value in self._fields().items()
                           if value is not None or name in FINGERPRINTED_WHEN_UNSET}, separators=(",", ":"))

    def to_payload(self) -> str:
        """The request as a publisher would send it: what a redrive republishes to an input topic."""
        fields = {name: value for name, value in self._fields().items()
                  if value is not None and name not in ("received_at", "prompt_tokens", "lane")}
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
        """What the request asks for, without when or on which lane it arrived: equal for a redelivery, a publisher
        retry, or the same request on the other lane (one is served, the other dropped as its copy)."""
        fields = self._fields()
        for name in ("received_at", "prompt_tokens", "lane"):
            fields.pop(name)
        for name in [name for name, value in fields.items() if value is None]:
            if name not in FINGERPRINTED_WHEN_UNSET:  # unset, a later field leaves the fingerprint as it was
                fields.pop(name)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()[:32]

    def prompt_text(self) -> str:
        """The text a length estimate should look at, for either prompt form."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or ())


_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(InferenceRequest))
_DATACLASS_FIELDS = frozenset(_FIELD_ORDER)


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
    lane: str = LANE_LIVE  # live, or bulk: which of the job's inputs it came from

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
    lane: str = LANE_LIVE  # live, or bulk: which of the job's inputs it came from

    @classmethod
    def of_request(cls, stage: str, reason: str, request: InferenceRequest, *, payload: str | None = None,
                   **kwargs: Any) -> DeadLetter:
        """A request's letter: its id and lane, and the request itself as its payload unless another is given."""
        return cls(stage, reason, request.to_json() if payload is None else payload, id=request.id,
                   lane=request.lane_name(), **kwargs)

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
