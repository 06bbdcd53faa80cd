"""The generate step's record of request ids (pipeline/generation/dedupe.py): bounded, and never holding an id open
that no entry will end."""

from __future__ import annotations

import json
import time

from pipeline.generation.dedupe import MAX_ENDED_IDS, IdEntry, encode_ids, holder, prune, release_orphans


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
