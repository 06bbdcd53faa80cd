"""The lease rule (pipeline/engines/leases.py): a pause is not a move, a moved key's stream is given up within its
lease."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pipeline.engines.leases import ABANDONED_LEASES, LeaseClocks

TICK = 0.5  # the janitor's tick for a lease of 2 s or more: min(max(lease / 4, 0.05), 1)


def clocks(lease_s: float = 10.0, finished_s: float = 600.0) -> LeaseClocks:
    return LeaseClocks(lease_s, finished_s)


def run(leases: LeaseClocks, seconds: float, *, polls: bool, elapsed_per_tick: float = TICK) -> None:
    """Ticks for ``seconds`` of monotonic time, with polls of other streams arriving in every tick or in none."""
    for _ in range(round(seconds / elapsed_per_tick)):
        leases.polled = polls
        leases.tick(elapsed_per_tick, TICK)


def test_a_stream_whose_key_moved_expires_once_the_worker_polled_others_for_a_lease():
    leases = clocks()
    stamp = leases.stamp()
    run(leases, 9.5, polls=True)
    assert not leases.expired(stamp, done=False)
    run(leases, 0.5, polls=True)
    assert leases.expired(stamp, done=False)


def test_a_paused_process_keeps_every_stream_however_long_the_pause():
    for pause_s in (15.0, 60.0, 3600.0):
        leases = clocks()
        stamps = leases.stamp()
        run(leases, 5.0, polls=True)  # some lease already used before the pause
        leases.polled = True  # a poll raced the pause
        leases.tick(pause_s, TICK)  # the janitor wakes once, having overslept by the whole pause
        assert not leases.expired(stamps, done=False), pause_s
        assert leases.awake_s <= 5.0 + 2 * TICK


def test_late_timers_with_nothing_polled_do_not_expire_a_stream_for_several_leases():
    leases = clocks()
    stamp = leases.stamp()
    run(leases, ABANDONED_LEASES * 10.0 - TICK, polls=False)  # every key's timer late, or every key moved away
    assert not leases.expired(stamp, done=False)
    run(leases, TICK, polls=False)
    assert leases.expired(stamp, done=False)  # no key of this worker polls: they all left


def test_a_finished_streams_outputs_are_kept_for_the_request_timeout_not_the_lease():
    leases = clocks(lease_s=10.0, finished_s=120.0)
    stamp = leases.stamp()
    run(leases, 119.5, polls=True)
    assert not leases.expired(stamp, done=True) and leases.expired(stamp, done=False)
    run(leases, 0.5, polls=True)
    assert leases.expired(stamp, done=True)


@settings(max_examples=300, deadline=None)
@given(ticks=st.lists(st.tuples(st.floats(0.0, 600.0), st.booleans()), min_size=1, max_size=80),
       every=st.integers(1, 4))
def test_fuzz_a_stream_polled_every_few_ticks_never_expires_whatever_the_pauses(ticks, every):
    """Ticks of any lateness (a paused process), other keys polling or not: a stream whose own poll comes within
    every ``every`` ticks is never given up, since a tick counts 2 s at most and 4 x 2 s < the 10 s lease."""
    leases = clocks(lease_s=10.0, finished_s=600.0)
    stamp = leases.stamp()
    for n, (elapsed, others_polled) in enumerate(ticks, start=1):
        if n % every == 0:  # its own poll, in this tick's interval: renewed when it happens
            stamp = leases.stamp()
        leases.polled = others_polled or n % every == 0
        leases.tick(elapsed, 1.0)
        assert not leases.expired(stamp, done=False)
        assert leases.alive_s <= leases.awake_s <= 2.0 * n  # a tick counts two at most, whatever it slept
