"""Admission: a worker takes from the subscription only what it can hold, so a backlog waits in Pub/Sub.

Dataflow's Pub/Sub source acknowledges a message once the first fused stage
that read it has committed ("Streaming with Pub/Sub": "once they have been
successfully processed by the first fused stage"). Every step up to the
batcher's shuffle is that stage, and :class:`AdmitRequests` is its last step.
It asks the worker's admission ledger for room (:meth:`~pipeline.worker.admission_ledger.AdmissionLedger.admit`:
what the worker holds is its unfinished streams, the requests its generate
step reports waiting in state, and those admitted and not yet arrived there,
counted by id: :mod:`pipeline.worker.hold`). While the worker holds
``max_in_flight + worker_queue`` requests, the step waits: its bundle does not commit, its messages stay unacknowledged,
and the rest of the backlog is never pulled. Pub/Sub keeps it durably, at no
cost to the job, and counts it as the subscription's backlog, which is what
Dataflow's autoscaler reads ("Horizontal Autoscaling"); in keyed state it
would be invisible to it.

What waiting costs, and its bounds: one harness thread per waiting bundle
(Beam's ``AsyncWrapper`` holds ``process`` the same way when its buffer is
full); its bundle stays open for as long as the worker is full, each request
in flight frees room when it finishes or reaches ``request_timeout_s``. Room
is counted from the engine, which frees it on its own threads. A worker runs
``number_of_worker_harness_threads`` work items at once (the launch sets it,
:mod:`pipeline.config.launch_checks`), read bundles and the generate step's
poll timers alike, and the timers, which collect what finished and submit what
waits, need those threads to free room. So at most half of them wait here
(``admission_waiters``, places held in the ledger,
:meth:`~pipeline.worker.admission_ledger.AdmissionLedger.wait_place`).

A read bundle that finds every waiting place taken is **refused**: after one
short pause (``REFUSAL_PAUSE_S``) it gives back what it admitted
(:meth:`~pipeline.worker.admission_ledger.AdmissionLedger.withdraw`) and
raises :class:`WorkerFull`. Dataflow does not document how it schedules read
work items, and the worst case is a read bundle whenever a thread is free; the
Pub/Sub source offers a step no way to hand messages back but failing the
work item ("Common error guidance": "Dataflow processes elements in arbitrary
bundles and retries the complete bundle when an error is thrown ... a bundle
including a failing item is retried indefinitely";
https://cloud.google.com/dataflow/docs/guides/common-errors). A refused bundle's
messages are not acknowledged, so they stay in the subscription's backlog. The
other two choices leak: a bundle that waited without a place could take every
thread from the timers, and one let through over the bound (this step's
earlier design) moves the whole backlog into keyed state at read speed, where
the autoscaler cannot see it. What refusing costs: each refusal is a failed
work item, which Dataflow logs as an error with its stack trace and retries
(Beam's streaming worker retries a failed work item after 10 s at the end of
its queue, ``WorkFailureProcessor``; how the runner of Python jobs waits is
not documented), and the retry reads the same messages again. Refusals happen
only while the worker is full and half its threads wait, that is during a
sustained backlog, when the autoscaler is adding workers; they are counted
(``pushback_refused``) and at most one a second per thread.

The bound then holds with one slack: a worker held by open read bundles alone
(only their finishing frees room) lets one of them, the lead, take one request
more at a time until it finishes, and the others wait
(:meth:`~pipeline.worker.hold.WorkerHold.room`). So a worker holds at most the
bound plus one read bundle less one request, and only after it held nothing
but open bundles. That assumes its keys take in what was admitted within
``admission_transit_s``, after which a request on its way stops counting (it
may have gone to another worker): a worker whose threads are kept from its keys
longer takes more (the worker simulator, ``tests/vm_sim.py``, finds it with few
threads). The bound holds per worker: Dataflow spreads keys and source splits
evenly, so each worker's hold reflects its share; a skewed spread can hold more
on one worker than the bound.

While the runtime's host is acquired anew (its process died: a model server's start, minutes), a read bundle
waits for the new runtime rather than fail, whatever places are taken: until the runtime is back no timer can
do anything either, so the threads it holds are not taken from work. What the bundle passed on before the death
was counted in the lost ledger; the new one counts it again before it is asked anything else. A host that does
not answer (paused or hung, :func:`~pipeline.worker.runtime_client.call_within`) is waited for the same way, a
call bound at a time, without a reconnect: every call this step makes is safe to repeat.

On the DirectRunner every step runs on one thread, so a step that waited would stop the timers that free
room; the local runner admits in its source instead, through this same ledger, before this step runs
(``local/direct_runner.py``), and this step finds its requests admitted already.

The step reports the worker's load (:mod:`pipeline.worker.load`), and counts
its waits in the same namespace: ``pushback_waits`` (read bundles that waited for room, or for the runtime
while it was acquired anew after its host died), ``pushback_ms``, ``pushback_refused`` (read bundles
refused because every waiting place was taken) and ``runtime_silent`` (calls the runtime did not answer in time).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Iterator

import apache_beam as beam
from apache_beam.metrics import Metrics

from pipeline.contract.messages import InferenceRequest
from pipeline.worker.load import LOAD_NAMESPACE, LoadGauges
from pipeline.worker.runtime import RuntimeSource, SharedRuntime, WorkerRuntime, process_record, reconnect
from pipeline.worker.runtime_client import RuntimeSilent, call_within

LOGGER = logging.getLogger(__name__)

# How often a waiting step says so in the log.
PUSHBACK_LOG_INTERVAL_S = 60.0
_MAX_BACKOFF_S = 0.5
# How long a read bundle that finds no waiting place holds its thread before it is refused: the runner may retry
# a failed work item at once, and this bounds the refusals to one a second per thread.
REFUSAL_PAUSE_S = 1.0
# How often a read bundle that waits for the runtime to be acquired anew asks whether it is back.
RECONNECT_WAIT_S = 1.0


class WorkerFull(RuntimeError):
    """A read bundle refused: the worker holds its bound and every waiting place is taken. Raised on purpose: the
    runner fails the work item and retries it, and until then its messages stay unacknowledged in the subscription
    (see the module docstring). Not a fault in the data."""


class AdmitFn(beam.DoFn):
    """The admission step's DoFn (see the module docstring); ``runtime`` says how it reaches its worker's runtime."""

    def __init__(self, runtime: RuntimeSource) -> None:
        self._source = runtime
        self._settings = runtime.settings
        self._gauges = LoadGauges("admit")
        self.waits = Metrics.counter(LOAD_NAMESPACE, "pushback_waits")
        self.waited_ms = Metrics.counter(LOAD_NAMESPACE, "pushback_ms")
        self.refused = Metrics.counter(LOAD_NAMESPACE, "pushback_refused")
        self.silent = Metrics.counter(LOAD_NAMESPACE, "runtime_silent")

    def setup(self) -> None:
        self._source.acquire()
        self._record = process_record(self._source.tag)

    def start_bundle(self) -> None:
        self._bundle_ids: list[str] = []
        self._bundle = uuid.uuid4().hex  # names this bundle to the ledger: its admissions and waiting place
        self._waited = False

    def process(self, request: InferenceRequest) -> Iterator[InferenceRequest]:
        if not self._admit(request.id):
            self._wait_for_room(request.id)
        self._bundle_ids.append(request.id)
        self._gauges.update(self._source, self._record)
        yield request

    def finish_bundle(self) -> None:
        # It may go to another worker's generate step, so from here on it counts for admission_transit_s
        # unless this worker's says it arrived.
        if self._bundle_ids:
            self._call(lambda runtime: runtime.dispatched(self._bundle_ids))
        if self._waited:
            self._call(lambda runtime: runtime.leave_place(self._bundle))
        self._bundle_ids, self._waited = [], False

    def _admit(self, request_id: str) -> bool:
        return bool(self._call(lambda runtime: runtime.admit([request_id], bundle=self._bundle)))

    def _call(self, call: Callable[[WorkerRuntime], int | bool | None]) -> int | bool | None:
        """``call(runtime)``. While the runtime's host is gone (acquired anew in the background) the worker cannot
        count what it holds, so the bundle waits for the new runtime, its messages unacknowledged, rather than
        fail: a failed work item is an error in the job's log and is read again at once, for as long as the rebuild
        (a model server's start) takes. The requests it passed on were counted in the lost ledger: the new one
        counts them again before anything else is asked of it. A host that does not answer within the call bound
        is asked again a second later, as it is: its ledger still holds what this bundle admitted."""
        lost = False
        while True:
            try:
                if lost and self._bundle_ids:  # admitted in place of themselves: counted whatever the room
                    call_within(self._source, lambda runtime: runtime.admit(
                        self._bundle_ids, in_place_of=self._bundle_ids, bundle=self._bundle))
                return call_within(self._source, call)
            except RuntimeSilent:  # alive, perhaps: no reconnect; every call here is safe to repeat
                self.silent.inc()
                self._log_wait("The worker's runtime does not answer: read bundles wait for it, and the rest of the "
                               "subscription stays unacknowledged")
                time.sleep(RECONNECT_WAIT_S)
            except (ConnectionError, EOFError) as exc:
                if reconnect(self._source):
                    LOGGER.warning("The worker's runtime is unreachable (%s); acquiring it anew in the background",
                                   exc)
                if not lost:
                    lost = True
                    self.waits.inc()
                self._log_wait("The worker's runtime is being acquired anew: read bundles wait for it, and the "
                               "rest of the subscription stays unacknowledged")
                time.sleep(RECONNECT_WAIT_S)

    def _wait_for_room(self, request_id: str) -> None:
        """Holds this bundle (its messages unacknowledged) until the worker has room for one more request, if it
        gets one of the worker's waiting places; otherwise, after one short pause, refuses the bundle."""
        started = time.monotonic()
        backoff = 0.01
        self.waits.inc()
        try:
            while self._call(lambda runtime: runtime.wait_place(self._bundle)):  # taken, or renewed each round
                self._waited = True
                time.sleep(backoff)
                if self._admit(request_id):
                    return
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                self._gauges.update(self._source, self._record)
                self._log_wait("Worker full (%d requests held, worker_queue=%d beyond max_in_flight=%d): the rest "
                               "of the subscription stays unacknowledged until a request finishes",
                               self._settings.max_held, self._settings.worker_queue, self._settings.max_in_flight)
            time.sleep(REFUSAL_PAUSE_S)
            if not self._admit(request_id):
                self._refuse()
        finally:
            self.waited_ms.inc(int((time.monotonic() - started) * 1000))

    def _refuse(self) -> None:
        """Gives back what this bundle admitted (its messages return to the subscription) and fails it."""
        self.refused.inc()
        self._call(lambda runtime: runtime.withdraw(self._bundle_ids))
        if self._waited:
            self._call(lambda runtime: runtime.leave_place(self._bundle))
        self._log_wait("Worker full and %d read bundles already wait for room (half of its harness threads, the "
                       "rest kept for the timers): read bundles are refused and stay in the subscription",
                       self._settings.admission_waiters)
        raise WorkerFull(f"worker full ({self._settings.max_held} requests held) and all "
                         f"{self._settings.admission_waiters} waiting places taken: this read bundle is refused, "
                         "its messages stay unacknowledged in Pub/Sub and are read again")

    def _log_wait(self, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._record.lock:
            if now - self._record.wait_logged_at < PUSHBACK_LOG_INTERVAL_S:
                return
            self._record.wait_logged_at = now
        LOGGER.info(message, *args)


class AdmitRequests(beam.PTransform):
    """Requests in, the same requests out, as fast as the worker has room for them.

    Put it last before the first shuffle (the batcher), so that what it holds
    back is unacknowledged in Pub/Sub.
    """

    def __init__(self, runtime: SharedRuntime) -> None:
        super().__init__()
        self._runtime = runtime

    def expand(self, requests):
        return requests | "Admit" >> beam.ParDo(AdmitFn(self._runtime))
