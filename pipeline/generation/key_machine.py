"""One key of the generate step as a pure state machine: ``step(rules, KeyState, Event) -> (KeyState, Effects)``.

Every promise the generate step makes for a key lives here, and nothing else does: dedupe by id, the queue
of requests waiting for room (the live lane's before the bulk lane's) and its cap, deadlines, the bound on lost
streams, resends, the poll backoff and the drain. No Beam, engine, runtime, clock or network: time comes in
each event, and every call to the engine goes out as an effect whose answer comes back as the next event. The DoFn
(:mod:`pipeline.generation.generate`) loads a key's cells, steps the machine until it asks nothing more, carries
out the effects through :func:`pipeline.generation.key_driver.drive` and commits; the worker simulator
(``tests/worker_sim``) runs the same driver under millions of schedules.

A callback is a short conversation::

    Arrived   -> submit? -> Submitted                      (a bundle of requests reached the key)
    PollDue   -> poll?   -> Polled -> submit? -> Submitted (the poll timer fired)
    DrainDue  -> poll    -> Polled -> poll ... -> Polled   (the job drains; one work item)

:class:`KeyState` carries what the conversation is in the middle of (``pending``: one of the frozen phases of
:data:`~pipeline.generation.key_state.Phase`); a committed state never does. Each handler is called only with
the event that happened, and an answer to a submission is found by the submission it names. Each request ends
exactly once: with its completion from the engine, or a dead letter from here.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import replace

from pipeline.contract.call_outcome import Call
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import KeyProgress, Output, RequestProgress, advance, given_up
from pipeline.generation import dedupe
from pipeline.generation.key_events import (
    WAITING_POLL_CAP_S,
    Arrived,
    DrainDue,
    Effects,
    Event,
    PollDue,
    Polled,
    Report,
    Rules,
    Submission,
    SubmitResult,
    Submitted,
)
from pipeline.generation.key_state import Arriving, Draining, KeyState, Phase, Polling, RequestEntry, Resending
from pipeline.generation.step_work import StepWork


def step(rules: Rules, state: KeyState, event: Event) -> tuple[KeyState, Effects]:
    """The key after ``event``, and what the caller must do (see :class:`Effects`)."""
    pending = state.pending
    if pending is not None:
        state = replace(state, pending=None)
    work = StepWork(rules, state.seen, event.now)
    if isinstance(event, Submitted) and (wrong := _misanswered(pending, event.results)):
        raise ValueError(f"{wrong} ({type(pending).__name__})")
    match pending, event:
        case None, Arrived():
            return _arrive(work, state, event)
        case None, PollDue():
            return _poll_due(work, state)
        case None, DrainDue():
            return _drain_due(work, state)
        case Arriving(), Submitted():
            return _arrived(work, state, pending, _answer(event.results, pending.submission))
        case Polling(), Polled():
            return _polled(work, state, pending, event)
        case Resending(), Submitted():
            return _resent(work, state, pending, event.results)
        case Draining(), Polled():
            return _drain_polled(work, state, pending, event)
    raise ValueError(f"{type(event).__name__} does not answer what the key is doing ({type(pending).__name__})")


def _misanswered(pending: Phase | None, results: tuple[SubmitResult, ...]) -> str | None:
    """What is wrong with ``results`` as the answer to the submissions ``pending`` made (each matched by identity),
    or None: they must be what :func:`~pipeline.generation.key_driver.submit_in_order` makes, one result for each
    submission in order, stopping only after one that asked to stop if not taken whole and was not."""
    asked: list[Submission] = []
    if isinstance(pending, Arriving) and pending.submission is not None:
        asked = [pending.submission]
    elif isinstance(pending, Resending):
        asked = [submission for _, submission in pending.resends] + [submission for _, submission in pending.groups]
    made = [result.submission for result in results]
    if len(made) > len(asked) or any(m is not a for m, a in zip(made, asked, strict=False)):
        return f"{len(results)} submit results do not answer the key's {len(asked)} submissions in order"
    stopped = [n for n, result in enumerate(results) if result.submission.stop_if_short and not result.taken_whole]
    if stopped and stopped[0] < len(results) - 1:
        return f"{len(results) - 1 - stopped[0]} submit results answer submissions made after one that stopped them"
    if len(made) < len(asked) and not stopped:
        return f"{len(asked) - len(made)} of the key's {len(asked)} submissions went unanswered"
    return None


def _answer(results: tuple[SubmitResult, ...], submission: Submission | None) -> SubmitResult | None:
    """The engine's answer to ``submission`` (the very record the step asked with); None: it was not made (an
    earlier one was not taken whole)."""
    return next((result for result in results if result.submission is submission), None)


def _end(work: StepWork, state: KeyState, effects: Effects, *, prune: bool = False) -> tuple[KeyState, Effects]:
    """The step's end: the state with the record of ids as the step leaves it (:meth:`StepWork.ids_after`), and
    its effects."""
    seen = work.ids_after(state.seen, prune=prune)
    return (state if seen is state.seen else replace(state, seen=seen)), effects


def _settled(work: StepWork, state: KeyState) -> KeyState:
    """The state less the entries that could not be decoded: each becomes a dead letter with its raw text, and the
    ids they held open end (:meth:`StepWork.letter_damaged`)."""
    if not state.damaged:
        return state
    work.letter_damaged(state.damaged, {e.fp for e in state.waiting + state.inflight})
    return replace(state, damaged=())


def _poll_in(rules: Rules, state: KeyState) -> float:
    """How soon a busy key polls: every ``bulk_poll_interval_s`` while all it holds, running or waiting, is the bulk
    lane's; else at the chunk cadence: a live request in flight or waiting, or a finished stream to release (the
    engine keeps it until then). A key whose requests only wait backs off from this (:func:`_resent`); room that
    a stream's end frees goes to whichever key polls first. A live request arriving sets the timer sooner
    (:func:`_armed`)."""
    held = state.inflight + state.waiting
    if state.progress.release or not held or any(not entry.bulk for entry in held):
        return rules.poll_interval_s
    return max(rules.poll_interval_s, rules.bulk_poll_interval_s)


def _armed(state: KeyState, at: float) -> tuple[KeyState, float | None]:
    """The state with its poll timer set for ``at``, and ``at`` as the timer to set; unchanged, and None, when it
    is already set to fire sooner."""
    if state.poll_at_ms is not None and state.poll_at_ms / 1000.0 <= at:
        return state, None
    return replace(state, poll_at_ms=int(at * 1000)), at


# A bundle of requests ---------------------------------------------------------------------------------------

def _arrive(work: StepWork, state: KeyState, event: Arrived) -> tuple[KeyState, Effects]:
    state = _settled(work, state)
    accepted = []
    for request in event.requests:
        fingerprint = request.fingerprint()
        holder = dedupe.holder(work.ids, request.id, work.now)
        if holder == fingerprint:
            work.counts["duplicates_dropped"] += 1
            work.logs.append((logging.INFO, f"Request {request.id}: a copy is in flight or finished within "
                                            "dedupe_window_s; dropped"))
        elif holder is not None:
            work.letter(request, "another request with this id is in flight or finished within "
                                 f"dedupe_window_s={work.rules.dedupe_window_s:g}; give each request its own id")
        else:
            work.hold(request, fingerprint)
            deadline_at = None if request.deadline_ms is None else request.received_at + request.deadline_ms / 1000
            accepted.append(RequestEntry(request.to_json(), fingerprint, deadline_at=deadline_at, batch=event.batch,
                                         bulk=request.bulk))
    arrived = tuple(r.id for r in event.requests)
    # Once one waits, the rest of its lane queue behind it; a live request goes ahead of bulk ones.
    if accepted and not any(_ahead(entry, accepted[0]) for entry in state.waiting):
        submission = Submission(tuple(e.request for e in accepted), tuple(e.attempt for e in accepted), True)
        pending = Arriving(tuple(accepted), len(state.waiting), arrived, submission)
        return _end(work, replace(state, pending=pending), work.done(submit=(submission,)))
    return _arrived(work, state, Arriving(tuple(accepted), len(state.waiting), arrived, None), None)


def _lose(entry: RequestEntry) -> RequestEntry:
    """The entry with one more loss: a stream lost (its key moved, its worker was lost) or an engine call that
    failed for it. Both count against the one bound (:func:`~pipeline.contract.stream_progress.given_up`), so
    neither a failing engine nor keys that keep moving hold a request for ever."""
    return replace(entry, lost=entry.lost + 1)


def _give_up(work: StepWork, entry: RequestEntry, losses: int, last: str) -> None:
    """The request ends as a dead letter at the bound of losses. The letter names the count and the last loss
    only: the losses before it may have been of either kind, and the entry does not record which."""
    work.end(entry)
    work.letter(entry, f"its stream was lost or its engine failed {losses} times in all, the bound (the last "
                       f"time: {last})")


def _taken(entries: tuple[RequestEntry, ...], result: SubmitResult | None
           ) -> tuple[tuple[RequestEntry, ...], tuple[RequestEntry, ...]]:
    """(the entries the engine took, a prefix, with their streams; those left to wait). A failed engine counts as
    a lost stream for each left (so failures are bounded as moves are)."""
    if result is None:
        return (), entries
    if result.outcome is Call.FAILED:
        return (), tuple(_lose(entry) for entry in entries)
    streams = result.streams if result.outcome is Call.ANSWERED else ()
    sent = tuple(replace(entry, key=key) for entry, key in itertools.takewhile(
        lambda pair: pair[1] is not None, zip(entries, streams, strict=False)))
    return sent, entries[len(sent):]


def _arrived(work: StepWork, state: KeyState, pending: Arriving,
             result: SubmitResult | None) -> tuple[KeyState, Effects]:
    sent, left = _taken(pending.accepted, result)
    room = max(work.rules.waiting_cap - pending.already, 0)
    for entry in left[room:]:  # admission holds a worker far below this; a key past it sheds, never grows unbounded
        work.forget(entry)
        work.letter(entry, f"the generate step's queue for its key is full ({work.rules.waiting_cap} requests "
                           "wait): the workers take more than they can hold; republish it")
    left = left[:room]
    work.counts["requests_sent"] += len(sent)
    work.counts["requests_queued"] += len(left)
    state = replace(state, inflight=state.inflight + sent, waiting=_live_first(state.waiting + left))
    if pending.accepted and state.wait_ms is not None:
        state = replace(state, wait_ms=None)  # new work: no backoff (its lane's cadence again)
    arm_at = None
    if state.inflight or state.waiting:  # a busy key's timer only comes sooner (a bundle of copies leaves it)
        state, arm_at = _armed(state, work.now + _poll_in(work.rules, state))
    elif state.poll_at_ms is not None and not state.holds_work and \
            (expiry := work.next_to_forget()) is not None and \
            int((expiry + 1.0) * 1000) != state.poll_at_ms:
        # An idle key's timer waits only to forget ids (_resent), and this step forgot those past their window or
        # count (StepWork.next_to_forget): it moves to the next to go, rather than fire for nothing (seed 502502).
        # An id is left wherever the bundle left the key idle (its copies', or a lettered request's holder's).
        state, arm_at = replace(state, poll_at_ms=int((expiry + 1.0) * 1000)), expiry + 1.0
    return _end(work, state, work.done(report=Report(pending.already + len(left), pending.arrived), arm_at=arm_at))


def _ahead(waiting: RequestEntry, arriving: RequestEntry) -> bool:
    """Whether a request that waits goes before one that arrives: a live one always, a bulk one before bulk."""
    return not waiting.bulk or arriving.bulk


def _live_first(entries: tuple[RequestEntry, ...]) -> tuple[RequestEntry, ...]:
    """The waiting queue in the order it is served: the live lane's in arrival order, then the bulk lane's."""
    return tuple(e for e in entries if not e.bulk) + tuple(e for e in entries if e.bulk)


# The poll timer ---------------------------------------------------------------------------------------------

def _poll_due(work: StepWork, state: KeyState) -> tuple[KeyState, Effects]:
    state = replace(_settled(work, state), poll_at_ms=None)
    entries = work.unique(state.inflight)
    waiting = work.unique(_live_first(state.waiting), besides=entries)
    # Nothing to ask (timers can fire twice for one setting, and a lost stream has none): no poll is made.
    asked = state.progress.asks([e.key for e in entries if e.key is not None])
    pending = Polling(entries, waiting, asked)
    if not asked:
        return _polled(work, state, pending, None)
    return _end(work, replace(state, pending=pending), work.done(poll=asked))


def _advance_all(work: StepWork, entries: tuple[RequestEntry, ...], progress: KeyProgress, event: Polled | None,
                 asked: Mapping[str, int], *, draining: bool
                 ) -> tuple[list[RequestEntry], list[int], list[tuple[RequestProgress, bool]], list[str]]:
    """Each request advanced by its stream's answer (:func:`~pipeline.contract.stream_progress.advance`): the
    requests still in flight, the indexes among them to send again, each request's progress as settled, and the
    streams given up that may still run: to cancel.

    While the runtime is unreachable nothing is known, so nothing changes: the streams are asked for again once it
    is back (a new host no longer knows them, and they are sent again then, once). When the engine failed, the
    streams stay where they are too, and the failure counts against each as a lost stream would, so a failing
    engine is bounded as moves are; sending them again would regenerate what they had made. ``event`` None: no
    poll was made (nothing to ask), so no stream has news.
    """
    failed = event is not None and event.outcome is Call.FAILED
    answers: Mapping[str, list[Output]] = event.answers if event is not None and event.outcome is Call.ANSWERED else {}
    remaining: list[RequestEntry] = []
    resends: list[int] = []
    settled: list[tuple[RequestProgress, bool]] = []
    abandoned: list[str] = []
    for entry in entries:
        current = replace(entry.progress, position=progress.position(entry.key))
        if failed and entry.key is not None and not draining:
            if given_up(entry.lost + 1):
                abandoned.append(entry.key)
                _give_up(work, entry, entry.lost + 1, "the engine failed when asked for its stream")
            else:
                remaining.append(_lose(entry))
                settled.append((current, False))
            continue
        answer = answers.get(entry.key, []) if entry.key is not None else None
        after, moved = advance(current, answer, asked.get(entry.key, 0) if entry.key else 0, draining=draining)
        work.outputs.extend(moved.emit)
        if moved.give_up:
            work.end(entry)
            if draining:
                work.letter(entry, "its stream was lost while the job drained", drain=True)
            elif entry.key is None:  # streamless at the bound: its last resend failed, and was counted then
                _give_up(work, entry, entry.lost, "the engine failed when it was sent again")
            else:
                _give_up(work, entry, entry.lost + 1,
                         "its stream was lost (its key moved away, or its worker was lost)")
        elif moved.ended:
            work.end(entry)
        elif moved.resend is not None:
            resends.append(len(remaining))
            remaining.append(replace(entry, key=None, attempt=moved.resend.attempt, lost=moved.resend.lost))
            continue  # a resent stream starts at 0: nothing to settle
        else:
            remaining.append(replace(entry, key=after.stream, attempt=after.attempt, lost=after.lost))
        settled.append((after, moved.ended))
    return remaining, resends, settled, abandoned


def _polled(work: StepWork, state: KeyState, pending: Polling, event: Polled | None) -> tuple[KeyState, Effects]:
    remaining, resends, settled, abandoned = _advance_all(work, pending.entries, state.progress, event,
                                                          pending.asked, draining=False)
    progress = state.progress.settled(settled) if (pending.entries or state.progress.release) else state.progress
    if event is not None and event.outcome is not Call.ANSWERED:
        # The engine did not see this poll. What it was to release is cancelled instead (a cancel forgets a finished
        # stream as a release does; if it fails too, the engine forgets it after request_timeout_s): kept, it would
        # keep a key whose engine keeps failing polling for ever with nothing to do.
        abandoned += [stream for stream in state.progress.release if stream not in abandoned]
        progress = KeyProgress(progress.taken, {})
    live = []
    for entry in pending.waiting:
        if entry.deadline_at is not None and work.now > entry.deadline_at:
            request = InferenceRequest.from_json(entry.request)
            work.end(entry)
            work.letter(request, f"its deadline_ms={request.deadline_ms} passed while it waited for the model "
                                 "server (backlog)")
        else:
            live.append(entry)
    resent = tuple((i, Submission((remaining[i].request,), (remaining[i].attempt,), False)) for i in resends)
    # Offered even when the engine is full: a retried firing whose first try sent some of them finds the engine
    # full of exactly those, and submitting again is what joins them (their keys come back, not None).
    groups = tuple((group, Submission(tuple(e.request for e in group), tuple(e.attempt for e in group), True))
                   for group in (tuple(g) for _, g in itertools.groupby(live, key=lambda e: e.batch)))
    resending = Resending(tuple(remaining), resent, groups, progress)
    submit = tuple(submission for _, submission in resent) + tuple(submission for _, submission in groups)
    if submit:
        return _end(work, replace(state, pending=resending), work.done(submit=submit, cancel=tuple(abandoned)))
    return _resent(work, state, resending, (), cancel=tuple(abandoned))


def _resent(work: StepWork, state: KeyState, pending: Resending, results: tuple[SubmitResult, ...],
            cancel: tuple[str, ...] = ()) -> tuple[KeyState, Effects]:
    remaining = list(pending.remaining)
    for index, submission in pending.resends:
        result = _answer(results, submission)
        entry = remaining[index]
        if result is None:  # never: resends are made first and stop nothing, and step refuses an answer short of one
            continue
        if result.outcome is Call.FAILED:
            remaining[index] = _lose(entry)
            continue
        if result.outcome is Call.ANSWERED and result.streams and result.streams[0] is not None:
            work.counts["lost_streams_resubmitted"] += 1
            work.logs.append((logging.WARNING, f"A lost stream of request {entry.request_id} was sent again as "
                                               f"{result.streams[0]}"))
            remaining[index] = replace(entry, key=result.streams[0])
    sent: list[RequestEntry] = []
    left: list[RequestEntry] = []
    for n, (group, submission) in enumerate(pending.groups):
        taken, rest = _taken(group, _answer(results, submission))
        sent += taken
        work.counts["requests_admitted_from_queue"] += len(taken)
        if rest:
            for entry in rest:
                if not given_up(entry.lost):
                    left.append(entry)
                else:
                    _give_up(work, entry, entry.lost, "the engine failed when it was sent")
            left += [e for later, _ in pending.groups[n + 1:] for e in later]
            break
    state = replace(state, inflight=tuple(remaining) + tuple(sent), waiting=tuple(left), progress=pending.progress)
    busy = bool(remaining or sent or pending.progress.release)
    arm_at = None
    if busy:
        state, arm_at = _armed(replace(state, wait_ms=None), work.now + _poll_in(work.rules, state))
    elif left:  # nothing here can change until another key's stream ends: back off from its cadence, to 2 s
        floor_ms = int(_poll_in(work.rules, state) * 1000)
        backoff = min(max(2 * (state.wait_ms or 0), floor_ms), int(WAITING_POLL_CAP_S * 1000))
        state, arm_at = _armed(replace(state, wait_ms=backoff), work.now + backoff / 1000)
    elif (expiry := work.next_to_forget()) is not None:  # to forget ids once nothing else is left
        state, arm_at = _armed(state, expiry + 1.0)
    effects = work.done(report=Report(len(left)), arm_at=arm_at, cancel=cancel)
    return _end(work, state, effects, prune=not (remaining or sent or left))


# The drain ----------------------------------------------------------------------------------------------------

def _drain_due(work: StepWork, state: KeyState) -> tuple[KeyState, Effects]:
    """The window is closing (on the global window: the job drains). Requests in flight get ``drain_timeout_s``
    to finish, in this one work item; what waits is not started: a ``drain`` dead letter at once, for a redrive.
    Polled from the committed positions, pass after pass, and nothing released: if this work item's commit
    fails, its retry finds every stream where the last commit left it and collects it again."""
    state = _settled(work, state)
    entries = work.unique(state.inflight)
    for entry in work.unique(state.waiting, besides=entries):
        work.end(entry)
        work.letter(entry, "the job drained before the request was sent to the model server", drain=True)
    progress = state.progress
    pending = Draining(entries, progress, dict(progress.taken), work.now + work.rules.drain_timeout_s, {})
    if not entries:
        return _drain_end(work, pending, opening=True)
    return _drain_ask(work, state, pending, 0.0, opening=True)


def _hold(work: StepWork) -> float:
    """How long every stream's lease is held from now (``hold_leases_s``), asked at each of a drain's passes. Keys
    drain one work item at a time, each polling only its own streams, so a key drained late would find its
    streams cut by their lease while the keys before it waited theirs out: each pass holds them for
    ``drain_timeout_s`` more, so the hold lasts while any key drains and ends ``drain_timeout_s`` after the last
    pass; then the leases of streams nobody drained (their key moved away) run again."""
    return work.rules.drain_timeout_s


def _drain_ask(work: StepWork, state: KeyState, pending: Draining, delay: float, *,
               opening: bool = False) -> tuple[KeyState, Effects]:
    """One pass: the key's streams asked from the positions committed before the drain. Its first also reports
    that nothing of this key waits any more."""
    asked = pending.progress.asks([e.key for e in pending.entries if e.key is not None], pending.committed)
    pending = replace(pending, asked=asked)
    if not asked:
        return _drain_polled(work, state, pending, None, opening=opening)
    effects = work.done(poll=asked, poll_after_s=delay, hold_leases_s=_hold(work),
                        report=Report(0) if opening else None)
    return _end(work, replace(state, pending=pending), effects)


def _drain_polled(work: StepWork, state: KeyState, pending: Draining, event: Polled | None, *,
                  opening: bool = False) -> tuple[KeyState, Effects]:
    remaining, _, settled, abandoned = _advance_all(work, pending.entries, pending.progress, event,
                                                    pending.asked, draining=True)
    pending = replace(pending, entries=tuple(remaining), progress=pending.progress.settled(settled, draining=True),
                      abandoned=pending.abandoned + tuple(abandoned))
    if pending.entries and work.now < pending.deadline:
        return _drain_ask(work, state, pending, min(work.rules.poll_interval_s, pending.deadline - work.now),
                          opening=opening)
    return _drain_end(work, pending, opening=opening)


def _drain_end(work: StepWork, pending: Draining, *, opening: bool = False) -> tuple[KeyState, Effects]:
    """Unfinished within the timeout: stopped at the server now, and a drain dead letter each. Finished ones stay
    until the engine's own expiry (request_timeout_s), for a retry of this work item to collect."""
    for entry in pending.entries:
        work.letter(entry, f"the job drained and the request did not finish within "
                           f"drain_timeout_s={work.rules.drain_timeout_s:g}", drain=True)
    work.forget_ids()
    cancel = pending.abandoned + tuple(e.key for e in pending.entries if e.key is not None)
    effects = work.done(cancel=cancel, disarm=True, hold_leases_s=_hold(work), report=Report(0) if opening else None)
    return _end(work, KeyState(), effects)
