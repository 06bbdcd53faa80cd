"""How a step's harness threads call the worker's runtime: one call policy, for every step that calls it.

A call is answered, or the runtime's host cannot be reached (its process died: the runtime is acquired anew in
the background, :func:`~pipeline.worker.runtime.reconnect`, so no thread waits for a rebuild), or the engine
raised. :class:`RuntimeClient` turns each call into one of those (:class:`~pipeline.contract.call_outcome.Call`)
and never raises: Dataflow retries a callback that raised for ever, which would wedge its key. What each outcome
means is the caller's to decide (the key machine, :mod:`pipeline.generation.key_machine`; admission,
:mod:`pipeline.flow.admission`). Failures are logged and counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from apache_beam.metrics import Metrics

from pipeline.contract.call_outcome import Call
from pipeline.contract.stream_progress import Output
from pipeline.worker.runtime import RuntimeSource, WorkerRuntime, client_id, process_record, reconnect

LOGGER = logging.getLogger(__name__)
# How many keys' waiting reports a process remembers (ProcessRecord.reported_waiting) before it starts afresh.
_MAX_REPORTS_REMEMBERED = 100_000
# A waiting count that has not changed is reported again after this long (reports lapse, admission_ledger).
_REPORT_AGAIN_S = 1.0


class RuntimeClient:
    """A step's calls to its worker's runtime (``namespace``: the step's metrics namespace)."""

    def __init__(self, source: RuntimeSource, namespace: str) -> None:
        self._source = source
        self._record = process_record(source.tag)
        self._client = client_id()  # the streams it polls run on this process's lease clocks
        self._failures = Metrics.counter(namespace, "engine_call_failures")
        self._unreachable = Metrics.counter(namespace, "runtime_unreachable")

    def call(self, what: str, call: Callable[[WorkerRuntime], Any]) -> tuple[Call, Any]:
        """``(ANSWERED, call(runtime))``, ``(UNREACHABLE, None)`` or ``(FAILED, None)``."""
        try:
            return Call.ANSWERED, call(self._source.acquire())
        except (ConnectionError, EOFError) as exc:
            self._unreachable.inc()
            if reconnect(self._source):
                LOGGER.warning("The worker's runtime is unreachable (%s); acquiring it anew in the background", exc)
            return Call.UNREACHABLE, None
        except Exception:
            LOGGER.exception("The worker's engine failed to %s", what)
            self._failures.inc()
            return Call.FAILED, None

    def poll(self, asked: dict[str, int]) -> tuple[Call, dict[str, list[Output]]]:
        outcome, answers = self.call("poll", lambda runtime: runtime.poll(asked, self._client))
        return outcome, answers or {}

    def submit(self, requests: Sequence[str], attempts: Sequence[int]) -> tuple[Call, tuple[str | None, ...]]:
        """One batch submitted: the outcome and, when answered, a stream key or None (no room) per request."""
        outcome, keys = self.call("submit", lambda runtime: runtime.submit_batch(
            list(requests), list(attempts), self._client))
        return outcome, tuple(keys) if outcome is Call.ANSWERED else ()

    def cancel(self, streams: Sequence[str]) -> None:
        self.call("cancel", lambda runtime: runtime.cancel(list(streams)))

    def hold_leases(self, for_s: float) -> None:
        self.call("hold leases", lambda runtime: runtime.hold_leases(for_s))

    def report_waiting(self, holder: str, count: int, arrived: Sequence[str] = ()) -> None:
        """Tells the admission ledger how many requests ``holder`` (a key) holds waiting, and which requests
        reached it. A count is sent when it changes or its last report is a second old; arrivals always. Advisory:
        a report that fails lapses (the next poll reconnects)."""
        reported, now = self._record.reported_waiting, time.monotonic()  # per process: an instance may be per bundle
        last = reported.get(holder)
        if not arrived and last is not None and last[0] == count and now - last[1] < _REPORT_AGAIN_S:
            return
        if self.call("report", lambda runtime: runtime.report_waiting(holder, count, list(arrived)))[0] \
                is not Call.ANSWERED:
            return
        with self._record.lock:
            if len(reported) > _MAX_REPORTS_REMEMBERED:
                reported.clear()  # only costs a repeated report per key
            reported[holder] = (count, now)
