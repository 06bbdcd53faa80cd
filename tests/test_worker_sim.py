"""The key machine under the worker simulator (tests/worker_sim.py): thousands of drawn schedules of failed
commits, redeliveries, key moves, host deaths, unreachable and failing engines, late timers and drains, and what a
worker VM adds: several SDK processes on one engine, one paused past a stream lease, an update mid-stream,
model-server restarts of drawn length, a dead host's rebuild of drawn length and drains while streams run.

``WORKER_SIM_SCHEDULES`` sets how many (default 10,000; a million for the long run), ``WORKER_SIM_FIRST`` the first
seed (default 0), so that a long run can be made in parts: seeds 0-99,999, then 100,000 on. A failing schedule names
its seed, and ``tests.worker_sim.run(seed)`` replays it exactly. The last tests break, one at a time, the line
that protects each invariant, and show the simulator catches it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import pytest

from pipeline.contract import stream_progress
from pipeline.contract.stream_progress import CHUNK
from pipeline.engines import leases, stream_registry
from pipeline.generation import dedupe, key_driver, key_machine, key_state, step_work
from tests import worker_sim

SCHEDULES = int(os.environ.get("WORKER_SIM_SCHEDULES", "10000"))
FIRST = int(os.environ.get("WORKER_SIM_FIRST", "0"))


def _play(seeds: range) -> list[str]:
    failures = []
    for seed in seeds:
        try:
            worker_sim.check(worker_sim.run(seed))
        except worker_sim.Violation as violation:
            failures.append(str(violation))
    return failures


def test_every_invariant_holds_on_every_drawn_schedule():
    workers = max(os.cpu_count() or 1, 1)
    step = 250
    with ProcessPoolExecutor(workers) as pool:
        failures = [f for found in pool.map(_play, [range(n, min(n + step, FIRST + SCHEDULES))
                                                    for n in range(FIRST, FIRST + SCHEDULES, step)]) for f in found]
    assert not failures, f"{len(failures)} of {SCHEDULES} schedules (seeds from {FIRST}) failed:\n" + \
        "\n".join(failures[:10])


def test_a_step_changes_neither_the_state_nor_the_event_it_is_given(monkeypatch):
    """The key machine's step is a function of (rules, state, event): over drawn schedules, each state and event
    it is given equal, after the step, a deep copy taken before (the id record it changes is its own copy,
    dedupe.IdRecord.opened; what it emits and counts gathers in a StepWork made for that step alone)."""
    real, steps = key_machine.step, [0]  # what the driver calls (pipeline.generation.key_driver)

    def checked(rules, state, event):
        before = copy.deepcopy((state, event))
        result = real(rules, state, event)
        assert (state, event) == before, f"a step changed what it was given: {type(event).__name__}"
        steps[0] += 1
        return result

    monkeypatch.setattr(key_driver, "step", checked)
    for seed in range(60):
        worker_sim.check(worker_sim.run(seed))
    assert steps[0] > 1000, steps


def test_it_bites_when_a_step_changes_the_id_record_it_was_given(monkeypatch):
    """The id record opened without a copy: a step changes the state it was given, and the check above sees it."""
    def shared(self: dedupe.IdRecord) -> tuple[dedupe.Ids, str | None]:
        return (self.ids, None) if isinstance(self.ids, dict) else dedupe.read_ids(self.text)

    monkeypatch.setattr(dedupe.IdRecord, "opened", shared)
    with pytest.raises(AssertionError, match="a step changed what it was given"):
        test_a_step_changes_neither_the_state_nor_the_event_it_is_given(monkeypatch)


def test_leases_cancel_the_streams_keys_moved_away_from_and_every_invariant_still_holds():
    """In the drawn worlds answers end within a second, long before a lease (10 s). Here every stream is 30 times
    slower (answers up to 36 s) on two workers or more, keys moving at 5 % a work item: the old workers' leases
    cancel the streams their keys left, and every request still ends once, whole, nothing wedged."""
    expired = 0
    for seed in range(12):
        drawn = worker_sim.Schedule.draw(seed)
        schedule = dataclasses.replace(drawn, workers=max(drawn.workers, 2), rate_tps=drawn.rate_tps / 30,
                                       faults=dataclasses.replace(drawn.faults, key_moves=0.05))
        report = worker_sim.play(schedule, max_items=200_000)
        worker_sim.check(report)
        expired += report.expired
    assert expired > 0, "no lease ran out: the leases were not exercised"


def _slow_calm(seed: int, bulk_poll_s: float | None = None, *, lanes_by_key: bool = False,
               late_s: float = 0.0) -> worker_sim.Report:
    """Seed's world with no faults but timers up to ``late_s`` late, and every stream 30 times slower (answers up
    to 36 s, past a lease); ``lanes_by_key``: at least two keys in one process, the first holding only bulk
    requests and the others only live ones (the simulator gives request n to key n mod keys), so the bulk key's
    leases hear of its process polling the others."""
    drawn = worker_sim.Schedule.draw(seed)
    rules = drawn.rules if bulk_poll_s is None else dataclasses.replace(drawn.rules, bulk_poll_interval_s=bulk_poll_s)
    world = dataclasses.replace(drawn, rate_tps=drawn.rate_tps / 30, faults=worker_sim.Faults(late_s=late_s),
                                rules=rules)
    if lanes_by_key:
        keys = max(drawn.keys, 2)
        world = dataclasses.replace(world, keys=keys, vm=worker_sim.VmEvents(),
                                    bulk=tuple(n % keys == 0 for n in range(drawn.requests)))
    return worker_sim.play(world, max_items=200_000)


def test_bulk_keys_at_the_bulk_cadence_keep_their_streams_leases_and_it_bites_past_the_lease():
    """Keys holding only bulk requests poll at the bulk cadence (pipeline.generation.key_events): in worlds whose
    answers outlast a lease, with nothing failing, every stream keeps its lease and runs once, beside live keys of
    the same process too, and with timers up to 2 s late. A cadence past the lease lets the process's live polls
    expire the bulk key's streams that were still wanted, which are then generated again."""
    mixed = [_slow_calm(seed, lanes_by_key=True, late_s=late) for seed in range(30) for late in (0.0, 2.0)]
    assert sum(any(r.schedule.bulk) for r in mixed[0::2]) == 30, "every lanes-by-key world has a bulk key"
    assert sum(not all(r.schedule.bulk) for r in mixed[0::2]) > 20, "and most a live key beside it"
    reports = [_slow_calm(seed) for seed in range(30)] + mixed
    for report in reports:
        worker_sim.check(report)
        assert report.expired == 0, report.schedule.seed
    lease_s = worker_sim.Schedule.stream_lease_s
    assert lease_s is not None
    caught = []
    for seed in range(30):
        try:
            worker_sim.check(_slow_calm(seed, bulk_poll_s=1.5 * lease_s, lanes_by_key=True))
        except worker_sim.Violation as violation:
            caught.append(str(violation))
    assert any("ended at attempt 2" in failure for failure in caught), "a cadence past the lease went unseen"


