"""Admission: each parsed request takes the place its read took in the worker's hold, so the hold is counted by id.

The worker's reader pulls only what its worker has room for (:mod:`pipeline.flow.subscription_reader` on
Dataflow; the local runner's read, ``local/direct_runner.py``), taking a place-holder in the worker's admission
ledger for every message before it pulls (:mod:`pipeline.worker.read_places`). A message's request id is known
only once it is parsed, a few steps later in the same fused stage; :class:`AdmitRequests`, the last step before
the batcher's shuffle, admits each request in place of one of those place-holders
(:meth:`~pipeline.worker.admission_ledger.AdmissionLedger.admit` with ``in_place_of``), so from then on it
counts by its id: until the generate step reports it arrived, or, once its bundle ended, for
``AdmissionSettings.transit_s`` and on while this worker's keys are behind it (it may go to another worker;
:mod:`pipeline.worker.hold`). Each is admitted with the generate step's key it goes to
(:class:`GenerateKeys`), so the ledger learns which keys other workers host and counts what goes to them for
``transit_s`` only. A request whose place no longer counts (a
runtime rebuilt since its read, or a place that lapsed) is admitted only if there is room, and otherwise passes
on uncounted: it was read already, and holding it back would take a thread.

This step never waits and never fails a work item: the backlog is held back before it is pulled, where it
costs neither a harness thread nor a failure (docs/architecture.md, "Backpressure"). A runtime that cannot be
asked (its host died and is acquired anew, or it does not answer within the call bound: the one call policy
of :class:`~pipeline.worker.runtime_client.RuntimeClient`) leaves the request uncounted rather than hold the
thread: what it passes on then is at most what was read before, since no read takes more until the runtime
answers.

The step reports the worker's load (:mod:`pipeline.worker.load`) and counts ``admitted_uncounted`` (requests
passed on uncounted), beside the runtime client's counters in the same namespace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from pipeline.contract.call_outcome import Call
from pipeline.contract.keying import generate_key
from pipeline.contract.messages import InferenceRequest
from pipeline.flow.batching import BatchingConfig, batch_key
from pipeline.worker import read_places
from pipeline.worker.load import LOAD_NAMESPACE, LoadGauges
from pipeline.worker.runtime import RuntimeSource, SharedRuntime, process_record
from pipeline.worker.runtime_client import RuntimeClient

LOGGER = logging.getLogger(__name__)

# How often a step whose runtime cannot be asked says so in the log.
UNCOUNTED_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class GenerateKeys:
    """Which key of the generate step a request goes to: the batcher's, or its generate shard where that step
    re-keys. The ledger learns from it which keys another worker hosts (:mod:`pipeline.worker.hold`)."""

    batching: BatchingConfig
    generate_shards: int | None = None

    def of(self, request: InferenceRequest) -> str | None:
        if self.generate_shards:
            return f"generate shard {generate_key(request.id, self.generate_shards)}"
        try:
            return batch_key(self.batching, request)
        except Exception:  # the batcher dead-letters what it cannot key; here the key only goes untold
            return None


def admit_in_place(tag: str, request: InferenceRequest, key: str | None, place_open_s: float,
                   call: Callable[[Callable[[Any], Any]], tuple[Call, Any]]) -> bool:
    """Admits ``request`` in place of one of the places its read took (``tag``'s; one queued longer ago than
    ``place_open_s`` is a dead letter's, left by an earlier bundle), with its lane and the generate step's ``key``
    it goes to (None: untold), through ``call`` (the one call policy's, or a simulated worker's); whether the
    worker counted it. One step of the reader's round, shared by :class:`AdmitFn` and the VM simulator
    (``tests/vm_sim.py``), so that the simulator runs the admission that ships."""
    places = read_places.take(tag, 1, fresher_than_s=place_open_s)
    told = {request.id: key} if key is not None else None
    _, taken = call(lambda runtime: runtime.admit([request.id], in_place_of=places, bulk=request.bulk, keys=told))
    return bool(taken)


def end_admit_bundle(ids: list[str], call: Callable[[Callable[[Any], Any]], tuple[Call, Any]]) -> None:
    """The admission bundle's end, as :class:`AdmitFn` and the VM simulator both run it: the requests it admitted
    may go to another worker's generate step, so from here on each counts only as long as this worker's keys may
    still receive it (:mod:`pipeline.worker.hold`), unless they say it arrived. A runtime that cannot be asked
    leaves them to lapse as places do."""
    if ids:
        call(lambda runtime: runtime.dispatched(ids))


class AdmitFn(beam.DoFn):
    """The admission step's DoFn (see the module docstring); ``runtime`` says how it reaches its worker's runtime,
    ``keys`` which of the generate step's keys each request goes to (None: the ledger is not told)."""

    def __init__(self, runtime: RuntimeSource, keys: GenerateKeys | None = None) -> None:
        self._source = runtime
        self._keys = keys
        self._gauges = LoadGauges("admit")
        self.uncounted = Metrics.counter(LOAD_NAMESPACE, "admitted_uncounted")

    def setup(self) -> None:
        self._source.acquire()
        self._record = process_record(self._source.tag)
        self._runtime = RuntimeClient(self._source, LOAD_NAMESPACE)

    def start_bundle(self) -> None:
        self._bundle_ids: list[str] = []

    def process(self, request: InferenceRequest) -> Iterator[InferenceRequest]:
        # A place this bundle's round queued is taken however long parsing the round took; an older one is a dead
        # letter's (admit_in_place).
        key = self._keys.of(request) if self._keys else None
        if admit_in_place(self._source.tag, request, key, self._source.settings.admission.place_open_s,
                          lambda admit: self._runtime.call("admit", admit)):
            self._bundle_ids.append(request.id)
            self._gauges.update(self._runtime, self._record)
        else:
            self._uncounted()
        yield request

    def finish_bundle(self) -> None:
        ids, self._bundle_ids = self._bundle_ids, []
        end_admit_bundle(ids, lambda dispatch: self._runtime.call("dispatch", dispatch))

    def _uncounted(self) -> None:
        self.uncounted.inc()
        now = time.monotonic()
        with self._record.lock:
            if now - self._record.uncounted_logged_at < UNCOUNTED_LOG_INTERVAL_S:
                return
            self._record.uncounted_logged_at = now
        LOGGER.info("A read request passes on uncounted in its worker's hold: its read's place lapsed or the "
                    "runtime cannot be asked (counter admitted_uncounted)")


class AdmitRequests(beam.PTransform):
    """Requests in, the same requests out, each counted in its worker's hold in the place its read took.

    Put it last before the first shuffle (the batcher), in the reader's fused stage, so that it runs in the
    process that read the request.
    """

    def __init__(self, runtime: SharedRuntime, keys: GenerateKeys | None = None) -> None:
        super().__init__()
        self._runtime = runtime
        self._keys = keys

    def expand(self, requests):
        return requests | "Admit" >> beam.ParDo(AdmitFn(self._runtime, self._keys))
