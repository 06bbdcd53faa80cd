"""Stream progress: how polls that a runner may retry hand every output of a stream over exactly once. Pure.

Both sides of a poll keep a count, and this module is the whole of their arithmetic:

* the engine keeps, per stream, the outputs its caller has not released (:class:`OutputWindow`);
* the generate step keeps, per request, where its stream is and how far it has emitted it
  (:class:`RequestProgress`, advanced by :func:`advance`), and per key, in state committed together with what it
  emitted, those positions and the finished streams the engine may forget (:class:`KeyProgress`).

A poll asks each stream from the caller's committed position. The engine releases what comes before it and
hands over the rest, again at every poll, until a later poll's position shows it committed; so a poll whose
commit failed (its outputs and state writes discarded, the work item retried) asks from the same position
and gets the same outputs instead of finding the stream gone. A position outside the window is a stream the
caller cannot continue (lost, or another worker's): it is never spliced. A finished stream is released
whole by the poll after the one that emitted its end, and then forgotten.

A stream the engine no longer knows (its key moved away, its worker was lost) is sent again as the request's
next attempt, under a bound of its own (:data:`MAX_LOST_STREAMS`): moves are not the request's failures, so they
do not use up the engine's retries at a failing server, nor does a failing server use up the moves.

A drain polls many times in one work item and commits once: it asks from the positions committed before it
each pass, releasing nothing, so a retried drain finds every stream where the last commit left it; a request's
position runs ahead of what it asked from, and only the outputs past it are new (:func:`advance` is the same
rule for a poll, where the two are equal).

No clock, no lock, no I/O: the engine calls an :class:`OutputWindow` under its lock; the generate step applies
:func:`advance` to each request's progress and :meth:`KeyProgress.settled` to the key's
(``tests/test_stream_progress.py`` drives them under schedules of failed commits).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

Output = tuple[str, str]  # (kind, payload) as the engine hands it over
# Output kinds handed back by the engine's poll; ATTEMPT says the engine retried the stream as a new attempt.
CHUNK, COMPLETION, DEAD_LETTER, UNKNOWN, ATTEMPT = "chunk", "completion", "dead_letter", "unknown", "attempt"
ENDS = (COMPLETION, DEAD_LETTER)
# A request that loses this many streams or engine calls in all (its key moved away, its bundle was retried
# elsewhere, its engine failed a poll or a submission, each time) is given up. Counted apart from the engine's
# attempts (model server restarts), which have their own bound.
MAX_LOST_STREAMS = 8


def given_up(lost: int) -> bool:
    """Whether a request whose streams were lost (or whose engine failed it) ``lost`` times is given up: the one
    reading of :data:`MAX_LOST_STREAMS`, wherever a loss is counted."""
    return lost >= MAX_LOST_STREAMS


@dataclass
class OutputWindow:
    """A stream's outputs not yet released by its caller: ``outputs[0]`` is the stream's output number
    ``released``."""

    released: int = 0
    outputs: list[Output] = field(default_factory=list)

    def add(self, output: Output) -> None:
        self.outputs.append(output)

    def read(self, position: int) -> list[Output] | None:
        """The outputs from ``position`` on, releasing those before it (the caller committed them); None when
        ``position`` is outside the window (before what was released, or past what was produced)."""
        if not self.released <= position <= self.released + len(self.outputs):
            return None
        del self.outputs[:position - self.released]
        self.released = position
        return list(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)


@dataclass(frozen=True)
class RequestProgress:
    """One request in flight: its stream at the engine (None: lost while the engine had no room to resend it),
    how many of the stream's outputs it has emitted, its attempt number and how many of its streams were lost."""

    stream: str | None
    position: int = 0
    attempt: int = 1
    lost: int = 0


@dataclass(frozen=True)
class Step:
    """What one poll of a request yields: outputs to emit (chunks, a completion or a dead letter, in order),
    whether the request ended, and, for a lost stream, what it becomes if it is sent again (``resend``; the
    caller submits it as ``resend.attempt`` and sets its stream) or that it must be given up (``give_up``)."""

    emit: tuple[Output, ...] = ()
    ended: bool = False
    resend: RequestProgress | None = None
    give_up: bool = False


def advance(progress: RequestProgress, answer: list[Output] | None, asked_from: int,
            *, draining: bool = False) -> tuple[RequestProgress, Step]:
    """The request after the engine answered ``answer`` for its stream asked from ``asked_from`` (None: the
    request has no stream to ask); in a drain a lost stream is given up rather than sent again."""
    if progress.stream is None and not draining:
        # Lost earlier and not sent again yet (the engine had no room): nothing was lost since, so it is only
        # still to send, at the same attempt. Its engine's failures count when a resend fails (the caller's).
        if given_up(progress.lost):
            return progress, Step(ended=True, give_up=True)
        return progress, Step(resend=progress)
    if progress.stream is None or answer is None or (answer and answer[0][0] == UNKNOWN):
        lost = replace(progress, stream=None, position=0)
        if draining or given_up(progress.lost + 1):
            return lost, Step(ended=True, give_up=True)
        return lost, Step(resend=RequestProgress(None, 0, progress.attempt + 1, progress.lost + 1))
    fresh = answer[progress.position - asked_from:]
    attempt = progress.attempt
    for kind, payload in fresh:
        if kind == CHUNK:
            attempt = max(attempt, int(json.loads(payload)["attempt"]))
        elif kind == ATTEMPT:  # the engine retried the stream: a lost stream must be resent past it
            attempt = max(attempt, int(payload))
    step = Step(emit=tuple(output for output in fresh if output[0] != ATTEMPT),
                ended=any(kind in ENDS for kind, _ in fresh))
    return replace(progress, position=progress.position + len(fresh), attempt=attempt), step


@dataclass(frozen=True)
class KeyProgress:
    """One key's committed positions (``taken``) and its finished streams the engine may forget (``release``)."""

    taken: Mapping[str, int] = field(default_factory=dict)
    release: Mapping[str, int] = field(default_factory=dict)

    def asks(self, streams: Iterable[str], committed: Mapping[str, int] | None = None) -> dict[str, int]:
        """The positions to poll ``streams`` (the key's streams in flight) from, and its finished streams to
        release; ``committed``: a drain's pass, asked from the positions committed before the drain."""
        source = self.taken if committed is None else committed
        asked = {stream: source.get(stream, 0) for stream in streams}
        asked.update(self.release)  # released by a committed poll: safe to forget, and idempotent
        return asked

    def position(self, stream: str | None) -> int:
        return 0 if stream is None else self.taken.get(stream, 0)

    def settled(self, requests: Iterable[tuple[RequestProgress, bool]], *, draining: bool = False) -> KeyProgress:
        """The key's progress after a poll, from each request's progress and whether it ended: a running stream
        keeps its position, an ended one is released by the next poll (a drain releases nothing, so its retry
        finds every stream), a stream not named (lost, resent) is dropped."""
        taken, release = {}, {} if not draining else dict(self.release)
        for progress, ended in requests:
            if progress.stream is None:
                continue
            if ended:
                if not draining:
                    release[progress.stream] = progress.position
            elif progress.position:
                taken[progress.stream] = progress.position
        return KeyProgress(taken, release)
