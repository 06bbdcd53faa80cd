"""What one step of a key machine gathers: what it emits, counts and logs, and the key's ids while it changes them.

Every transition of :mod:`pipeline.generation.key_machine` writes through one :class:`StepWork`, made for that
step alone and dropped at its end: an accumulator, as a logger is. Of the key's state it holds one part, the
record of ids (:mod:`pipeline.generation.dedupe`), and that as a copy of its own, opened on the first read (most
polls never read it, and decoding it costs; a record that cannot be decoded is counted and logged then, as any
step's outcome is). Each transition takes a :class:`~pipeline.generation.key_state.KeyState` and returns the next,
so the step is a function of (rules, state, event) alone, time coming in with the event: what it is given is
never changed (``tests/test_worker_sim.py`` checks it over drawn schedules). At the end the transition asks it for
the step's :class:`~pipeline.generation.key_events.Effects` (:meth:`StepWork.done`) and for the record of ids as
the step leaves it (:meth:`StepWork.ids_after`), the record given back unchanged where no transition read it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from pipeline.contract.messages import PREPARED_ATTRIBUTE, STAGE_DRAIN, STAGE_INFERENCE, DeadLetter, InferenceRequest
from pipeline.contract.stream_progress import DEAD_LETTER, Output
from pipeline.generation import dedupe
from pipeline.generation.dedupe import IdRecord
from pipeline.generation.key_events import Effects, Report, Rules, Submission
from pipeline.generation.key_state import Damaged, RequestEntry

# Every count a step may make, by the name the generate step's counter has (pipeline.generation.step_outputs).
MACHINE_COUNTS = ("requests_sent", "requests_queued", "requests_admitted_from_queue", "duplicates_dropped",
                  "lost_streams_resubmitted", "undecodable_state_entries", "drain_dead_letters")


class StepWork:
    """One step's scratch: what it emits and counts, and the key's ids while it changes them."""

    def __init__(self, rules: Rules, seen: IdRecord, now: float) -> None:
        self.rules, self.now = rules, now
        self.outputs: list[Output] = []
        self.counts: Counter[str] = Counter()
        self.logs: list[tuple[int, str]] = []
        self._seen = seen
        self._ids: dedupe.Ids | None = None
        self._ids_changed = seen.changed

    @property
    def ids(self) -> dedupe.Ids:
        if self._ids is None:
            self._ids, problem = self._seen.opened()
            if problem is not None:
                self.counts["undecodable_state_entries"] += 1
                self.logs.append((logging.ERROR, problem))
                self._ids_changed = True
        return self._ids

    def hold(self, request: InferenceRequest, fingerprint: str) -> None:
        self.ids[request.id] = dedupe.IdEntry(fingerprint, None)
        self._ids_changed = True

    def end(self, entry: RequestEntry) -> None:
        """The request ended (its completion or dead letter is emitted in this step): its id is held a while."""
        dedupe.release(self.ids, entry.request_id, entry.fp, self.now + self.rules.dedupe_window_s, self.now)
        self._ids_changed = True

    def forget(self, entry: RequestEntry) -> None:
        """The request was shed (its dead letter says to republish it): its id is released at once, so that its
        republish, or a redelivered copy, is served rather than dropped as a duplicate."""
        dedupe.release(self.ids, entry.request_id, entry.fp, self.now, self.now)
        self._ids_changed = True

    def letter(self, entry: RequestEntry | InferenceRequest, reason: str, *, drain: bool = False) -> None:
        request = InferenceRequest.from_json(entry.request) if isinstance(entry, RequestEntry) else entry
        request_json = entry.request if isinstance(entry, RequestEntry) else request.to_json()
        if drain:  # republishable as it is: already prepared, so parsing applies no defaults again
            self.counts["drain_dead_letters"] += 1
            letter = DeadLetter.of_request(STAGE_DRAIN, reason + "; republish it with the redrive command", request,
                                           payload=request.to_payload(), attributes={PREPARED_ATTRIBUTE: "1"},
                                           at=self.now)
        else:
            letter = DeadLetter.of_request(STAGE_INFERENCE, reason, request, payload=request_json, at=self.now)
        self.outputs.append((DEAD_LETTER, letter.to_json()))

    def unique(self, entries: tuple[RequestEntry, ...],
               besides: tuple[RequestEntry, ...] = ()) -> tuple[RequestEntry, ...]:
        """The entries less copies of a request held already: a copy gets in only when the record of ids was lost
        (an unreadable cell), and two entries of one request would share its stream and emit its end twice."""
        held, unique = {e.fp for e in besides}, []
        for entry in entries:
            if entry.fp in held:
                self.counts["duplicates_dropped"] += 1
                self.logs.append((logging.WARNING, "A second entry of one request in this key's state (its record "
                                                   "of ids was lost); dropped"))
                continue
            held.add(entry.fp)
            unique.append(entry)
        return tuple(unique)

    def forget_ids(self) -> None:
        self.ids.clear()
        self._ids_changed = True

    def letter_damaged(self, damaged: tuple[Damaged, ...], live: set[str]) -> None:
        """Entries that could not be decoded become dead letters with their raw text; the ids held open by no
        ``live`` fingerprint end."""
        for entry in damaged:
            self.counts["undecodable_state_entries"] += 1
            self.logs.append((logging.ERROR, f"A state entry of this key cannot be decoded ({entry.reason}); "
                                             "it goes to the dead letters"))
            self.outputs.append((DEAD_LETTER, DeadLetter(
                STAGE_INFERENCE, f"state entry could not be decoded after an update: {entry.reason}",
                entry.text, at=self.now).to_json()))
        dedupe.release_orphans(self.ids, live, self.now + self.rules.dedupe_window_s, self.now)
        self._ids_changed = True

    def next_to_forget(self) -> float | None:
        """Forgets the ids past their window or past :data:`~pipeline.generation.dedupe.MAX_ENDED_IDS` (the soonest
        to end), then says when the next one goes: a timer set for it never waits for an id already gone. Called
        after the step's last change to the ids."""
        if dedupe.prune(self.ids, self.now):
            self._ids_changed = True
        return dedupe.next_expiry(self.ids, self.now)

    def ids_after(self, seen: IdRecord, *, prune: bool = False) -> IdRecord:
        """The record of ids ``seen`` as the step leaves it: unchanged unless the step read it, else with the ids
        past their window or count forgotten (``prune`` opens it to forget them even where the step did not)."""
        if self._ids is None and not prune:
            return seen
        ids = self.ids
        return IdRecord(seen.text, ids, dedupe.prune(ids, self.now) or self._ids_changed)

    def done(self, *, hold_leases_s: float | None = None, cancel: tuple[str, ...] = (), report: Report | None = None,
             arm_at: float | None = None, disarm: bool = False, poll: Mapping[str, int] | None = None,
             poll_after_s: float = 0.0, submit: tuple[Submission, ...] = ()) -> Effects:
        """What the step asks the caller to do (:class:`~pipeline.generation.key_events.Effects`' fields), with
        what it emitted, counted and logged."""
        return Effects(outputs=tuple(self.outputs), hold_leases_s=hold_leases_s, cancel=cancel, report=report,
                       arm_at=arm_at, disarm=disarm, poll=poll, poll_after_s=poll_after_s, submit=submit,
                       counts=dict(self.counts), logs=tuple(self.logs))