def test_an_idle_key_polls_for_no_id_a_bundle_of_copies_forgot_seed_502502():
    """Found by the million-schedule run at 649fff8: late timers and redelivered copies at an idle key whose timer
    waited for ids that each copy's step had already forgotten; it polled three times in a row for nothing."""
    worker_sim.check(worker_sim.run(502502))


def test_a_schedule_replays_exactly_from_its_seed():
    first, again = worker_sim.run(187, vm=False), worker_sim.run(187, vm=False)
    assert (first.chunks, first.ended, first.generated, first.work_items) == \
           (again.chunks, again.ended, again.generated, again.work_items)
    assert first.work_items > 20 and first.schedule.faults.commit_fails, "a schedule with faults in it"


def test_without_faults_every_request_is_answered_and_nothing_is_generated_twice():
    for seed in range(300):
        report = worker_sim.run(seed, faults=False)
        worker_sim.check(report)
        reasons = {letters[0]["reason"] for letters in report.letters.values()}
        assert all("queue for its key is full" in r for r in reasons), (seed, reasons)  # the drawn waiting cap
        assert report.generated == report.delivered, seed


def test_a_request_waiting_for_room_to_be_resent_is_not_lost_again_at_each_poll():
    """Seed 325: engine failures only, max_in_flight 1; a request was dead-lettered as moved eight times."""
    report = worker_sim.run(325, spells=False, vm=False)
    assert report.ended_before_drain == {f"r{i}" for i in range(report.schedule.requests)}
    assert not report.letters, {i: letters[0]["reason"] for i, letters in report.letters.items()}


