"""What a worker's runtime is built from: the engine's settings, admission's and the call policy's, one record each.

A worker's runtime (:mod:`pipeline.worker.runtime`) is three parts, and each reads only its own record: the engine
reads :class:`~pipeline.engines.engine_settings.EngineSettings`, the admission ledger
(:mod:`pipeline.worker.admission_ledger`) reads :class:`AdmissionSettings`, and the runtime client
(:mod:`pipeline.worker.runtime_client`) reads :class:`CallSettings`. :class:`RuntimeSettings` holds the three
(frozen, picklable into every step that reaches the runtime) and derives the worker's bounds, the two facts that
need both the engine's and admission's values. Each record checks its own values as it is built, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.contract.parameter_checks import check_parameters
from pipeline.contract.parameters import DEFAULT_HARNESS_THREADS, default
from pipeline.engines.engine_settings import EngineSettings, left_by


@dataclass(frozen=True)
class AdmissionSettings:
    """How much a worker takes from its subscriptions beyond what its engine runs (:mod:`pipeline.flow.admission`)."""

    # Requests a worker holds beyond max_in_flight (waiting in state, or admitted and on their way)
    # before it takes no more from the subscription.
    worker_queue: int = default("worker_queue")
    # How long an admitted request counts, once its bundle finished, unless this worker's generate step
    # reports it first (the shuffle and the batcher's wait; it may go to another worker).
    transit_s: float = 2.0
    # The most it counts while this worker's keys are behind it (pipeline.worker.hold): a loaded shuffle's transit
    # is seconds; past this, a request not yet arrived more likely went to another worker.
    transit_cap_s: float = 30.0
    # How long a key's report of its waiting requests counts unless renewed (keys that wait poll every 2 s): a key
    # that moved to another worker, or stalled, stops holding this worker's room.
    report_lapse_s: float = 6.0
    # How long a read's place counts while its bundle is open, from when its reader last renewed it: a reader
    # renews the places it holds for a pull under way or for messages it has not handed on yet, so only a place
    # its reader lost (a bundle that failed, a call answered after its bound) lapses, and frees its room this soon.
    place_open_s: float = 60.0

    def __post_init__(self) -> None:
        check_parameters({"worker_queue": self.worker_queue})
        for name in ("transit_s", "transit_cap_s", "report_lapse_s", "place_open_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"an admission's {name} must be positive, got {getattr(self, name)} s")


@dataclass(frozen=True)
class CallSettings:
    """How a step's calls to its worker's runtime are carried (:mod:`pipeline.worker.runtime_client`)."""

    # How many work items a worker's process runs at once (number_of_worker_harness_threads): the client keeps a
    # call thread for each.
    harness_threads: int = DEFAULT_HARNESS_THREADS
    # How long a harness thread waits for one call before it counts the runtime's host as unreachable for now:
    # a paused or hung host holds no thread longer.
    bound_s: float = 5.0

    def __post_init__(self) -> None:
        check_parameters({"number_of_worker_harness_threads": self.harness_threads})
        if not self.bound_s > 0:
            raise ValueError(f"a runtime call's bound must be positive, got {self.bound_s} s")


@dataclass(frozen=True)
class RuntimeSettings:
    """One worker runtime's settings: its engine's, its admission ledger's and its callers'."""

    engine: EngineSettings
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    calls: CallSettings = field(default_factory=CallSettings)

    @property
    def max_held(self) -> int:
        """The most requests a worker holds (in flight, waiting, on their way) before it pushes back."""
        return self.engine.max_in_flight + self.admission.worker_queue

    @property
    def bulk_held(self) -> int:
        """The most a worker holds when a bulk read asks for room: what ``live_reserve`` leaves of ``max_held``."""
        return left_by(self.engine.live_reserve, self.max_held)
