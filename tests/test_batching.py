"""Timer-bounded length bucketing: deterministic TestStream runs and property tests."""

from __future__ import annotations

import uuid
from collections import defaultdict

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.testing.test_stream import TestStream as EventStream  # not a test class
from apache_beam.transforms import window
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.static_batches import ARRIVAL, LENGTH_BUCKETS, PROMPT_BUCKETS, batching_config, burst_batches
from pipeline.contract.messages import InferenceRequest
from pipeline.flow.batching import (FLUSH_BUDGET, FLUSH_SIZE, BatchingConfig, BatchRequests, _BatchFn, _keyed, padding)
from tests.state_stand_in import Cell, Timer

_COLLECTED: dict[str, list] = defaultdict(list)


class _Collect(beam.DoFn):
    def __init__(self, run_id: str) -> None:
        self._run_id = run_id

    def process(self, batch):
        shard, requests = batch
        _COLLECTED[self._run_id].append([(r.id, r.prompt_tokens) for r in requests])


def request(request_id: str, tokens: int = 10, max_tokens: int | None = None) -> InferenceRequest:
    return InferenceRequest(id=request_id, prompt="x" * tokens, prompt_tokens=tokens, max_tokens=max_tokens)


def run_batching(stream: EventStream, config: BatchingConfig, *, windowed: float | None = None):
    """Runs BatchRequests over ``stream``.

    Returns the batches in emission order (as (id, tokens) lists) and the flush
    counters. The DirectRunner drops metrics updated in timer callbacks, so
    only size and budget flushes are counted here; timer and watermark flushes
    are asserted from which batches form, and when.
    """
    run_id = uuid.uuid4().hex
    options = PipelineOptions(flags=[], runner="BundleBasedDirectRunner")
    options.view_as(StandardOptions).streaming = True
    pipeline = beam.Pipeline(options=options)
    requests = pipeline | stream
    if windowed:
        requests = requests | beam.WindowInto(window.FixedWindows(windowed))
    # TestStream's processing clock starts at 0 and only moves when the test advances it.
    (requests | BatchRequests(config, clock=lambda: 0.0)).batches | beam.ParDo(_Collect(run_id))
    result = pipeline.run()
    result.wait_until_finish()
    flushes = {}
    for reason in (FLUSH_SIZE, FLUSH_BUDGET):
        counters = result.metrics().query(MetricsFilter().with_name(f"flushes_{reason}"))["counters"]
        flushes[reason] = sum(c.committed for c in counters)
    return _COLLECTED.pop(run_id, []), flushes


def ids(batches):
    return sorted(sorted(i for i, _ in batch) for batch in batches)


def test_a_bucket_is_emitted_when_it_reaches_the_target_size():
    config = BatchingConfig(max_batch_delay_ms=60_000, batch_size_target=3, num_shards=1)
    stream = EventStream().add_elements([request(f"r{i}") for i in range(7)]).advance_watermark_to_infinity()
    batches, flushes = run_batching(stream, config)
    assert [len(b) for b in batches] == [3, 3, 1]  # the remainder leaves when the watermark passes
    assert flushes[FLUSH_SIZE] == 2


def test_the_delay_timer_emits_a_bucket_that_did_not_fill():
    config = BatchingConfig(max_batch_delay_ms=50, batch_size_target=10, num_shards=1)
    stream = (EventStream()
              .add_elements([request("a"), request("b")])
              .advance_processing_time(0.1)  # past the 50 ms delay
              .add_elements([request("c")])
              .advance_processing_time(0.1)
              .advance_watermark_to_infinity())
    batches, flushes = run_batching(stream, config)
    # Without the timer, all three would wait for the watermark and leave as one batch.
    assert [sorted(i for i, _ in b) for b in batches] == [["a", "b"], ["c"]]
    assert flushes[FLUSH_SIZE] == 0


def test_the_watermark_flushes_each_window_when_it_closes():
    config = BatchingConfig(max_batch_delay_ms=3_600_000, batch_size_target=3, num_shards=1)
    stream = (EventStream()
              .add_elements([window.TimestampedValue(request("w0-a"), 1),
                             window.TimestampedValue(request("w0-b"), 2),
                             window.TimestampedValue(request("w1-a"), 12)])
              .advance_watermark_to(10.5)  # closes [0, 10); the hour-long delay timer cannot have fired
              .add_elements([window.TimestampedValue(request(f"w1-{x}"), 13) for x in "bc"])
              .add_elements([window.TimestampedValue(request("w1-d"), 14)])
              .advance_watermark_to_infinity())
    batches, _ = run_batching(stream, config, windowed=10)
    # Window 0 leaves when its end passes, before window 1 fills up; window 1's rest at the end.
    assert [sorted(i for i, _ in b) for b in batches] == [["w0-a", "w0-b"], ["w1-a", "w1-b", "w1-c"], ["w1-d"]]


