"""Stream progress (pipeline/engines/stream_progress.py): retried polls hand every output over exactly once.

The two sides of a poll are driven here as the generate step and the engine use them, under schedules a runner
may impose: the stream produces outputs, polls and drain passes commit or fail (their writes discarded).
"""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engines.stream_progress import MAX_LOST_STREAMS, Attempts, KeyProgress, OutputWindow

END = "completion"


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
    assert progress.ask(["s"]) == {"s": 0}
    progress.emitted("s", 2, ended=False)
    assert progress.taken == {"s": 2}
    assert progress.ask(["s"]) == {"s": 2}
    progress.emitted("s", 1, ended=True)
    assert (progress.taken, progress.release) == ({}, {"s": 3})
    assert progress.ask([]) == {"s": 3}, "the next poll tells the engine it may forget the stream"
    assert progress.release == {}

    draining = KeyProgress(taken={"d": 1})
    committed = dict(draining.taken)
    assert draining.ask(["d"], committed) == {"d": 1}
    draining.emitted("d", 2, ended=False)
    assert draining.ask(["d"], committed) == {"d": 1}, "a drain asks from the committed position every pass"
    assert draining.unseen("d", [("chunk", "1"), ("chunk", "2"), ("chunk", "3")]) == [("chunk", "3")]
    draining.emitted("d", 1, ended=True)
    assert draining.release == {}, "a drain releases nothing: its retry must find the stream"


def test_a_lost_stream_is_sent_again_past_every_attempt_seen_until_too_many_were_lost():
    attempts = Attempts()
    assert attempts.seen(3) == Attempts(3, 0), "the engine retried at a failing server: not a lost stream"
    assert attempts.seen(3).seen(2) == Attempts(3, 0)
    again = attempts.seen(3).resent()
    assert again == Attempts(4, 1), "sent again past the engine's own attempts"
    for _ in range(MAX_LOST_STREAMS - 1):
        again = again.resent()
    assert again.lost == MAX_LOST_STREAMS and again.resent() is None, "moves have a bound of their own"


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
                produced.append((END if len(produced) == length - 1 else "chunk", str(len(produced))))
                window.add(produced[-1])

    def poll(progress: KeyProgress, drain_from: dict[str, int] | None, emitted: list) -> None:
        nonlocal forgotten
        streaming = [] if any(kind == END for kind, _ in delivered + emitted) else ["s"]  # its request ended
        asked = progress.ask(streaming, drain_from)
        if "s" not in asked:
            return
        outputs = window.read(asked["s"])
        assert outputs is not None, "a committed position is always inside the window"
        if "s" not in streaming:  # the release of a finished stream
            forgotten = not outputs
            return
        fresh = progress.unseen("s", outputs)
        emitted.extend(fresh)
        progress.emitted("s", len(fresh), ended=any(kind == END for kind, _ in fresh))

    for step in steps:
        if step[0] == "produce":
            produce(step[1])
        elif step[0] == "poll":
            work, emitted = copy.deepcopy(committed), []
            poll(work, None, emitted)
            if step[1]:
                committed, delivered = work, delivered + emitted
        else:  # a drain: passes in one work item from the positions committed before it
            work, emitted, before = copy.deepcopy(committed), [], dict(committed.taken)
            for _ in range(step[1]):
                poll(work, before, emitted)
                produce(1)
            if step[2]:
                committed, delivered = work, delivered + emitted
        assert delivered == produced[:len(delivered)], "each output once, in order, no gap"
        assert window.released <= len(delivered), "nothing released that was not committed"
        if step[0] == "drain" and step[2]:
            return  # the drain committed: the job is over (the engine expires what it keeps, request_timeout_s)
    produce(length)
    for _ in range(3):  # the stream ends, and polls commit: everything arrives, and the stream is released
        work, emitted = copy.deepcopy(committed), []
        poll(work, None, emitted)
        committed, delivered = work, delivered + emitted
    assert delivered == produced and forgotten and committed.taken == {} and committed.release == {}
