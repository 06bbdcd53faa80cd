"""The worker VM's reads under each way the runner may hand out work items (tests/vm_sim.py): the real admission
ledger, read places and key machine on simulated threads and time. ``VM_SIM_SEEDS`` sets how many drawn workers
each policy plays (default 6); ``python -m tests.vm_sim N`` prints the reads and policies side by side."""

from __future__ import annotations

import os

import pytest

from tests.vm_sim import POLICIES, STEP_S, Violation, check, run

SEEDS = range(int(os.environ.get("VM_SIM_SEEDS", "6")))
# The most a due poll timer may wait for a thread (docs/contract.md): a read's round holds one for one work item's
# time, never for as long as the worker is full.
TIMER_LATE_BOUND_S = 10 * STEP_S


@pytest.mark.parametrize("policy", POLICIES)
def test_under_every_policy_every_request_ends_once_within_the_bound_and_timers_run_on_time(policy: str) -> None:
    """A backlog many times the bound at an empty worker, its readers' rounds and its keys' work items handed out
    as the policy says (a key's due work first, a coin, or a read whenever one is due): every request ends
    exactly once, the worker never holds more than its bound plus the finished streams not yet collected, no
    due timer waits long for a thread, and a full worker's rounds defer rather than wait or fail."""
    for seed in SEEDS:
        outcome = run(seed, policy)
        check(outcome)
        assert outcome.peak_hold >= outcome.bound, "the backlog filled the worker: the bound was tested"
        assert outcome.deferred > 0, "a full worker's readers deferred"
        assert max(outcome.timer_late_s) <= TIMER_LATE_BOUND_S, (seed, max(outcome.timer_late_s))


def test_it_bites_when_a_read_takes_whatever_the_subscription_gives() -> None:
    """A read that pulls without taking places first (Dataflow's own source) moves the backlog into the worker
    at read speed: the check catches it."""
    with pytest.raises(Violation, match="against a bound"):
        check(run(0, "timers", "native"))


@pytest.mark.parametrize("policy", ["timers", "reads"])
def test_a_runtime_host_death_mid_backlog_still_ends_every_request_once(policy: str) -> None:
    """The runtime's host dies 1 s into the backlog and is rebuilt 30 s later (a model server's start): readers
    take no places meanwhile, so they pull nothing and defer, and the keys find their streams gone and send them
    again. Every request ends exactly once. The bound is not asserted across the death: the new ledger starts
    empty and counts what the keys hold only as they report it."""
    for seed in SEEDS:
        outcome = run(seed, policy, host_dies_at=1.0, rebuild_s=30.0)
        assert outcome.host_deaths == 1
        check(outcome, bound=False)
