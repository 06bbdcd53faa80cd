"""What the key machine (:mod:`pipeline.generation.key_machine`) takes and gives: its rules, the events that
step it and the effects a step asks of its caller. Records only, frozen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.contract.call_outcome import Call
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import Output

# A key whose requests only wait for room doubles its poll interval up to this.
WAITING_POLL_CAP_S = 2.0
# How often a key whose only requests are bulk ones, running or waiting, polls (at most an eighth of the stream
# lease: bulk_poll_interval_s): nobody waits on their tokens, and each poll is a work item that live ones queue
# behind. A finished stream waits at the engine up to this long for its key's poll: only more than finished_kept
# (at least 64) finishing within it would drop one before its poll, which then sends it again.
BULK_POLL_S = 0.5


def bulk_poll_interval_s(stream_lease_s: float) -> float:
    """The bulk cadence under a stream lease: ``BULK_POLL_S``, at most an eighth of the lease, so a stream whose key
    polls late still keeps it."""
    return min(BULK_POLL_S, stream_lease_s / 8)


@dataclass(frozen=True)
class Rules:
    """The settings a key's machine runs under."""

    poll_interval_s: float
    dedupe_window_s: float
    drain_timeout_s: float
    waiting_cap: int  # the most requests one key keeps waiting (twice its worker's bound)
    bulk_poll_interval_s: float = 0.0  # how often a key that holds only bulk requests polls (at least the above)


# Events ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arrived:
    """A bundle of requests reached the key (``batch``: the batcher's batch they came in)."""

    now: float
    requests: tuple[InferenceRequest, ...]
    batch: str


@dataclass(frozen=True)
class PollDue:
    now: float


@dataclass(frozen=True)
class DrainDue:
    now: float


@dataclass(frozen=True)
class Polled:
    """The engine's answer to an ``Effects.poll``: per stream asked, its outputs from the position asked."""

    now: float
    outcome: Call
    answers: Mapping[str, list[Output]] = field(default_factory=dict)


@dataclass(frozen=True)
class Submitted:
    """The engine's answers to ``Effects.submit``, one per submission made (the rest were not made), each
    naming the submission it answers."""

    now: float
    results: tuple[SubmitResult, ...]


Event = Arrived | PollDue | DrainDue | Polled | Submitted


# Effects ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Submission:
    """Requests to start as one batch, at these attempts. ``stop_if_short``: if the engine does not take all of
    them, make no further submission of this step (queued batches are admitted in order)."""

    requests: tuple[str, ...]
    attempts: tuple[int, ...]
    stop_if_short: bool


@dataclass(frozen=True)
class SubmitResult:
    """The engine's answer to one submission: the call's outcome and, when answered, a stream key or None (no
    room) per request, in the submission's order."""

    submission: Submission
    outcome: Call
    streams: tuple[str | None, ...] = ()

    @classmethod
    def of(cls, submission: Submission, outcome: Call, streams: Sequence[str | None]) -> SubmitResult:
        """The result of a runtime's submit call: its streams count only when it answered."""
        return cls(submission, outcome, tuple(streams) if outcome is Call.ANSWERED else ())

    @property
    def taken_whole(self) -> bool:
        return self.outcome is Call.ANSWERED and None not in self.streams


@dataclass(frozen=True)
class Report:
    """For the worker's admission ledger: how many requests the key holds waiting, and which arrived."""

    waiting: int
    arrived: tuple[str, ...] = ()


@dataclass(frozen=True)
class Effects:
    """What the caller carries out after a step, in this order: hold leases, emit ``outputs``, cancel streams,
    send the report, set or clear the poll timer; then, if asked, poll (after ``poll_after_s``) or submit and
    step the answer."""

    outputs: tuple[Output, ...] = ()
    hold_leases_s: float | None = None
    cancel: tuple[str, ...] = ()
    report: Report | None = None
    arm_at: float | None = None  # set the poll timer to fire then
    disarm: bool = False  # clear the poll timer
    poll: Mapping[str, int] | None = None  # ask the engine for these streams from these positions
    poll_after_s: float = 0.0
    submit: tuple[Submission, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)
    logs: tuple[tuple[int, str], ...] = ()  # (logging level, message): never a prompt's text