def test_a_failed_poll_regenerates_nothing():
    """Seeds 34 and 187: a poll that raised lost every stream, so each was generated again (and the old one ran on);
    twice the tokens delivered with no key moved."""
    for seed in (34, 187):
        report = worker_sim.run(seed, spells=False, vm=False)
        worker_sim.check(report)
        assert report.schedule.faults.engine_fails and not report.schedule.faults.loses_streams


def test_a_key_whose_engine_fails_every_poll_goes_quiet_once_its_requests_end():
    """Seed 4: every poll fails for 10 s. What a failed poll was to release was kept for the next one, so a key
    with nothing left polled every 50 ms for as long as the engine failed (225 times in a row); with the real vLLM,
    test_runner_semantics' poll that always raises never let the key go idle."""
    report = worker_sim.run(4, vm=False)
    assert report.schedule.faults.broken == "poll" and report.schedule.faults.broken_s == 10.0
    worker_sim.check(report)  # which counts the polls in a row that hold nothing and change nothing


def test_it_bites_when_a_shed_request_keeps_its_id(monkeypatch):
    """A shed request's id held for dedupe_window_s as an ended one's is: its republish is dropped as a copy."""
    monkeypatch.setattr(step_work.StepWork, "forget", step_work.StepWork.end)
    assert any("ended 0 times" in f for f in _caught(range(200))), "a dropped republish went unseen"


def _caught(seeds: range = range(400)) -> list[str]:
    return _play(seeds)


def test_it_bites_when_the_progress_commit_is_skipped(monkeypatch):
    """Positions not committed with the outputs: a retried or later poll hands chunks over again."""
    real = key_state.changes

    def without_progress(before, after):
        changed = real(before, after)
        changed.values.pop("progress", None)
        return changed

    monkeypatch.setattr(key_state, "changes", without_progress)
    assert any("delivered" in f or "ended" in f for f in _caught()), "a skipped progress commit went unseen"


def test_it_bites_when_the_dedupe_check_is_dropped(monkeypatch):
    """Every redelivered copy taken as a new request: a request ends twice."""
    monkeypatch.setattr(dedupe, "holder", lambda ids, request_id, now: None)
    assert any("ended twice" in f for f in _caught()), "a dropped dedupe check went unseen"


def test_it_bites_when_a_drain_keeps_state(monkeypatch):
    """A drain that forgets to clear its key leaves state behind."""
    real = key_machine._drain_end

    def keeping(work, pending, **kwargs):
        state, effects_out = real(work, pending, **kwargs)
        return dataclasses.replace(state, wait_ms=7), effects_out

    monkeypatch.setattr(key_machine, "_drain_end", keeping)
    assert any("after its drain" in f for f in _caught(range(50))), "state left after a drain went unseen"


def test_it_bites_when_a_finished_stream_is_never_released(monkeypatch):
    """A poll that keeps asking for ended streams: the key never goes idle, and the simulator says so."""
    real = key_machine._resent

    def never_idle(work, state, pending, results, **kwargs):
        out_state, effects = real(work, state, pending, results, **kwargs)
        if not out_state.inflight and not out_state.waiting:
            effects = dataclasses.replace(effects, arm_at=work.now + 0.05)
            out_state = dataclasses.replace(out_state, poll_at_ms=int((work.now + 0.05) * 1000))
        return out_state, effects

    monkeypatch.setattr(key_machine, "_resent", never_idle)
    with pytest.raises(worker_sim.Violation, match="polls without end|polled .* times in a row"):
        worker_sim.run(1, faults=False, max_items=3000)


