"""The lease rule (pipeline/engines/leases.py): a pause is not a move, a moved key's stream is given up within its
lease."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pipeline.engines.leases import ABANDONED_LEASES, IN_PROCESS, LeaseClocks, finished_kept, overflowing

TICK = 0.5  # the janitor's tick for a lease of 2 s or more: min(max(lease / 4, 0.05), 1)


def clocks(lease_s: float = 10.0, finished_s: float = 600.0) -> LeaseClocks:
    return LeaseClocks(lease_s, finished_s)


def run(leases: LeaseClocks, seconds: float, *, polls: bool, elapsed_per_tick: float = TICK) -> None:
    """Ticks for ``seconds`` of monotonic time, with polls of other streams arriving in every tick or in none."""
    for _ in range(round(seconds / elapsed_per_tick)):
        if polls:
            leases.heard(IN_PROCESS, polled=True)
        leases.tick(elapsed_per_tick, TICK)


def test_a_stream_whose_key_moved_expires_once_the_worker_polled_others_for_a_lease():
    leases = clocks()
    stamp = leases.stamp(IN_PROCESS)
    run(leases, 9.5, polls=True)
    assert not leases.expired(stamp, done=False)
    run(leases, 0.5, polls=True)
    assert leases.expired(stamp, done=False)


def test_a_paused_process_keeps_every_stream_however_long_the_pause():
    for pause_s in (15.0, 60.0, 3600.0):
        leases = clocks()
        stamps = leases.stamp(IN_PROCESS)
        run(leases, 5.0, polls=True)  # some lease already used before the pause
        leases.heard(IN_PROCESS, polled=True)  # a poll raced the pause
        leases.tick(pause_s, TICK)  # the janitor wakes once, having overslept by the whole pause
        assert not leases.expired(stamps, done=False), pause_s
        assert leases.awake_s <= 5.0 + 2 * TICK


def test_late_timers_with_nothing_polled_do_not_expire_a_stream_for_several_leases():
    leases = clocks()
    stamp = leases.stamp(IN_PROCESS)
    run(leases, ABANDONED_LEASES * 10.0 - TICK, polls=False)  # every key's timer late, or every key moved away
    assert not leases.expired(stamp, done=False)
    run(leases, TICK, polls=False)
    assert leases.expired(stamp, done=False)  # no key of this worker polls: they all left


def test_a_finished_streams_outputs_are_kept_for_the_request_timeout_not_the_lease():
    leases = clocks(lease_s=10.0, finished_s=120.0)
    stamp = leases.stamp(IN_PROCESS)
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
    stamp = leases.stamp(IN_PROCESS)
    for n, (elapsed, others_polled) in enumerate(ticks, start=1):
        if n % every == 0:  # its own poll, in this tick's interval: renewed when it happens
            stamp = leases.stamp(IN_PROCESS)
        if others_polled or n % every == 0:
            leases.heard(IN_PROCESS, polled=True)
        leases.tick(elapsed, 1.0)
        assert not leases.expired(stamp, done=False)
        assert leases.clients[IN_PROCESS].alive_s <= leases.awake_s <= 2.0 * n  # a tick counts two at most, whatever it slept


def test_a_drain_holds_running_streams_that_other_keys_poll_around_until_the_hold_lapses():
    """Keys drain one at a time, each polling only its own streams: to the lease that reads as every other key having
    moved away. Held for the drain, no running stream expires; a finished one still goes at its time."""
    leases = clocks()
    running, finished = leases.stamp(IN_PROCESS), leases.stamp(IN_PROCESS)
    leases.hold(30.0)
    run(leases, 29.5, polls=True)
    assert not leases.expired(running, done=False)
    leases.hold(5.0)  # a later key's drain renews the hold from now
    run(leases, 4.5, polls=True)
    assert not leases.expired(running, done=False)
    run(leases, 1.0, polls=True)
    assert leases.expired(running, done=False), "after the hold, the lease reads as before"
    assert not leases.expired(finished, done=True)


def test_finished_streams_are_kept_up_to_a_count_the_longest_kept_forgotten_first():
    assert finished_kept(2) == 64 and finished_kept(64) == 256
    finished = [("c", (3.0, 1.0)), ("a", (1.0, 1.0)), ("b", (2.0, 0.5))]
    assert overflowing(finished, 3) == []
    assert overflowing(finished, 1) == ["a", "b"], "the longest since they were last polled go first"


def beat(leases: LeaseClocks, seconds: float, **calls: str) -> None:
    """Ticks for ``seconds``; each named client (an SDK process) calls every tick: ``"polls"`` (its generate step
    polls other streams) or ``"beats"`` (alive, polling nothing: its heartbeat)."""
    for _ in range(round(seconds / TICK)):
        for client, call in calls.items():
            leases.heard(client, polled=call == "polls")
        leases.tick(TICK, TICK)


def test_one_sdk_process_paused_while_the_others_poll_keeps_its_streams():
    """Several SDK processes share the engine. A paused one is not heard (no poll, no heartbeat), however busily
    the others poll: its streams are kept, for up to finished_s (a process gone for good loses them then)."""
    leases = clocks(lease_s=10.0, finished_s=600.0)
    paused = leases.stamp("a")
    beat(leases, 300.0, b="polls")  # process a paused for five minutes, b serving its own keys
    assert not leases.expired(paused, done=False)
    beat(leases, 299.0, b="polls")
    assert not leases.expired(paused, done=False)
    beat(leases, 1.0, b="polls")
    assert leases.expired(paused, done=False), "not heard for finished_s: the process is gone, not paused"


def test_a_live_sdk_process_that_polls_others_or_nothing_gives_up_a_stream_as_one_process_does():
    leases = clocks(lease_s=10.0, finished_s=600.0)
    moved = leases.stamp("a")
    beat(leases, 9.5, a="polls", b="polls")
    assert not leases.expired(moved, done=False)
    beat(leases, 0.5, a="polls", b="polls")
    assert leases.expired(moved, done=False), "a polled its other keys for a lease and not this one: it moved"

    left = leases.stamp("c")
    beat(leases, ABANDONED_LEASES * 10.0 - TICK, c="beats", b="polls")
    assert not leases.expired(left, done=False)
    beat(leases, TICK, c="beats", b="polls")
    assert leases.expired(left, done=False), "c is alive and polls nothing for several leases: every key left it"
