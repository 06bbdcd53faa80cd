"""The engine's registry of streams (pipeline/engines/stream_registry.py), driven directly: no threads, no server,
the time passed in. Drawn sequences of submissions, outputs, polls from committed positions, cancels and lease
ticks, each checked against a model of what the poll contract promises (pipeline/engines/engine.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import CHUNK, COMPLETION, UNKNOWN
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.leases import IN_PROCESS
from pipeline.engines.stream_registry import StreamRegistry

MAX_IN_FLIGHT = 3
LEASE_S = 2.0
TICK_S = 0.5  # the registry's tick for that lease (a quarter of it)


def registry(whole_batches: bool = False, **settings_) -> StreamRegistry:
    values = dict(server=None, server_url="http://unused", max_in_flight=MAX_IN_FLIGHT, stream_lease_s=LEASE_S,
                  request_timeout_s=30.0)
    return StreamRegistry(EngineSettings(**{**values, **settings_}), "engine-1", whole_batches=whole_batches)


def request(n: int, bulk: bool = False) -> InferenceRequest:
    return InferenceRequest(id=f"r{n}", prompt=f"p{n}", lane="bulk" if bulk else None)


OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 7), st.integers(1, 3), st.booleans()),  # first id, count, bulk
    st.tuples(st.just("emit"), st.integers(0, 20), st.booleans()),  # which stream, final
    st.tuples(st.just("poll"), st.integers(0, 20)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.booleans(), st.integers(1, 6)),  # whether the worker polled others; ticks
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPERATIONS)
def test_what_a_poll_from_its_committed_position_returns_is_every_output_once_in_order(operations):
    """For every stream: a poll from the position the caller committed returns exactly the outputs emitted after
    it, in order; a finished stream whose outputs are all committed is forgotten at its next poll, and an unknown
    key is UNKNOWN, never another stream's outputs. The registry never runs more than max_in_flight streams, counts
    exactly the unfinished ones, and a submission of the same request and attempt joins its stream."""
    reg = registry()
    emitted: dict[str, list[tuple[str, str]]] = {}  # key -> every output emitted, in order
    committed: dict[str, int] = {}  # key -> how many of them the caller committed
    forgotten: set[str] = set()
    now = 0.0
    for operation in operations:
        known = sorted(emitted)
        if operation[0] == "submit":
            _, first, count, bulk = operation
            batch = [request(first + n, bulk) for n in range(count)]
            held = set(reg.streams)
            keys, started = reg.submit(batch, [1] * count, IN_PROCESS, 0.0)
            assert {s.key for s in started} == {k for k in keys if k is not None and k not in held}
            for stream in started:  # new here, or anew after it was forgotten: a stream from its start
                emitted[stream.key], committed[stream.key] = [], 0
                forgotten.discard(stream.key)
        elif operation[0] == "emit" and known:
            key = known[operation[1] % len(known)]
            stream = reg.streams.get(key)
            if stream is not None and not stream.done:
                final = operation[2]
                output = (COMPLETION, f"{key}:end") if final else (CHUNK, f"{key}:{len(emitted[key])}")
                reg.emit(stream, output, final=final)
                emitted[key].append(output)
        elif operation[0] == "poll" and known:
            key = known[operation[1] % len(known)]
            done = key in reg.streams and reg.streams[key].done
            outputs = reg.poll({key: committed[key]}, IN_PROCESS)[key]
            if key in forgotten or key not in emitted:
                assert outputs == [(UNKNOWN, "")]
            elif outputs == [(UNKNOWN, "")]:
                assert key not in reg.streams, "a registered stream answers from its committed position"
                forgotten.add(key)
            else:
                assert outputs == emitted[key][committed[key]:], "every output after the position, in order"
                if not outputs and done:
                    assert key not in reg.streams, "finished and all committed: forgotten"
                    forgotten.add(key)
                committed[key] += len(outputs)  # the caller commits what it got
        elif operation[0] == "cancel" and known:
            key = known[operation[1] % len(known)]
            reg.stop(reg.take([key]), now)
            assert key not in reg.streams
            forgotten.add(key)
        elif operation[0] == "tick":
            for _ in range(operation[2]):
                if operation[1]:
                    reg.leases.heard(IN_PROCESS, polled=True)
                now += TICK_S
                expired = reg.expire(TICK_S)
                running = [stream for stream in expired if not stream.done]
                assert reg.stop(expired, now) == running, "the running ones, for the backend to cancel"
                assert all(stream.done for stream in expired) and not {s.key for s in expired} & set(reg.streams)
            forgotten.update(key for key in emitted if key not in reg.streams)
        assert reg.unfinished == sum(not s.done for s in reg.streams.values())
        assert reg.unfinished <= MAX_IN_FLIGHT


def test_a_retried_submission_joins_its_stream_and_a_new_attempt_is_a_stream_of_its_own():
    reg = registry()
    keys, started = reg.submit([request(1)], [1], IN_PROCESS, 0.0)
    again, joined = reg.submit([request(1)], [1], IN_PROCESS, 0.0)
    assert again == keys and joined == [] and reg.unfinished == 1
    next_try, started_again = reg.submit([request(1)], [2], IN_PROCESS, 0.0)
    assert next_try != keys and len(started_again) == 1 and reg.unfinished == 2


def test_the_bulk_lane_starts_only_beside_fewer_than_its_streams_and_live_requests_take_the_rest():
    reg = registry(max_in_flight=4, live_reserve=0.5)  # bulk beside fewer than 2
    bulk_keys, _ = reg.submit([request(n, bulk=True) for n in range(4)], [1] * 4, IN_PROCESS, 0.0)
    assert sum(k is not None for k in bulk_keys) == 2
    live_keys, _ = reg.submit([request(n) for n in range(10, 14)], [1] * 4, IN_PROCESS, 0.0)
    assert sum(k is not None for k in live_keys) == 2, "live takes what the bulk lane left"


def test_a_static_engine_takes_a_batch_whole_or_not_at_all_unless_idle():
    reg = registry(whole_batches=True)
    keys, _ = reg.submit([request(n) for n in range(2)], [1, 1], IN_PROCESS, 0.0)
    assert all(keys)
    refused, started = reg.submit([request(n) for n in range(10, 12)], [1, 1], IN_PROCESS, 0.0)
    assert refused == [None, None] and not started, "two do not fit beside two of three: none taken"
    reg.stop(reg.take([k for k in keys if k]), 0.0)
    big, _ = reg.submit([request(n) for n in range(20, 25)], [1] * 5, IN_PROCESS, 0.0)
    assert all(big), "an idle engine takes a batch larger than its room, so no batch waits forever"


def test_a_stream_no_key_polls_expires_within_its_lease_and_its_model_time_is_counted():
    reg = registry()
    (key,), (stream,) = reg.submit([request(1)], [1], IN_PROCESS, 0.0)
    reg.began(stream, 100.0, 0.0)
    expired = []
    now = 0.0
    while not expired:
        reg.leases.heard(IN_PROCESS, polled=True)  # the worker polls other streams, never this one
        now += TICK_S
        expired = reg.expire(TICK_S)
    assert now <= LEASE_S + TICK_S and [s.key for s in expired] == [key]
    assert reg.stop(expired, now) == [stream], "still running: the backend must cancel it"
    assert stream.accelerator_s == now and stream.sent_at == 100.0 and reg.unfinished == 0
