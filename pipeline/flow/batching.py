"""Timer-bounded batching, optionally by prompt length.

Requests are keyed by ``(length bucket, shard)`` and buffered in a stateful
DoFn: BagState holds the requests, a small value state counts them and their
tokens. A bucket is emitted when it reaches ``batch_size_target`` requests or
its token budget, or when ``max_batch_delay_ms`` has passed since its first
request (a processing-time timer), whichever comes first; an event-time timer
at the end of the window flushes whatever is left when the watermark passes
(window end, drain). No batch ever exceeds ``batch_size_target``.

With no bucket boundaries there is a single bucket: plain arrival-order batching.

A job with a bulk lane keys that lane's requests apart (``bulk.`` before the bucket), so a batch is of one lane
and the generate step can serve the live lane's first (:mod:`pipeline.generation.key_machine`).

Answer buckets (``answer_boundaries``) split each prompt bucket by the
request's answer budget, ``max_tokens``. A static batch runs until its longest
answer ends, so a 16-token classification batched with a 256-token essay
computes up to 240 padded steps; vLLM's continuous batching pads nothing, so there
the split only makes batches smaller.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.coders import StrUtf8Coder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Timestamp

from pipeline.contract.element_guard import TAG_DEAD_LETTERS, guarded, guarded_value
from pipeline.contract.keying import bucket_index, shard_of
from pipeline.contract.messages import STAGE_BATCH, DeadLetter, InferenceRequest
from pipeline.contract.parameter_checks import ParameterProblems, check_parameters
from pipeline.contract.parameters import default
from pipeline.contract.state_format import check_cell, read_cell, write_cell
from pipeline.intake.prompt_length import estimate_tokens

LOGGER = logging.getLogger(__name__)
FLUSH_SIZE, FLUSH_BUDGET, FLUSH_TIMER, FLUSH_WATERMARK = "size", "budget", "timer", "watermark"
# Counters: version 1 was a bare [count, tokens] list.
COUNTERS_VERSION = 2
# Buffer entries: version 1 had no "v" (the same fields); see pipeline.contract.state_format.
BUFFER_VERSION = 2


@dataclass(frozen=True)
class BatchingConfig:
    """Batching settings in the vocabulary of serving systems (Wallaroo, Triton)."""

    max_batch_delay_ms: float = float(default("max_batch_delay_ms"))
    batch_size_target: int = default("batch_size_target")
    token_budget: int | None = None  # None: no token budget
    boundaries: tuple[int, ...] = ()  # upper token bounds of all but the last bucket
    num_shards: int = default("num_shards")
    answer_boundaries: tuple[int, ...] = ()  # upper max_tokens bounds of answer buckets; (): not split
    default_max_tokens: int = default("default_max_tokens")  # the answer budget of a request that sets none

    def __post_init__(self) -> None:
        check_parameters({"max_batch_delay_ms": self.max_batch_delay_ms, "batch_size_target": self.batch_size_target,
                          "num_shards": self.num_shards,
                          **({} if self.token_budget is None else {"batch_token_budget": self.token_budget})})
        problems = _boundary_problems("bucket boundaries", self.boundaries)
        problems += _boundary_problems("answer bucket boundaries", self.answer_boundaries)
        if problems:
            raise ParameterProblems(*problems)

    def bucket_of(self, prompt_tokens: int) -> int:
        return bucket_index(self.boundaries, prompt_tokens)

    def bucket_name(self, prompt_tokens: int, max_tokens: int | None) -> str:
        """The prompt bucket, and with answer buckets ``"prompt.answer"``: requests batched together."""
        name = str(self.bucket_of(prompt_tokens))
        if self.answer_boundaries:
            name += f".{bucket_index(self.answer_boundaries, max_tokens or self.default_max_tokens)}"
        return name


def _boundary_problems(what: str, boundaries: tuple[int, ...]) -> list[str]:
    if any(b <= 0 for b in boundaries):
        return [f"{what} must be positive token counts, got {list(boundaries)}"]
    if list(boundaries) != sorted(set(boundaries)):
        return [f"{what} must be strictly increasing, got {list(boundaries)}"]
    return []


def parse_boundaries(text: str) -> tuple[int, ...]:
    """'64, 128,256' -> (64, 128, 256); order and sign are checked by BatchingConfig."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"bucket boundaries must be comma-separated whole numbers, got {text!r}") from None


def default_boundaries(max_model_len: int, smallest: int = 32) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to (not including) the model's context."""
    bounds, bound = [], smallest
    while bound < max_model_len:
        bounds.append(bound)
        bound *= 2
    return tuple(bounds)