def test_the_drawn_worlds_cover_a_worker_vm():
    """Of the drawn worlds, some run several SDK processes on one engine, pause one past a stream lease, update
    the job mid-stream, restart the model server, or kill a host under running streams and take seconds to
    rebuild it: the events the VM adds are exercised, not only declared."""
    reports = [worker_sim.run(seed) for seed in range(300)]
    for report in reports:
        worker_sim.check(report)
    vm = [r.schedule.vm for r in reports]
    assert sum(v.processes > 1 for v in vm) > 100
    lease_s = worker_sim.Schedule.stream_lease_s
    assert lease_s is not None
    assert sum(v.pause is not None and v.pause[2] > lease_s for v in vm) > 30
    assert sum(r.updates for r in reports) > 10 and sum(bool(r.restarted) for r in reports) > 10
    assert sum(bool(r.hits) for r in reports) > 10, "host deaths and updates under running streams"
    assert sum(r.host_deaths > 0 and r.schedule.vm.rebuild_s >= 5.0 for r in reports) > 10, \
        "host deaths whose runtime takes seconds to rebuild"


def _any_caught(seeds: range, pattern: str) -> bool:
    return any(pattern in failure for failure in _caught(seeds))


def test_it_bites_when_a_drain_forgets_to_cancel(monkeypatch):
    """A drain that stops waiting and cancels nothing leaves its streams running at the engine, KV cache held for
    answers nobody will collect."""
    real = key_machine._drain_end

    def no_cancel(work, pending, **kwargs):
        state, effects = real(work, pending, **kwargs)
        return state, dataclasses.replace(effects, cancel=())

    monkeypatch.setattr(key_machine, "_drain_end", no_cancel)
    assert _any_caught(range(300), "still run"), "a lost cancel went unseen"


def test_it_bites_when_a_poll_forgets_to_cancel(monkeypatch):
    """A poll that gives streams up (the engine failed them past the bound), or could not release finished ones,
    and cancels nothing: the request ends while the engine still generates for it, seen at that commit."""
    real = key_machine._polled

    def no_cancel(work, state, pending, event):
        state, effects = real(work, state, pending, event)
        return state, dataclasses.replace(effects, cancel=())

    monkeypatch.setattr(key_machine, "_polled", no_cancel)
    assert _any_caught(range(400), "still running"), "a lost cancel went unseen"


def test_it_bites_when_a_poll_skips_a_chunk(monkeypatch):
    """A poll that hands over a stream's outputs less one chunk: the stream has a gap, seen at the work item that
    commits it."""
    real = stream_progress.advance

    def skipping(progress, answer, asked_from, **kwargs):
        after, moved = real(progress, answer, asked_from, **kwargs)
        chunks = [n for n, (kind, _) in enumerate(moved.emit) if kind == CHUNK]
        if len(chunks) >= 2:
            moved = dataclasses.replace(moved, emit=moved.emit[:chunks[0]] + moved.emit[chunks[0] + 1:])
        return after, moved

    monkeypatch.setattr(key_machine, "advance", skipping)
    assert _any_caught(range(100), "was next"), "a gap in a chunk stream went unseen"


def _retried_submissions_start_second_streams(monkeypatch) -> None:
    """Breaks the registry: a retried work item's submission no longer joins the stream its failed try started, and
    the engine generates that answer twice though no stream was lost."""
    real = stream_registry.StreamRegistry.submit
    calls = itertools.count()

    def never_joins(self, requests, attempts, client, now_mono):
        before = dict(self.streams)
        keys, started = real(self, requests, attempts, client, now_mono)
        joined = [key for key in keys if key is not None and key in before]
        for key in joined:  # the try's stream runs on under another name; the retry starts one of its own
            self.streams[f"{key}~{next(calls)}"] = self.streams.pop(key)
        if not joined:
            return keys, started
        again = [(r, a) for r, a, key in zip(requests, attempts, keys, strict=True) if key in joined]
        _, fresh = real(self, [r for r, _ in again], [a for _, a in again], client, now_mono)
        return keys, started + fresh

    monkeypatch.setattr(stream_registry.StreamRegistry, "submit", never_joins)


