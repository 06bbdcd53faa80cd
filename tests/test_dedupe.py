"""The generate step's record of request ids (pipeline/generation/dedupe.py): bounded, never holding an id open
that no entry will end, and forgotten by the key's timer."""

from __future__ import annotations

import dataclasses
import json
import time

from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import KeyProgress
from pipeline.generation.dedupe import MAX_ENDED_IDS, IdEntry, IdRecord, encode_ids, holder, prune, release_orphans
from pipeline.generation.key_events import Arrived, Rules
from pipeline.generation.key_machine import step
from pipeline.generation.key_state import KeyState


def test_ended_ids_are_bounded_by_count_the_soonest_to_expire_forgotten_first_and_open_ids_never():
    ids = {"open": IdEntry("fp-open", None)}
    for n in range(MAX_ENDED_IDS + 5):
        ids[f"ended-{n}"] = IdEntry(f"fp-{n}", 1000.0 + n)
    assert prune(ids, 0.0)
    ids = json.loads(encode_ids(ids))["ids"]
    assert len(ids) == MAX_ENDED_IDS + 1 and "open" in ids
    assert [f"ended-{n}" in ids for n in range(6)] == [False] * 5 + [True]


def test_an_id_held_open_with_no_entry_left_ends_like_any_request():
    ids = {"kept": IdEntry("fp-kept", None), "orphan": IdEntry("fp-orphan", None),  # its entry went to the dead letters
           "ended": IdEntry("fp-ended", 50.0)}
    now = time.time()
    until = now + 60
    release_orphans(ids, {"fp-kept"}, until=until, now=now)
    assert holder(ids, "kept", until) == "fp-kept" and ids["kept"].until is None
    assert holder(ids, "orphan", until - 1) == "fp-orphan", "a copy within the window is still a duplicate"
    assert holder(ids, "orphan", until) is None, "and after it, the id is free again"
    assert ids["ended"].until == 50.0


def test_a_bundle_of_copies_at_an_idle_key_moves_its_timer_to_the_next_id_to_forget():
    """An idle key's timer waits only to forget ids. A bundle that came after the first of them expired forgot it
    (each step prunes the ids it reads), so the timer moves to the next, rather than fire to find nothing to do: the
    worker simulator's seed 502502 saw three such polls in a row, late timers and redelivered copies between."""
    rules = Rules(poll_interval_s=0.05, dedupe_window_s=10.0, drain_timeout_s=30.0, waiting_cap=10)
    first, second = (InferenceRequest(id=name, prompt="hi", max_tokens=4, received_at=90.0) for name in "ab")
    ids = {"a": IdEntry(first.fingerprint(), 100.0), "b": IdEntry(second.fingerprint(), 105.0)}
    idle = KeyState(seen=IdRecord(encode_ids(ids)), poll_at_ms=101_000)  # for a's expiry, as a poll sets it
    state, effects = step(rules, idle, Arrived(102.0, (second,), "redelivered"))
    assert effects.counts.get("duplicates_dropped") == 1 and not state.holds_work
    assert (effects.arm_at, state.poll_at_ms) == (106.0, 106_000), "at b's expiry, a's went with this bundle"
    assert set(state.seen.ids or {}) == {"b"} and state.seen.changed, "a forgotten, to be committed"
    _, again = step(rules, state, Arrived(103.0, (second,), "again"))
    assert again.arm_at is None, "nothing forgotten: the timer stays"
    releasing = dataclasses.replace(idle, progress=KeyProgress({}, {"done-stream": 3}))
    state, effects = step(rules, releasing, Arrived(102.0, (second,), "redelivered"))
    assert (effects.arm_at, state.poll_at_ms) == (None, 101_000), "a stream to release: the poll is due anyway"


def test_an_idle_key_past_the_count_bound_moves_its_timer_past_the_id_the_bound_forgot():
    """Past MAX_ENDED_IDS a step forgets the soonest-ending ids before their window ends. The timer waiting for the
    soonest then moves to the next left: read before the count bound pruned, it fired once to forget nothing."""
    rules = Rules(poll_interval_s=0.05, dedupe_window_s=10.0, drain_timeout_s=30.0, waiting_cap=10)
    requests = [InferenceRequest(id=f"r{n}", prompt="hi", max_tokens=4, received_at=90.0)
                for n in range(MAX_ENDED_IDS + 1)]
    ids = {r.id: IdEntry(r.fingerprint(), 1000.0 + n) for n, r in enumerate(requests)}
    idle = KeyState(seen=IdRecord(encode_ids(ids)), poll_at_ms=1_001_000)  # for r0's expiry, as a poll sets it
    state, effects = step(rules, idle, Arrived(500.0, (requests[7],), "redelivered"))
    assert effects.counts.get("duplicates_dropped") == 1 and not state.holds_work
    assert "r0" not in (state.seen.ids or {}) and len(state.seen.ids or {}) == MAX_ENDED_IDS
    assert (effects.arm_at, state.poll_at_ms) == (1002.0, 1_002_000), "at r1's expiry: r0 went by count"
