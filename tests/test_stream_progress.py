"""Stream progress (pipeline/contract/stream_progress.py): retried polls hand every output over exactly once.

The two sides of a poll are driven here as the generate step and the engine use them, under schedules a runner
may impose: the stream produces outputs, polls and drain passes commit or fail (their writes discarded).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.contract.call_outcome import Call
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import (
    ATTEMPT,
    CHUNK,
    MAX_LOST_STREAMS,
    UNKNOWN,
    KeyProgress,
    OutputWindow,
    RequestProgress,
    advance,
    given_up,
)
from pipeline.generation import key_machine
from pipeline.generation.key_driver import submit_in_order
from pipeline.generation.key_events import Arrived, PollDue, Polled, Rules, SubmitResult, Submitted
from pipeline.generation.key_state import KeyState

END = "completion"


def chunk(n: int, attempt: int = 1) -> tuple[str, str]:
    return CHUNK, json.dumps({"seq": n, "attempt": attempt})


def test_a_window_hands_over_from_the_position_and_refuses_to_splice():
    window = OutputWindow()
    for n in range(3):
        window.add(("chunk", str(n)))
    assert window.read(0) == [("chunk", "0"), ("chunk", "1"), ("chunk", "2")]
    assert window.read(2) == [("chunk", "2")], "what comes before the position is released"
    assert window.read(2) == [("chunk", "2")], "a retried poll gets the same"
    assert window.read(1) is None, "before what was released: another worker's position, never spliced"
    assert window.read(4) is None, "past what was produced"
    assert window.read(3) == [] and len(window) == 0


def test_a_poll_that_ends_a_stream_releases_it_on_the_next_and_a_drain_releases_nothing():
    progress = KeyProgress()
    assert progress.asks(["s"]) == {"s": 0}
    after, step = advance(RequestProgress("s"), [chunk(0), chunk(1)], 0)
    assert step.emit == (chunk(0), chunk(1)) and not step.ended
    progress = progress.settled([(after, step.ended)])
    assert progress == KeyProgress({"s": 2}, {})
    assert progress.asks(["s"]) == {"s": 2}
    after, step = advance(replace(after, position=progress.position("s")), [(END, "{}")], 2)
    progress = progress.settled([(after, step.ended)])
    assert step.ended and progress == KeyProgress({}, {"s": 3})
    assert progress.asks([]) == {"s": 3}, "the next poll tells the engine it may forget the stream"
    assert progress.settled([]) == KeyProgress(), "and forgets it once that poll is committed"

    draining = KeyProgress(taken={"d": 1}, release={"gone": 4})
    committed = dict(draining.taken)
    assert draining.asks(["d"], committed) == {"d": 1, "gone": 4}
    after, step = advance(RequestProgress("d", 1), [chunk(1), chunk(2)], 1, draining=True)
    draining = draining.settled([(after, step.ended)], draining=True)
    assert draining.asks(["d"], committed) == {"d": 1, "gone": 4}, "a drain asks from the committed position"
    after, step = advance(RequestProgress("d", draining.position("d")), [chunk(1), chunk(2), (END, "{}")], 1,
                          draining=True)
    assert step.emit == ((END, "{}"),), "only what this work item has not emitted yet"
    assert draining.settled([(after, step.ended)], draining=True) == KeyProgress({}, {"gone": 4}), \
        "a drain releases nothing: its retry must find the stream"


def test_a_lost_stream_is_sent_again_past_every_attempt_seen_until_too_many_were_lost():
    """Given up at its MAX_LOST_STREAMS-th loss, as a failing engine's request is at its MAX_LOST_STREAMS-th
    failure (``given_up``, the one reading of the bound). Issue 80 found the bound read four ways: a lost stream
    was sent again after its eighth loss and given up only at its ninth."""
    progress, step = advance(RequestProgress("s"), [(ATTEMPT, "3"), chunk(0, attempt=3)], 0)
    assert (progress.attempt, progress.lost) == (3, 0), "the engine retried at a failing server: not a lost stream"
    assert step.emit == (chunk(0, attempt=3),), "an attempt marker is not emitted"
    progress, step = advance(progress, [(UNKNOWN, "")], 1)
    assert progress.stream is None and step.resend == RequestProgress(None, 0, 4, 1), "sent again past attempt 3"
    assert not step.ended and not step.give_up
    for _ in range(MAX_LOST_STREAMS - 2):
        progress, step = advance(replace(step.resend, stream="again"), None, 0)
    assert step.resend.lost == MAX_LOST_STREAMS - 1 and not given_up(step.resend.lost)
    progress, step = advance(replace(step.resend, stream="again"), [(UNKNOWN, "")], 0)
    assert step.ended and step.give_up and step.resend is None, "moves have a bound of their own"
    assert given_up(MAX_LOST_STREAMS) and not given_up(MAX_LOST_STREAMS - 1)
    _, step = advance(RequestProgress("s"), [(UNKNOWN, "")], 0, draining=True)
    assert step.ended and step.give_up, "a drain sends nothing again: the stream goes to the next job"


def test_the_machine_refuses_submit_results_other_than_what_the_driver_makes_of_its_submissions():
    """A result names the submission it answers, and the results must be submit_in_order's: one for each submission,
    in order, stopping only after a short one that asked to. A missing or stray result is a defect of the caller,
    refused, not read as a submission never made (issue 80: a missing result silently became UNREACHABLE)."""
    rules = Rules(poll_interval_s=0.05, dedupe_window_s=600.0, drain_timeout_s=30.0, waiting_cap=100)
    requests = tuple(InferenceRequest(id=f"r{n}", prompt="hi", max_tokens=4, received_at=0.0) for n in range(2))
    state, effects = key_machine.step(rules, KeyState(), Arrived(0.0, requests, "b1"))
    (asked,) = effects.submit
    with pytest.raises(ValueError, match="1 of the key's 1 submissions went unanswered"):
        key_machine.step(rules, state, Submitted(0.0, ()))
    with pytest.raises(ValueError, match="do not answer the key's 1 submissions in order"):  # equal, not the one
        key_machine.step(rules, state, Submitted(0.0, (SubmitResult(replace(asked), Call.ANSWERED, ("a", "b")),)))
    state, effects = key_machine.step(rules, state, Submitted(0.0, submit_in_order(
        effects.submit, lambda submission: SubmitResult(submission, Call.ANSWERED, ("a", "b")))))
    state, effects = key_machine.step(rules, state, PollDue(1.0))
    assert effects.poll is not None
    state, effects = key_machine.step(rules, state, Polled(1.0, Call.ANSWERED,
                                                           {key: [(UNKNOWN, "")] for key in effects.poll}))
    assert len(effects.submit) == 2 and not any(s.stop_if_short for s in effects.submit), "both streams lost"
    failed = submit_in_order(effects.submit[:1], lambda submission: SubmitResult(submission, Call.FAILED))
    with pytest.raises(ValueError, match="1 of the key's 2 submissions went unanswered"):
        key_machine.step(rules, state, Submitted(1.0, failed))  # a resend stops nothing: the second was made too
    key_machine.step(rules, state, Submitted(1.0, submit_in_order(
        effects.submit, lambda submission: SubmitResult(submission, Call.FAILED))))
    # Two bundles waiting for room, offered in order: the first not taken whole stops the second.
    state, effects = key_machine.step(rules, KeyState(), Arrived(0.0, requests[:1], "b1"))
    state, effects = key_machine.step(rules, state, Submitted(0.0, submit_in_order(
        effects.submit, lambda submission: SubmitResult(submission, Call.ANSWERED, (None,)))))
    state, effects = key_machine.step(rules, state, Arrived(0.1, requests[1:], "b2"))
    assert not effects.submit, "it queues behind the first"
    state, effects = key_machine.step(rules, state, PollDue(1.0))
    assert len(effects.submit) == 2 and all(s.stop_if_short for s in effects.submit)
    full = [SubmitResult(effects.submit[0], Call.ANSWERED, (None,)),
            SubmitResult(effects.submit[1], Call.ANSWERED, ("s",))]
    with pytest.raises(ValueError, match="1 submit results answer submissions made after one that stopped them"):
        key_machine.step(rules, state, Submitted(1.0, tuple(full)))
    state, _ = key_machine.step(rules, state, Submitted(1.0, tuple(full[:1])))  # submit_in_order's, engine full
    assert [entry.request_id for entry in state.waiting] == ["r0", "r1"], "both wait on, in order"


def test_a_request_waiting_to_be_sent_again_is_not_lost_again_at_every_poll():
    """Found by the worker simulator (seed 325, engine failures only, max_in_flight 1): a request whose stream
    was lost while the engine was full counted one more lost stream at each poll while it waited, and was
    dead-lettered as moved eight times after eight polls."""
    _, step = advance(RequestProgress("s", attempt=2), [(UNKNOWN, "")], 0)
    waiting = step.resend
    for _ in range(10 * MAX_LOST_STREAMS):  # the engine stays full: every resend is refused
        waiting, step = advance(waiting, None, 0)
        assert step.resend == waiting and not step.give_up
    assert (waiting.attempt, waiting.lost) == (3, 1), "the same attempt, one loss, however long it waits"
    _, step = advance(replace(waiting, lost=MAX_LOST_STREAMS - 1), None, 0)
    assert not step.give_up
    _, step = advance(replace(waiting, lost=MAX_LOST_STREAMS), None, 0)
    assert step.give_up, "failed resends are counted by the caller, and bounded by the same reading"


# A schedule: the stream produces outputs (the last one its end), and work items that commit or fail.
_steps = st.lists(st.one_of(
    st.tuples(st.just("produce"), st.integers(1, 3)),
    st.tuples(st.just("poll"), st.booleans()),
    st.tuples(st.just("drain"), st.integers(1, 3), st.booleans())), max_size=30)


@settings(max_examples=400, deadline=None)
@given(_steps, st.integers(1, 12))
def test_every_schedule_delivers_each_output_once_in_order_and_releases_only_what_was_committed(steps, length):
    produced: list[tuple[str, str]] = []
    window, committed, delivered = OutputWindow(), KeyProgress(), []
    forgotten = False  # the engine forgot the stream: released whole

    def produce(count: int) -> None:
        for _ in range(count):
            if len(produced) < length:
                n = len(produced)
                produced.append((END, "{}") if n == length - 1 else chunk(n))
                window.add(produced[-1])

    def poll(progress: KeyProgress, drain_from: dict[str, int] | None, emitted: list) -> KeyProgress:
        nonlocal forgotten
        draining = drain_from is not None
        streaming = [] if any(kind == END for kind, _ in delivered + emitted) else ["s"]  # its request ended
        asked = progress.asks(streaming, drain_from)
        if "s" not in asked:
            return progress.settled([], draining=draining)
        outputs = window.read(asked["s"])
        assert outputs is not None, "a committed position is always inside the window"
        if "s" not in streaming:  # the release of a finished stream
            forgotten = not outputs
            return progress.settled([], draining=draining)
        after, step = advance(RequestProgress("s", progress.position("s")), outputs, asked["s"], draining=draining)
        emitted.extend(step.emit)
        return progress.settled([(after, step.ended)], draining=draining)

    for step in steps:
        if step[0] == "produce":
            produce(step[1])
        elif step[0] == "poll":
            emitted = []
            work = poll(committed, None, emitted)
            if step[1]:
                committed, delivered = work, delivered + emitted
        else:  # a drain: passes in one work item from the positions committed before it
            work, emitted, before = committed, [], dict(committed.taken)
            for _ in range(step[1]):
                work = poll(work, before, emitted)
                produce(1)
            if step[2]:
                committed, delivered = work, delivered + emitted
        assert delivered == produced[:len(delivered)], "each output once, in order, no gap"
        assert window.released <= len(delivered), "nothing released that was not committed"
        if step[0] == "drain" and step[2]:
            return  # the drain committed: the job is over (the engine expires what it keeps, request_timeout_s)
    produce(length)
    for _ in range(3):  # the stream ends, and polls commit: everything arrives, and the stream is released
        emitted = []
        committed = poll(committed, None, emitted)
        delivered = delivered + emitted
    assert delivered == produced and forgotten and committed.taken == {} and committed.release == {}


def test_a_request_given_up_after_a_move_and_failed_resends_names_the_engine_not_the_moves():
    """The bound counts lost streams and failed engine calls alike, and the entry does not record which each was;
    the dead letter names the count and only the last. Here the stream is lost once (its key moved: the engine
    no longer knows it) and every resend then fails: the letter blames the engine, not moves (before, a request
    given up while streamless was lettered as lost to key moves every time)."""
    rules = Rules(poll_interval_s=0.05, dedupe_window_s=600.0, drain_timeout_s=30.0, waiting_cap=100)
    request = InferenceRequest(id="moved-then-failing", prompt="hi", max_tokens=4, received_at=0.0)
    now, submits = 0.0, 0
    state, effects = key_machine.step(rules, KeyState(), Arrived(now, (request,), "b1"))
    letters: list[dict] = []
    while not letters and now < 100:
        if effects.submit:
            submits += 1

            def answer(submission, first=submits == 1):
                if first:
                    return SubmitResult(submission, Call.ANSWERED, ("stream-1",))
                return SubmitResult(submission, Call.FAILED)

            state, effects = key_machine.step(rules, state, Submitted(now, submit_in_order(effects.submit, answer)))
        elif effects.poll is not None:
            lost = {key: [(UNKNOWN, "")] for key in effects.poll}  # the engine no longer knows the stream
            state, effects = key_machine.step(rules, state, Polled(now, Call.ANSWERED, lost))
        else:
            now += 1.0
            state, effects = key_machine.step(rules, state, PollDue(now))
        letters += [json.loads(payload) for kind, payload in effects.outputs if kind == "dead_letter"]
    (letter,) = letters
    assert submits == MAX_LOST_STREAMS, "one stream, then a resend per loss left within the bound"
    assert letter["reason"] == (f"its stream was lost or its engine failed {MAX_LOST_STREAMS} times in all, the "
                                "bound (the last time: the engine failed when it was sent again)")
