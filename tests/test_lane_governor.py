"""The bulk lane's stream cap (pipeline/engines/lane_governor.py) and the engine's room for each lane under it
(pipeline/engines/stream_registry.py): the lane shrinks when live first tokens pass the objective, grows back while
they stay well below it, takes its whole share while no live request comes, and never stops a backlog for good.
What it does to live latency beside a saturating lane on the real vLLM is make bench-lanes' (benchmarks.md#lanes)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.contract.messages import LANE_BULK, InferenceRequest
from pipeline.engines import lane_governor, stream_registry
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.lane_governor import ADJUST_S, HEADROOM, IDLE_S, LaneGovernor
from pipeline.engines.stream_registry import StreamRegistry
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.worker.runtime import COUNTED_TOTALS, WorkerRuntime


def governed(objective_ms: float = 1000.0, most: int = 16) -> tuple[LaneGovernor, list[float]]:
    return LaneGovernor(objective_ms, most), [0.0]


def test_live_first_tokens_past_the_objective_halve_the_lane_each_second_down_to_one_stream():
    lane, now = governed()
    caps = []
    for second in range(8):
        now[0] = second * ADJUST_S
        lane.live_sent(now[0])
        lane.first_token(now[0], 1500.0)
        caps.append(lane.bulk_cap(now[0]))
    assert caps == [8, 4, 2, 1, 1, 1, 1, 1]


def test_well_below_the_objective_the_lane_grows_one_stream_a_second_and_between_it_stays():
    lane, _ = governed(most=6)
    lane.cap = 1
    caps = []
    for second in range(8):
        lane.live_sent(second)
        lane.first_token(second, (HEADROOM - 0.1) * 1000.0)
        caps.append(lane.bulk_cap(second, live_running=1, bulk_running=lane.cap))
    assert caps == [2, 3, 4, 5, 6, 6, 6, 6]
    unused = LaneGovernor(1000.0, 6)
    unused.cap = 2
    for second in range(4):
        unused.live_sent(second)
        unused.first_token(second, 100.0)
        assert unused.bulk_cap(second, live_running=1, bulk_running=1) == 2, "a cap the lane does not use stays"
    steady = LaneGovernor(1000.0, 6)
    steady.cap = 3
    for second in range(4):
        steady.live_sent(second)
        steady.first_token(second, 850.0)  # between HEADROOM and the objective
        assert steady.bulk_cap(second, live_running=1, bulk_running=3) == 3


def test_one_slow_first_token_halves_the_lane_once_not_once_a_second_while_it_stays_in_the_window():
    lane, _ = governed(most=64)
    lane.live_sent(0.0)
    lane.first_token(0.0, 1500.0)
    caps = []
    for second in range(6):
        lane.live_sent(float(second))
        if second:
            lane.first_token(float(second), 300.0)  # the first tokens after the halving are fast
        caps.append(lane.bulk_cap(float(second), live_running=1, bulk_running=0))
    assert caps == [32, 32, 32, 32, 32, 32], "halved on the slow one, then held: the cap is not used to grow"


def test_a_live_stream_still_running_keeps_the_lane_governed_past_idle_s():
    lane, _ = governed()
    lane.live_sent(0.0)
    lane.first_token(0.0, 5000.0)
    assert lane.bulk_cap(0.0, live_running=1) == 8
    assert lane.bulk_cap(IDLE_S + 1.0, live_running=1) == 8, "a long live answer is still running: not idle"
    assert lane.bulk_cap(IDLE_S + 2.0, live_running=0) == 16


def test_with_no_live_request_the_lane_takes_its_whole_share_and_off_it_always_does():
    lane, _ = governed()
    lane.live_sent(0.0)
    lane.first_token(0.0, 5000.0)
    assert lane.bulk_cap(0.0) == 8
    assert lane.bulk_cap(IDLE_S + 1.0) == 16, "no live stream sent for IDLE_S"
    off = LaneGovernor(0.0, 12)
    off.live_sent(0.0)
    off.first_token(0.0, 10**6)
    assert off.bulk_cap(5.0) == 12


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 5000.0), st.booleans()), max_size=200),
       st.integers(1, 64))
def test_fuzz_the_cap_stays_between_one_stream_and_the_lanes_share(events, most):
    lane, now = LaneGovernor(800.0, most), 0.0
    for gap, ms, live in events:
        now += gap
        if live:
            lane.live_sent(now)
            lane.first_token(now, ms)
        assert 1 <= lane.bulk_cap(now) <= most


def request(i: int, bulk: bool) -> InferenceRequest:
    return InferenceRequest(id=f"{'bulk' if bulk else 'live'}-{i}", prompt="hi", lane=LANE_BULK if bulk else None)


def test_the_engine_starts_no_more_bulk_streams_than_the_cap_and_one_after_starving(monkeypatch):
    monkeypatch.setattr(stream_registry, "BULK_STARVED_S", 0.3)
    registry = StreamRegistry(EngineSettings(server=None, server_url="http://unused", max_in_flight=8,
                                             live_first_token_slo_ms=1000.0), "engine")
    assert registry.settings.bulk_streams == 6
    registry.lane.cap = 2
    registry.lane._adjusted_at = time.monotonic() + 3600  # held where it is: what the engine does with a cap
    keys, _ = registry.submit([request(i, True) for i in range(5)], [1] * 5, "client", time.monotonic())
    assert sum(key is not None for key in keys) == 2, "the cap, not the lane's share"
    for stream in list(registry.streams.values()):
        registry.stop([registry.streams.pop(stream.key)], time.monotonic())
    assert registry.bulk_unfinished == 0
    keys, _ = registry.submit([request(i, False) for i in range(6)], [1] * 6, "client", time.monotonic())
    assert all(keys), "live requests fill the lane's share"
    assert registry.submit([request(9, True)], [1], "client", time.monotonic())[0] == [None], "the live reserve is kept"
    time.sleep(0.35)
    assert registry.submit([request(10, True)], [1], "client", time.monotonic())[0] != [None], \
        "refused for BULK_STARVED_S with none running: one starts in the reserve"
    assert registry.submit([request(11, True)], [1], "client", time.monotonic())[0] == [None], "one, not more"
    assert registry.unfinished == 7 and registry.bulk_unfinished == 1


def test_a_live_streams_first_chunk_is_what_the_lane_follows(monkeypatch):
    registry = StreamRegistry(EngineSettings(server=None, server_url="http://unused", max_in_flight=4), "engine")
    start = time.monotonic()  # the registry asks the lane on the monotonic clock
    (key,), (live,) = registry.submit([request(0, False)], [1], "client", time.monotonic())
    registry.began(live, time.time(), start)
    registry.first_chunk(live, start + 0.25)
    registry.first_chunk(live, start + 1.0)  # a later chunk says nothing more
    (_,), (bulk,) = registry.submit([request(1, True)], [1], "client", time.monotonic())
    registry.began(bulk, time.time(), start)
    registry.first_chunk(bulk, start + 3.0)  # a bulk stream's says nothing
    assert registry.lane.percentile_ms(start + 1.0) == pytest.approx(250.0)
    registry.began(live, time.time(), start + 2.0)  # a retried attempt is measured from its own start
    registry.first_chunk(live, start + 2.5)
    assert registry.lane.percentile_ms(start + 3.0) == pytest.approx(500.0)
    assert lane_governor.WINDOW_S < 20 and registry.lane.percentile_ms(start + 20) is None, "the window forgets"


def test_the_lanes_counts_are_taken_once_for_the_whole_vm_however_many_processes_ask():
    """The runtime is one per VM and each SDK process's steps report its load: a total each process counted as
    it grew was counted once per process (the review's K-fold counters). The runtime hands out what grew since
    anyone took it."""
    engine = vllm_engine(EngineSettings(server=None, server_url="http://127.0.0.1:9", served_model_name="m"))
    try:
        runtime = WorkerRuntime(engine)
        assert set(runtime.load_and_counts()[1]) == {"server_restarts", *COUNTED_TOTALS}
        engine._registry.lane.first_token(time.monotonic(), 50.0)
        engine._registry.lane.first_token(time.monotonic(), 50.0)
        taken = [runtime.load_and_counts()[1] for _ in range(3)]  # three processes' steps, one after another
        assert [counts["live_first_tokens"] for counts in taken] == [2, 0, 0]
    finally:
        engine.close()