@dataclass(frozen=True)
class BucketCounters:
    """What a bucket keeps beside its buffered requests."""

    count: int = 0
    tokens: int = 0

    def to_json(self) -> str:
        return write_cell({"count": self.count, "tokens": self.tokens}, COUNTERS_VERSION)

    @classmethod
    def from_json(cls, text: str | None) -> BucketCounters:
        """The counters as :meth:`to_json` wrote them, or as version 1 did (a bare ``[count, tokens]``); an
        unreadable cell (another version's) counts from zero: the bucket then leaves on its delay timer or a
        later arrival, with nothing lost."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
            if isinstance(data, list) and len(data) == 2:  # version 1
                data = {"count": data[0], "tokens": data[1], "v": 1}
            fields = check_cell(data, (1, COUNTERS_VERSION), {"count": (int,), "tokens": (int,)})
            if fields["count"] >= 0 and fields["tokens"] >= 0:
                return cls(fields["count"], fields["tokens"])
        except (ValueError, TypeError):  # StateFormatError is a ValueError
            pass
        Metrics.counter("bucketing", "undecodable_state_entries").inc()
        LOGGER.error("A batcher's counters cannot be read (%r); counting from zero", text[:80])
        return cls()


def on_arrival(config: BatchingConfig, counters: BucketCounters, prompt_tokens: int,
               now: float) -> tuple[BucketCounters, str | None, float | None]:
    """The batching decision for one arriving request.

    Returns the bucket's new counters, the flush reason if the bucket must be
    emitted now, and the deadline for the delay timer when this request is the
    bucket's first (else None).
    """
    counters = BucketCounters(counters.count + 1, counters.tokens + prompt_tokens)
    deadline = now + config.max_batch_delay_ms / 1000.0 if counters.count == 1 else None
    if counters.count >= config.batch_size_target:
        return counters, FLUSH_SIZE, deadline
    if config.token_budget is not None and counters.tokens >= config.token_budget:
        return counters, FLUSH_BUDGET, deadline
    return counters, None, deadline


def padding(lengths: list[int]) -> tuple[int, int]:
    """(padding tokens, padded batch tokens) if the batch were padded to its longest prompt."""
    longest = max(lengths, default=0)
    return sum(longest - n for n in lengths), longest * len(lengths)


class _BatchFn(beam.DoFn):
    BUFFER = BagStateSpec("buffer", StrUtf8Coder())
    # BucketCounters as JSON: one read and one write per element.
    COUNTERS = ReadModifyWriteStateSpec("counters", StrUtf8Coder())
    FLUSH = TimerSpec("flush", TimeDomain.REAL_TIME)
    WINDOW_END = TimerSpec("window_end", TimeDomain.WATERMARK)

    def __init__(self, config: BatchingConfig, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self.batch_size = Metrics.distribution("bucketing", "batch_size")
        self.wait_ms = Metrics.distribution("bucketing", "wait_in_bucket_ms")
        self.padding_tokens = Metrics.counter("bucketing", "padding_tokens")
        self.batch_tokens = Metrics.counter("bucketing", "padded_batch_tokens")
        self.undecodable = Metrics.counter("bucketing", "undecodable_state_entries")
        self.flushes = {reason: Metrics.counter("bucketing", f"flushes_{reason}")
                        for reason in (FLUSH_SIZE, FLUSH_BUDGET, FLUSH_TIMER, FLUSH_WATERMARK)}

    def process(self, element: tuple[str, InferenceRequest],
                window=beam.DoFn.WindowParam,
                buffer=beam.DoFn.StateParam(BUFFER),
                counters=beam.DoFn.StateParam(COUNTERS),
                flush=beam.DoFn.TimerParam(FLUSH),
                window_end=beam.DoFn.TimerParam(WINDOW_END)) -> Iterator[Any]:
        key, request = element
        # The arriving request is the only thing here that can fail because of an element.
        entry, dead_letter = guarded_value(
            STAGE_BATCH, request, lambda: write_cell({"request": request.to_json(), "arrived_at": self._clock()},
                                                     BUFFER_VERSION))
        if dead_letter is not None:
            yield dead_letter
            return
        now = self._clock()
        counters_before = BucketCounters.from_json(counters.read())
        after, reason, deadline = on_arrival(self._config, counters_before, request.prompt_tokens or 0, now)
        buffer.add(entry)
        if deadline is not None:
            flush.set(Timestamp(deadline))
            window_end.set(window.max_timestamp())
        if reason is None:
            counters.write(after.to_json())
        else:
            yield from self._emit(key, buffer, counters, reason, flush)

    @on_timer(FLUSH)
    def on_flush(self, key=beam.DoFn.KeyParam, buffer=beam.DoFn.StateParam(BUFFER),
                 counters=beam.DoFn.StateParam(COUNTERS)) -> Iterator[Any]:
        yield from self._emit(key, buffer, counters, FLUSH_TIMER)

    @on_timer(WINDOW_END)
    def on_window_end(self, key=beam.DoFn.KeyParam, buffer=beam.DoFn.StateParam(BUFFER),
                      counters=beam.DoFn.StateParam(COUNTERS)) -> Iterator[Any]:
        yield from self._emit(key, buffer, counters, FLUSH_WATERMARK)

    def _emit(self, key: str, buffer, counters, reason: str, flush=None) -> Iterator[Any]:
        entries = []
        for text in buffer.read():
            try:  # an entry of another version, or damaged: a dead letter with its text, and the bucket goes on
                entry = read_cell(text, (1, BUFFER_VERSION), {"request": (str,), "arrived_at": (int, float)})
                entries.append((InferenceRequest.from_json(entry["request"]), entry["arrived_at"]))
            except ValueError as exc:
                self.undecodable.inc()
                LOGGER.error("A batcher state entry cannot be decoded (%s); it goes to the dead letters", exc)
                yield pvalue.TaggedOutput(TAG_DEAD_LETTERS, DeadLetter(
                    STAGE_BATCH, f"state entry could not be decoded after an update: {exc}", text,
                    at=time.time()).to_record())
        buffer.clear()
        counters.clear()
        if flush is not None:
            flush.clear()
        if not entries:
            return  # a timer may fire twice for one setting, or after a size flush
        now = self._clock()
        self.flushes[reason].inc()
        LOGGER.debug("Bucket %s: %d requests leave (%s)", key, len(entries), reason)
        shard = int(key.rsplit(":", 1)[1])
        # A bucket leaves as soon as it holds batch_size_target requests, so it is one batch.
        requests = [request for request, _ in entries]
        padded, total = padding([r.prompt_tokens or 0 for r in requests])
        self.batch_size.update(len(requests))
        self.batch_tokens.inc(total)
        self.padding_tokens.inc(padded)
        for _, arrived_at in entries:
            self.wait_ms.update(int((now - arrived_at) * 1000))
        yield shard, requests


class BatchOutputs(NamedTuple):
    batches: beam.PCollection  # (shard, [InferenceRequest, ...])
    dead_letters: beam.PCollection


def batch_key(config: BatchingConfig, request: InferenceRequest) -> str:
    """The batcher's key for ``request``: its lane, length bucket and shard (and the generate step's key, unless
    that step re-keys by ``generate_shards``)."""
    tokens = request.prompt_tokens
    if tokens is None:
        tokens = estimate_tokens(request.prompt_text())
    lane = "bulk." if request.bulk else ""  # a batch is of one lane: the generate step serves live first
    return f"{lane}{config.bucket_name(tokens, request.max_tokens)}:{shard_of(request.id, config.num_shards)}"


def _keyed(config: BatchingConfig, request: InferenceRequest) -> Iterator[tuple[str, InferenceRequest]]:
    yield batch_key(config, request), request


class _KeyFn(beam.DoFn):
    def __init__(self, config: BatchingConfig) -> None:
        self._config = config

    def process(self, request: InferenceRequest) -> Iterator[Any]:
        return guarded(STAGE_BATCH, request, lambda: _keyed(self._config, request))


class BatchRequests(beam.PTransform):
    """Requests in; ``batches`` of ``(shard, [request, ...])`` and ``dead_letters`` out, per :class:`BatchingConfig`.

    Requests need ``prompt_tokens`` set when bucket boundaries or a token budget
    are used (see :class:`MeasurePromptLength`); otherwise a cheap estimate is used.
    """

    def __init__(self, config: BatchingConfig, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self._config = config
        self._clock = clock

    def expand(self, requests):
        # Typed keys give the stateful steps deterministic key coders.
        keyed = requests | "KeyByBucketAndShard" >> beam.ParDo(_KeyFn(self._config)).with_output_types(
            tuple[str, InferenceRequest]).with_outputs(TAG_DEAD_LETTERS, main="keyed")
        batched = keyed.keyed | "Batch" >> beam.ParDo(_BatchFn(self._config, self._clock)).with_output_types(
            tuple[int, list[InferenceRequest]]).with_outputs(TAG_DEAD_LETTERS, main="batches")
        dead_letters = (keyed.dead_letters, batched.dead_letters) | "BatchDeadLetters" >> beam.Flatten()
        return BatchOutputs(batched.batches, dead_letters)
