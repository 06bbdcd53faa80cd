"""Stream progress: how polls that a runner may retry hand every output of a stream over exactly once. Pure.

Both sides of :meth:`~pipeline.engines.engine.EngineBase.poll` keep a count, and this module is the whole
of their arithmetic:

* the engine keeps, per stream, the outputs its caller has not released (:class:`OutputWindow`);
* the generate step keeps, per key, in state committed together with what it emitted, how far it has
  emitted each stream and which finished streams the engine may forget (:class:`KeyProgress`).

A poll asks each stream from the caller's committed position. The engine releases what comes before it and
hands over the rest, again at every poll, until a later poll's position shows it committed; so a poll whose
commit failed (its outputs and state writes discarded, the work item retried) asks from the same position
and gets the same outputs instead of finding the stream gone. A position outside the window is a stream the
caller cannot continue (lost, or another worker's): it is never spliced. A finished stream is released
whole by the poll after the one that emitted its end, and then forgotten.

A stream the engine no longer knows (its key moved away, its worker was lost) is sent again as the request's
next attempt (:class:`Attempts`), under a bound of its own: moves are not the request's failures, so they do not
use up the engine's retries at a failing server, nor does a failing server use up the moves.

A drain polls many times in one work item and commits once: it asks from the positions committed before it
each pass, releasing nothing, so a retried drain finds every stream where the last commit left it, and skips
what an earlier pass of the same work item already emitted.

No clock, no lock, no I/O: the engine calls an :class:`OutputWindow` under its lock, the generate step owns
its :class:`KeyProgress` for one work item and an :class:`Attempts` per request (``tests/test_stream_progress.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

Output = tuple[str, str]  # (kind, payload) as the engine hands it over
# A request whose stream is lost this many times (its key moved away, or its bundle was retried elsewhere, each
# time) is given up. Counted apart from the engine's attempts (model server restarts), which have their own bound.
MAX_LOST_STREAMS = 8


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


@dataclass
class KeyProgress:
    """One key's committed positions (``taken``) and its finished streams to release (``release``), and one
    poll's work on them: :meth:`ask`, then :meth:`unseen` and :meth:`emitted` for each stream it emitted."""

    taken: dict[str, int] = field(default_factory=dict)
    release: dict[str, int] = field(default_factory=dict)
    _from: dict[str, int] = field(default_factory=dict)  # this poll: each stream's position when it began
    _asked: dict[str, int] = field(default_factory=dict)
    _draining: bool = False

    def ask(self, streams: Iterable[str], committed: dict[str, int] | None = None) -> dict[str, int]:
        """The positions to poll ``streams`` (the key's streams in flight) from, and its finished streams to
        release; ``committed``: a drain's pass, asked from the positions committed before the drain."""
        self._from = {key: self.taken.get(key, 0) for key in streams}
        self._draining = committed is not None
        asked = dict(self._from) if committed is None else {key: committed.get(key, 0) for key in self._from}
        asked.update(self.release)  # released by a committed poll: safe to forget, and idempotent
        self._asked = asked
        if not self._draining:
            self.release = {}
        self.taken = {}  # rebuilt from the streams this poll keeps
        return asked

    def unseen(self, stream: str, outputs: list[Output]) -> list[Output]:
        """What of ``outputs`` (the engine's answer for ``stream``, a stream it knows) this work item has not
        emitted yet: all of it, except in a drain's later passes."""
        if not self._draining or stream not in self._from:
            return outputs
        return outputs[self._from[stream] - self._asked[stream]:]

    def emitted(self, stream: str, count: int, *, ended: bool) -> None:
        """This poll emitted ``count`` more outputs of ``stream``; ``ended``: its last (the engine may forget it
        once this is committed; a drain releases nothing). A stream not reported here is dropped."""
        position = self._from.get(stream, 0) + count
        if ended:
            if not self._draining:
                self.release[stream] = position
        elif position:
            self.taken[stream] = position


@dataclass(frozen=True)
class Attempts:
    """A request's attempt number (its streams' ``attempt``) and how many of its streams were lost."""

    attempt: int = 1
    lost: int = 0

    def seen(self, attempt: int) -> Attempts:
        """The engine reported ``attempt`` (it retried the stream at a failing server): a resend goes past it."""
        return self if attempt <= self.attempt else replace(self, attempt=attempt)

    def resent(self) -> Attempts | None:
        """What the request is sent again as once its stream was lost; None when it has lost too many."""
        if self.lost >= MAX_LOST_STREAMS:
            return None
        return Attempts(self.attempt + 1, self.lost + 1)