def test_a_bucket_is_emitted_when_its_prompts_reach_the_token_budget():
    config = BatchingConfig(max_batch_delay_ms=60_000, batch_size_target=10, token_budget=100, num_shards=1)
    stream = (EventStream().add_elements([request("a", 40), request("b", 40), request("c", 40), request("d", 40)])
              .advance_watermark_to_infinity())
    batches, flushes = run_batching(stream, config)
    assert ids(batches) == [["a", "b", "c"], ["d"]]
    assert flushes[FLUSH_BUDGET] == 1 and flushes[FLUSH_SIZE] == 0


def test_length_buckets_keep_short_and_long_prompts_apart():
    config = BatchingConfig(max_batch_delay_ms=60_000, batch_size_target=2, boundaries=(16, 64), num_shards=1)
    lengths = [10, 500, 12, 50, 600, 40]
    stream = (EventStream().add_elements([request(f"r{n}", n) for n in lengths]).advance_watermark_to_infinity())
    batches, _ = run_batching(stream, config)
    assert ids(batches) == [["r10", "r12"], ["r40", "r50"], ["r500", "r600"]]
    bucketed_padding = sum(padding([t for _, t in b])[0] for b in batches)
    arrival_order_padding = sum(padding(lengths[i:i + 2])[0] for i in range(0, len(lengths), 2))
    assert bucketed_padding * 5 < arrival_order_padding


def test_answer_buckets_keep_short_and_long_answer_budgets_apart():
    """A static batch runs until its longest answer: a 16-token label must not wait on a 256-token essay."""
    config = BatchingConfig(max_batch_delay_ms=60_000, batch_size_target=2, boundaries=(64,), num_shards=1,
                            answer_boundaries=(16, 64), default_max_tokens=200)
    budgets = {"label-a": 8, "essay-a": 256, "label-b": 16, "essay-b": None, "mid-a": 40, "mid-b": 64}
    stream = (EventStream().add_elements([request(name, 20, max_tokens) for name, max_tokens in budgets.items()])
              .advance_watermark_to_infinity())
    batches, _ = run_batching(stream, config)
    # No max_tokens counts as the default budget (200): with the 256-token essay, over 64.
    assert ids(batches) == [["essay-a", "essay-b"], ["label-a", "label-b"], ["mid-a", "mid-b"]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=st.integers(1, 5),
    delay_ms=st.sampled_from([10, 50, 200]),
    boundaries=st.sampled_from([(), (32,), (16, 64, 256)]),
    answer_boundaries=st.sampled_from([(), (16, 128)]),
    arrivals=st.lists(st.tuples(st.integers(1, 400), st.sampled_from([None, 8, 100, 300]),
                                st.sampled_from([0, 0, 0.005, 0.3])), min_size=1, max_size=25),
)
def test_the_real_dofn_emits_every_request_exactly_once_within_the_target(target, delay_ms,
                                                                         boundaries, answer_boundaries, arrivals):
    config = BatchingConfig(max_batch_delay_ms=delay_ms, batch_size_target=target, boundaries=boundaries,
                            num_shards=2, answer_boundaries=answer_boundaries)
    stream = EventStream()
    for index, (tokens, max_tokens, gap_s) in enumerate(arrivals):
        stream = stream.add_elements([request(f"r{index}", tokens, max_tokens)])
        if gap_s:
            stream = stream.advance_processing_time(gap_s)
    batches, _ = run_batching(stream.advance_watermark_to_infinity(), config)
    emitted = [i for batch in batches for i, _ in batch]
    assert sorted(emitted) == sorted(f"r{i}" for i in range(len(arrivals)))
    assert all(1 <= len(b) <= config.batch_size_target for b in batches)
    budget = {f"r{i}": max_tokens for i, (_, max_tokens, _) in enumerate(arrivals)}
    assert all(len({config.bucket_name(t, budget[i]) for i, t in b}) == 1 for b in batches)


class _GlobalWindow:
    def max_timestamp(self):
        return window.GlobalWindow().max_timestamp()