def test_it_bites_when_a_retried_submission_starts_a_second_stream(monkeypatch):
    """The second stream generates past 1.05 tokens per token delivered. Where both apply, the per-request cost
    (each answer generated once per host death under it) is the stricter and names it first; the 1.05 bound over
    all requests also counts what was generated for requests that ended as dead letters."""
    _retried_submissions_start_second_streams(monkeypatch)
    assert _any_caught(range(300), "tokens generated for"), "a second stream for a retried submission went unseen"


class _TenHostDeathsUnderEach(Counter):
    def __missing__(self, request_id: str) -> int:
        return 10


def test_it_bites_past_1_05_tokens_per_token_delivered_with_the_per_request_cost_loosened(monkeypatch):
    """The same second streams with the per-request bounds loosened (every request counted as if ten host deaths
    ran under it): the 1.05 bound over the run, which counts no host deaths, still catches them on its own."""
    _retried_submissions_start_second_streams(monkeypatch)
    real = worker_sim.Report.__init__

    def loosened(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.hits = _TenHostDeathsUnderEach()

    monkeypatch.setattr(worker_sim.Report, "__init__", loosened)
    failures = _caught(range(300))
    assert not any("host deaths or updates under it" in f for f in failures), failures[:3]  # loosened indeed
    assert any("past 1.05 per token delivered" in f for f in failures), \
        "tokens generated twice went unseen by the 1.05 bound"


def test_it_bites_when_the_engine_takes_past_max_in_flight(monkeypatch):
    """The registry's room ignoring max_in_flight: the engine's bound, checked after every work item."""
    monkeypatch.setattr(stream_registry.StreamRegistry, "room", lambda self, new, now, bulk=False, prompts=None: new)
    assert _any_caught(range(100), "past max_in_flight"), "an engine past its bound went unseen"


def _paused_worlds(seeds: range, leases_paused: float = 1.5) -> list[worker_sim.Schedule]:
    """Worlds without faults whose answers take up to 36 s, on two SDK processes of one worker, the first paused
    for ``leases_paused`` stream leases half a second in: its streams run through the pause unpolled."""
    worlds = []
    for seed in seeds:
        drawn = worker_sim.Schedule.draw(seed, faults=False)
        assert drawn.stream_lease_s is not None
        pause = (0, 0.5, leases_paused * drawn.stream_lease_s)
        worlds.append(dataclasses.replace(drawn, workers=1, keys=max(drawn.keys, 2), rate_tps=drawn.rate_tps / 30,
                                          vm=worker_sim.VmEvents(processes=2, pause=pause)))
    return worlds


def _failures(schedules: list[worker_sim.Schedule]) -> list[str]:
    """What the simulator catches in these changed worlds, each played whole."""
    failures = []
    for schedule in schedules:
        try:
            worker_sim.check(worker_sim.play(schedule, max_items=200_000))
        except worker_sim.Violation as violation:
            failures.append(str(violation))
    return failures


def _paused_failures(leases_paused: float) -> list[str]:
    """What the simulator catches in twenty of those worlds."""
    return _failures(_paused_worlds(range(20), leases_paused))


def test_a_process_paused_past_a_lease_while_another_polls_keeps_its_streams():
    """The pause is not a move: the paused process's streams are kept by their leases (its clocks stop while it
    is not heard), so every request ends once and nothing is generated twice."""
    for leases_paused in (1.5, 3.5):  # past one lease; past the three after which a client heard but silent lapses
        for schedule in _paused_worlds(range(12), leases_paused):
            report = worker_sim.play(schedule, max_items=200_000)
            worker_sim.check(report)
            assert report.expired == 0 and report.generated <= 1.05 * report.delivered + 1, schedule.seed


def test_it_bites_when_a_paused_process_is_still_heard(monkeypatch):
    """A heartbeat that went on through the pause (the engine hears a process that polls nothing): three leases of
    its awake time pass without a poll, and its streams are taken for abandoned, cancelled and generated again."""
    real = worker_sim.SimEngine.advance

    def always_heard(self, now):
        self.awake = {f"p{n}" for n in range(self.schedule.vm.processes)}
        real(self, now)

    monkeypatch.setattr(worker_sim.SimEngine, "advance", always_heard)
    failures = _paused_failures(3.5)
    assert any("ended at attempt" in f or "tokens generated for" in f for f in failures), \
        "streams lost to a heartbeat heard through a pause went unseen"


def test_it_bites_when_a_lease_runs_on_the_wall_clock(monkeypatch):
    """A lease read on the host's clock alone cannot tell a paused SDK process from a key that moved away: the
    paused process's streams are cancelled and generated again."""

    def wall_clock(self, stamp, done):
        host_awake_at = stamp[0]
        return self.awake_s - host_awake_at >= (max(self.lease_s, self.finished_s) if done else self.lease_s)

    monkeypatch.setattr(leases.LeaseClocks, "expired", wall_clock)
    failures = _paused_failures(1.5)
    # Seen as a stream sent again with no host death under it, or as tokens generated twice.
    assert any("ended at attempt" in f or "tokens generated for" in f for f in failures), \
        "streams lost to a pause went unseen"


def test_it_bites_when_the_machine_counts_what_the_generate_step_has_no_counter_for(monkeypatch):
    """A count the generate step has no counter for raises there (a KeyError), and Dataflow retries that work item
    for ever: the simulator refuses the count as the DoFn would."""
    real = step_work.StepWork.__init__

    def counting(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.counts["a_count_of_its_own"] += 1

    monkeypatch.setattr(step_work.StepWork, "__init__", counting)
    assert _any_caught(range(5), "have no counter in the generate step")


def _slow_drains(seeds: range) -> list[str]:
    """Worlds 30 times slower than drawn that drain 3 s in, streams running, each key's drain waiting up to 30 s:
    keys drain one at a time, so the last waits past a lease (10 s) for its turn."""
    drawn = [worker_sim.Schedule.draw(seed) for seed in seeds]
    return _failures([dataclasses.replace(d, rate_tps=d.rate_tps / 30,
                                          rules=dataclasses.replace(d.rules, drain_timeout_s=30.0),
                                          vm=dataclasses.replace(d.vm, drain_at=3.0)) for d in drawn])


def test_a_slow_drain_holds_every_streams_lease_until_its_key_drains():
    assert not _slow_drains(range(40))


def test_it_bites_when_a_drain_holds_no_lease(monkeypatch):
    """Without the drain's hold, a key drained late finds its streams cut by their lease while the keys before it
    drained (the contract: "a key drained late finds its stream, finished or running")."""
    monkeypatch.setattr(key_machine, "_hold", lambda work: None)
    assert any("should have held were cut by their lease" in failure for failure in _slow_drains(range(40)))


def test_it_bites_when_only_the_drains_first_pass_holds_the_leases(monkeypatch):
    """Seed 187 drains while a 40 s server restart holds its first key's streams: that key waits its whole
    drain_timeout_s (30 s), and a hold asked only at the drain's start ends as it does, so the next key's stream
    is cut by its lease before its turn. Each pass asks for the hold again (key_machine._hold)."""
    real, calls = key_machine._hold, itertools.count()
    monkeypatch.setattr(key_machine, "_hold", lambda work: real(work) if next(calls) == 0 else None)
    with pytest.raises(worker_sim.Violation, match="should have held were cut by their lease"):
        worker_sim.check(worker_sim.run(187))
