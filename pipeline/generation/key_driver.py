"""The one loop that runs a key's work item: steps the key machine and carries out its effects against a port.

The machine (:mod:`pipeline.generation.key_machine`) only says what to do; :func:`drive` does it, in the order
:class:`~pipeline.generation.key_events.Effects` states, through a :class:`KeyPort`: the generate DoFn's port
reaches the worker's runtime, Beam's state and timers and the bundle's outputs; the worker simulator's
(``tests/worker_sim.py``) reaches simulated engines and time. Both call this function unchanged, so what the
simulator proves under its schedules is the effect code that ships (``tests/test_one_driver.py`` changes this
function and sees the DoFn on the transformers engine and the simulator both run the change;
``tests/test_runner_semantics.py`` drives the DoFn through it on the real vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from pipeline.contract.call_outcome import Call
from pipeline.contract.stream_progress import Output
from pipeline.generation.key_events import Event, Polled, Report, Rules, Submission, SubmitResult, Submitted
from pipeline.generation.key_machine import step
from pipeline.generation.key_state import KeyState


class KeyPort(Protocol):
    """What a key's work item reaches beyond the machine. Calls to the engine answer with an outcome (the one
    call policy's, :class:`~pipeline.contract.call_outcome.Call`), never raise for the runtime's absence."""

    def now(self) -> float:
        """The time the next event is stamped with (epoch seconds)."""

    def wait(self, seconds: float) -> None:
        """Lets ``seconds`` pass before the next call (a drain's pass between polls)."""

    def hold_leases(self, seconds: float) -> None:
        """Keeps every stream of the worker's engine from lapsing for ``seconds`` (a drain polls only its own)."""

    def count(self, counts: Mapping[str, int], logs: tuple[tuple[int, str], ...]) -> None: ...

    def emit(self, output: Output) -> None:
        """One output of the work item, committed with its state (or discarded with it)."""

    def cancel(self, streams: tuple[str, ...]) -> None: ...

    def report(self, report: Report) -> None:
        """For the worker's admission ledger: what the key holds waiting, and which requests reached it."""

    def set_timer(self, at: float | None) -> None:
        """Sets the key's poll timer to fire at ``at``; None clears it."""

    def poll(self, asked: Mapping[str, int]) -> tuple[Call, Mapping[str, list[Output]]]: ...

    def submit(self, submission: Submission) -> SubmitResult: ...


def submit_in_order(submissions: tuple[Submission, ...],
                    submit: Callable[[Submission], SubmitResult]) -> tuple[SubmitResult, ...]:
    """Carries out a step's submissions in order with ``submit``, stopping after one that was not taken whole
    when it says so: the results of those made, each naming its submission."""
    results: list[SubmitResult] = []
    for submission in submissions:
        result = submit(submission)
        results.append(result)
        if submission.stop_if_short and not result.taken_whole:
            break
    return tuple(results)


def drive(rules: Rules, state: KeyState, event: Event, port: KeyPort) -> KeyState:
    """Steps the key from ``event`` until it asks the engine nothing more, carrying out each step's effects in
    their order: hold leases, count, emit, cancel, report, set or clear the timer; then poll (after
    ``poll_after_s``) or submit, and step the answer. The state to commit."""
    while True:
        state, effects = step(rules, state, event)
        if effects.hold_leases_s is not None:
            port.hold_leases(effects.hold_leases_s)
        if effects.counts or effects.logs:
            port.count(effects.counts, effects.logs)
        for output in effects.outputs:
            port.emit(output)
        if effects.cancel:
            port.cancel(effects.cancel)
        if effects.report is not None:
            port.report(effects.report)
        if effects.disarm:
            port.set_timer(None)
        elif effects.arm_at is not None:
            port.set_timer(effects.arm_at)
        if effects.poll is not None:  # an answer is stamped with when it was asked for
            port.wait(effects.poll_after_s)
            asked_at = port.now()
            outcome, answers = port.poll(effects.poll)
            event = Polled(asked_at, outcome, answers)
        elif effects.submit:
            asked_at = port.now()
            event = Submitted(asked_at, submit_in_order(effects.submit, port.submit))
        else:
            return state