def batch_on_a_clock(config: BatchingConfig, arrivals: list[tuple[float, InferenceRequest]]):
    """The real batching DoFn, each key's state kept between calls and its delay timer fired at its deadline.

    Returns (batches of ids, each request's wait from arrival to emission).
    """
    now = [0.0]
    batcher = _BatchFn(config, clock=lambda: now[0])
    keys: dict[str, tuple[Cell, Cell, Timer]] = {}
    batches, arrived, waits = [], {}, {}

    def collect(outputs) -> None:
        for shard, requests in outputs:
            batches.append([r.id for r in requests])
            waits.update({r.id: now[0] - arrived[r.id] for r in requests})

    def fire_until(until: float) -> None:
        while due := sorted((timer.at, key) for key, (_, _, timer) in keys.items()
                            if timer.at is not None and timer.at <= until):
            now[0], key = due[0]
            buffer, counters, timer = keys[key]
            timer.clear()  # a timer that fires is cleared unless the callback sets it again
            collect(batcher.on_flush(key=key, buffer=buffer, counters=counters))

    for at, request in arrivals:
        fire_until(at)
        now[0] = max(now[0], at)
        (key, keyed), = _keyed(config, request)
        buffer, counters, timer = keys.setdefault(key, (Cell(), Cell(), Timer()))
        arrived[request.id] = now[0]
        collect(batcher.process((key, keyed), window=_GlobalWindow(), buffer=buffer, counters=counters,
                                flush=timer, window_end=Timer()))
    fire_until(float("inf"))
    return batches, waits


@settings(max_examples=200, deadline=None)
@given(
    target=st.integers(1, 8),
    delay_ms=st.floats(0, 500),
    budget=st.one_of(st.none(), st.integers(1, 2000)),
    boundaries=st.sampled_from([(), (64,), (16, 128)]),
    arrivals=st.lists(st.tuples(st.floats(0, 2), st.integers(1, 600), st.sampled_from([None, 16, 256])),
                      max_size=60),
)
def test_the_batcher_emits_each_request_once_within_its_delay_and_batch_size(target, delay_ms, budget, boundaries,
                                                                            arrivals):
    config = BatchingConfig(max_batch_delay_ms=delay_ms, batch_size_target=target, token_budget=budget,
                            boundaries=boundaries, num_shards=2)
    arrivals = sorted(arrivals, key=lambda a: a[0])
    timed = [(at, request(f"r{i}", tokens, max_tokens)) for i, (at, tokens, max_tokens) in enumerate(arrivals)]
    batches, waits = batch_on_a_clock(config, timed)
    assert sorted(i for batch in batches for i in batch) == sorted(r.id for _, r in timed)
    assert all(1 <= len(batch) <= config.batch_size_target for batch in batches)
    assert all(wait <= delay_ms / 1000 + 1e-9 for wait in waits.values())
    if budget is not None:  # a batch leaves once it reaches the budget: no request joins a full one
        tokens = {r.id: r.prompt_tokens for _, r in timed}
        assert all(sum(tokens[i] for i in batch[:-1]) < budget for batch in batches)


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size_target=0), "batch_size_target must be at least 1"),
    (dict(max_batch_delay_ms=-1), "max_batch_delay_ms must be at least 0"),
    (dict(boundaries=(64, 32)), "strictly increasing"),
    (dict(boundaries=(0, 32)), "positive token counts"),
    (dict(token_budget=0), "batch_token_budget must be at least 1"),
    (dict(num_shards=10_001), "num_shards must be at most 10000"),
])
def test_invalid_batching_config_says_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        BatchingConfig(**kwargs)
    assert message in str(excinfo.value)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=st.integers(1, 5),
    batching=st.sampled_from([ARRIVAL, PROMPT_BUCKETS, LENGTH_BUCKETS]),
    shapes=st.lists(st.tuples(st.integers(1, 1500), st.sampled_from([8, 16, 32, 96, 300])), min_size=1, max_size=20),
)
def test_the_static_engine_benchmark_forms_the_batches_the_real_batcher_forms_for_a_burst(target, batching, shapes):
    """make bench-static-batches feeds the engine what the batcher would (benchmarks/static_batches.py): for a
    burst, the real DoFn's batches are the benchmark's, request for request."""
    config = batching_config(batching, target, max_model_len=2048)
    sent = [request(f"r{n}", tokens, max_tokens) for n, (tokens, max_tokens) in enumerate(shapes)]
    batches, _ = run_batching(EventStream().add_elements(sent).advance_watermark_to_infinity(), config)
    assert ids(batches) == ids([[(r.id, r.prompt_tokens) for r in batch] for batch in burst_batches(config, sent)])
