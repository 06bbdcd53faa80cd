"""Timer-bounded batching, optionally by prompt length.

Requests are keyed by ``(length bucket, shard)`` and buffered in a stateful
DoFn: BagState holds the requests, a small value state counts them and their
tokens. A bucket is emitted when it reaches ``batch_size_target`` requests or
its token budget, or when ``max_batch_delay_ms`` has passed since its first
request (a processing-time timer), whichever comes first; an event-time timer
at the end of the window flushes whatever is left when the watermark passes
(window end, drain). No batch ever exceeds ``batch_size_limit``.

With no bucket boundaries there is a single bucket: plain arrival-order batching.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import apache_beam as beam
from apache_beam.coders import StrUtf8Coder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Duration, Timestamp

from pipeline.messages import InferenceRequest

FLUSH_SIZE, FLUSH_BUDGET, FLUSH_TIMER, FLUSH_WATERMARK = "size", "budget", "timer", "watermark"


@dataclass(frozen=True)
class BatchingConfig:
    """Batching settings in the vocabulary of serving systems (Wallaroo, Triton)."""

    max_batch_delay_ms: float = 10.0
    batch_size_target: int = 4
    batch_size_limit: int | None = None  # None: the target is the limit
    token_budget: int | None = None  # None: no token budget
    boundaries: tuple[int, ...] = ()  # upper token bounds of all but the last bucket
    num_shards: int = 16

    def __post_init__(self) -> None:
        problems = []
        if self.max_batch_delay_ms < 0:
            problems.append(f"max_batch_delay_ms must be 0 or more, got {self.max_batch_delay_ms}")
        if self.batch_size_target <= 0:
            problems.append(f"batch_size_target must be at least 1, got {self.batch_size_target}")
        if self.batch_size_limit is not None:
            if self.batch_size_limit <= 0:
                problems.append(f"batch_size_limit must be at least 1, got {self.batch_size_limit}")
            elif self.batch_size_limit < self.batch_size_target:
                problems.append(f"batch_size_limit ({self.batch_size_limit}) is smaller than batch_size_target "
                                f"({self.batch_size_target}); raise the limit or lower the target")
        if self.token_budget is not None and self.token_budget <= 0:
            problems.append(f"token budget must be positive, got {self.token_budget}")
        if any(b <= 0 for b in self.boundaries):
            problems.append(f"bucket boundaries must be positive token counts, got {list(self.boundaries)}")
        elif list(self.boundaries) != sorted(set(self.boundaries)):
            problems.append(f"bucket boundaries must be strictly increasing, got {list(self.boundaries)}")
        if self.num_shards <= 0:
            problems.append(f"num_shards must be at least 1, got {self.num_shards}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def limit(self) -> int:
        return self.batch_size_limit or self.batch_size_target

    def bucket_of(self, prompt_tokens: int) -> int:
        """Bucket i holds lengths in (boundaries[i-1], boundaries[i]]; the last is open."""
        return bisect.bisect_left(self.boundaries, prompt_tokens)


def shard_of(request_id: str, num_shards: int) -> int:
    """A stable shard for a request id (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "big") % num_shards


