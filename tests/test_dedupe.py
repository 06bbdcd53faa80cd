"""The generate step's record of request ids (pipeline/generation/dedupe.py): bounded, and never holding an id open
that no entry will end."""

from __future__ import annotations

import json
import time

from pipeline.generation.dedupe import MAX_ENDED_IDS, SeenIds


class Cell:
    def __init__(self, value: str | None = None) -> None:
        self.value = value

    def read(self) -> str | None:
        return self.value

    def write(self, value: str) -> None:
        self.value = value

    def clear(self) -> None:
        self.value = None


def test_ended_ids_are_bounded_by_count_the_soonest_to_expire_forgotten_first_and_open_ids_never():
    cell = Cell()
    seen = SeenIds(cell)
    seen.hold("open", "fp-open")
    for n in range(MAX_ENDED_IDS + 5):
        seen.hold(f"ended-{n}", f"fp-{n}", until=1000.0 + n)
    seen.save(0.0)
    ids = json.loads(cell.value)["ids"]
    assert len(ids) == MAX_ENDED_IDS + 1 and "open" in ids
    assert [f"ended-{n}" in ids for n in range(6)] == [False] * 5 + [True]


def test_an_id_held_open_with_no_entry_left_ends_like_any_request():
    seen = SeenIds(Cell())
    seen.hold("kept", "fp-kept")
    seen.hold("orphan", "fp-orphan")  # its entry could not be decoded and went to the dead letters
    seen.hold("ended", "fp-ended", until=50.0)
    until = time.time() + 60
    seen.release_orphans({"fp-kept"}, until=until)
    assert seen.holder("kept", until) == "fp-kept" and seen.ids["kept"][1] is None
    assert seen.holder("orphan", until - 1) == "fp-orphan", "a copy within the window is still a duplicate"
    assert seen.holder("orphan", until) is None, "and after it, the id is free again"
    assert seen.ids["ended"][1] == 50.0
