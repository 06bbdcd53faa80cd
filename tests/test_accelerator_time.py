"""The apportioning of the model's busy time (pipeline/engines/accelerator_time.py), on generated schedules."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pipeline.engines.accelerator_time import BusyShares

# A schedule: requests, each running over [start, start + length) on a clock of whole milliseconds.
schedules = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 5_000)), min_size=1, max_size=40)


def run(schedule: list[tuple[int, int]]) -> tuple[list[float], BusyShares]:
    # At a tie, ends go before begins (a request's own end after its begin when it lasts no time at all).
    events = sorted([(start, 1, i) for i, (start, _) in enumerate(schedule)]
                    + [(start + length, 0 if length else 2, i) for i, (start, length) in enumerate(schedule)])
    shares, charged = BusyShares(), [0.0] * len(schedule)
    for at, kind, i in events:
        if kind == 1:
            shares.begin(f"r{i}", at / 1000)
        else:
            charged[i] = shares.end(f"r{i}", at / 1000)
    return charged, shares


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The time covered by at least one (start, end) interval, measured apart from the ledger: a sweep over the
    merged intervals (the real-server test in test_engine measures with it too)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach[1]:
            total += 0.0 if reach is None else reach[1] - reach[0]
            reach = [start, end]
        else:
            reach[1] = max(reach[1], end)
    return total + (reach[1] - reach[0] if reach else 0.0)


def spans(schedule: list[tuple[int, int]]) -> list[tuple[float, float]]:
    return [(start / 1000, (start + length) / 1000) for start, length in schedule]


@settings(max_examples=300, deadline=None)
@given(schedules)
def test_the_shares_add_up_to_the_time_the_model_was_busy(schedule):
    charged, shares = run(schedule)
    assert abs(sum(charged) - union_seconds(spans(schedule))) < 1e-6
    assert abs(shares.busy_s - union_seconds(spans(schedule))) < 1e-6
    assert shares.running() == 0


@settings(max_examples=300, deadline=None)
@given(schedules)
def test_no_request_pays_more_than_its_own_time_and_a_lone_one_pays_exactly_that(schedule):
    charged, _ = run(schedule)
    for i, (start, length) in enumerate(schedule):
        assert -1e-9 <= charged[i] <= length / 1000 + 1e-9
        alone = all(s + n <= start or s >= start + length for j, (s, n) in enumerate(schedule) if j != i)
        if alone:
            assert abs(charged[i] - length / 1000) < 1e-9


def test_requests_that_run_together_share_equally():
    charged, _ = run([(0, 2000)] * 4)
    assert charged == [0.5] * 4
    charged, _ = run([(0, 2000), (1000, 2000)])  # 1 s alone, 1 s together, 1 s alone
    assert charged == [1.5, 1.5]


def test_an_end_without_a_begin_charges_nothing_and_a_second_end_nothing_more():
    shares = BusyShares()
    assert shares.end("ghost", 5.0) == 0.0
    shares.begin("a", 5.0)
    assert shares.end("a", 6.0) == 1.0 and shares.end("a", 9.0) == 0.0
    shares.begin("b", 4.0)  # a clock reading from before the last: nothing is charged backwards
    assert shares.end("b", 4.5) == 0.0