def estimate_tokens(text: str) -> int:
    """A cheap length estimate (about four characters a token for English BPE vocabularies)."""
    return max(1, (len(text) + 3) // 4)


class _BatchFn(beam.DoFn):
    BUFFER = BagStateSpec("buffer", StrUtf8Coder())
    # {"count", "tokens", "first_at"}: one read and one write per element.
    COUNTERS = ReadModifyWriteStateSpec("counters", StrUtf8Coder())
    FLUSH = TimerSpec("flush", TimeDomain.REAL_TIME)
    WINDOW_END = TimerSpec("window_end", TimeDomain.WATERMARK)

    def __init__(self, config: BatchingConfig, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self._delay = Duration(micros=int(config.max_batch_delay_ms * 1000))
        self.batch_size = Metrics.distribution("bucketing", "batch_size")
        self.wait_ms = Metrics.distribution("bucketing", "wait_in_bucket_ms")
        self.padding_tokens = Metrics.counter("bucketing", "padding_tokens")
        self.batch_tokens = Metrics.counter("bucketing", "padded_batch_tokens")
        self.flushes = {reason: Metrics.counter("bucketing", f"flushes_{reason}")
                        for reason in (FLUSH_SIZE, FLUSH_BUDGET, FLUSH_TIMER, FLUSH_WATERMARK)}

    def process(self, element: tuple[str, InferenceRequest],
                window=beam.DoFn.WindowParam,
                buffer=beam.DoFn.StateParam(BUFFER),
                counters=beam.DoFn.StateParam(COUNTERS),
                flush=beam.DoFn.TimerParam(FLUSH),
                window_end=beam.DoFn.TimerParam(WINDOW_END)) -> Iterator[tuple[int, list[InferenceRequest]]]:
        key, request = element
        now = self._clock()
        state = json.loads(counters.read() or '{"count": 0, "tokens": 0}')
        buffer.add(json.dumps({"request": request.to_json(), "arrived_at": now}))
        state["count"] += 1
        state["tokens"] += request.prompt_tokens or 0
        if state["count"] == 1:
            flush.set(Timestamp(now) + self._delay)
            window_end.set(window.max_timestamp())
        budget = self._config.token_budget
        if state["count"] >= self._config.batch_size_target:
            yield from self._emit(key, buffer, counters, FLUSH_SIZE, flush)
        elif budget is not None and state["tokens"] >= budget:
            yield from self._emit(key, buffer, counters, FLUSH_BUDGET, flush)
        else:
            counters.write(json.dumps(state))

    @on_timer(FLUSH)
    def on_flush(self, key=beam.DoFn.KeyParam, buffer=beam.DoFn.StateParam(BUFFER),
                 counters=beam.DoFn.StateParam(COUNTERS)) -> Iterator[tuple[int, list[InferenceRequest]]]:
        yield from self._emit(key, buffer, counters, FLUSH_TIMER)

    @on_timer(WINDOW_END)
    def on_window_end(self, key=beam.DoFn.KeyParam, buffer=beam.DoFn.StateParam(BUFFER),
                      counters=beam.DoFn.StateParam(COUNTERS)) -> Iterator[tuple[int, list[InferenceRequest]]]:
        yield from self._emit(key, buffer, counters, FLUSH_WATERMARK)

    def _emit(self, key: str, buffer, counters, reason: str, flush=None) -> Iterator[tuple[int, list[InferenceRequest]]]:
        entries = [json.loads(e) for e in buffer.read()]
        buffer.clear()
        counters.clear()
        if flush is not None:
            flush.clear()
        if not entries:
            return  # a timer may fire twice for one setting, or after a size flush
        now = self._clock()
        self.flushes[reason].inc()
        shard = int(key.rsplit(":", 1)[1])
        limit = self._config.limit
        for start in range(0, len(entries), limit):
            batch = entries[start:start + limit]
            requests = [InferenceRequest.from_json(e["request"]) for e in batch]
            lengths = [r.prompt_tokens or 0 for r in requests]
            self.batch_size.update(len(requests))
            self.batch_tokens.inc(max(lengths) * len(lengths))
            self.padding_tokens.inc(sum(max(lengths) - n for n in lengths))
            for entry in batch:
                self.wait_ms.update(int((now - entry["arrived_at"]) * 1000))
            yield shard, requests


class BatchRequests(beam.PTransform):
    """Requests in, ``(shard, [request, ...])`` batches out, per :class:`BatchingConfig`.

    Requests need ``prompt_tokens`` set when bucket boundaries or a token budget
    are used (see :class:`MeasurePromptLength`); otherwise a cheap estimate is used.
    """

    def __init__(self, config: BatchingConfig, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self._config = config
        self._clock = clock

    def expand(self, requests):
        config = self._config

        def keyed(request: InferenceRequest) -> tuple[str, InferenceRequest]:
            tokens = request.prompt_tokens
            if tokens is None:
                tokens = estimate_tokens(request.prompt_text())
            bucket = config.bucket_of(tokens)
            return f"{bucket}:{shard_of(request.id, config.num_shards)}", request

        return (requests
                | "KeyByBucketAndShard" >> beam.Map(keyed)
                | "Batch" >> beam.ParDo(_BatchFn(config, self._clock)))
