"""How a step's harness threads call the worker's runtime: one call policy, for every step that calls it.

A call is answered, or the runtime's host cannot be reached (its process died: the runtime is acquired anew in
the background, :func:`~pipeline.worker.runtime.reconnect`, so no thread waits for a rebuild), or the engine
raised. :class:`RuntimeClient` turns each call into one of those (:class:`~pipeline.contract.call_outcome.Call`)
and never raises: Dataflow retries a callback that raised for ever, which would wedge its key. What each outcome
means is the caller's to decide (the key machine, :mod:`pipeline.generation.key_machine`; admission,
:mod:`pipeline.flow.admission`). Failures are logged and counted.

Every call is bounded in time (:func:`call_within`). The runtime lives in one process of the VM, and a proxy call
to it has no timeout of its own: a host that is paused (a long garbage collection, memory pressure, SIGSTOP) or
hung would hold every harness thread that calls it, in every SDK process, and no ``ConnectionError`` would come to
start a recovery. So a call runs on one of a few threads this process keeps for the runtime, and the harness
thread waits for it at most its ``CallSettings.bound_s``: past that the host counts as unreachable for now (a
key's timer fires again; a read pulls nothing and asks again), without a reconnect, since the host may well be
alive. The call may still be carried out later; every call a step makes is safe to repeat (a submission of the
same request and attempt joins its stream, an admission of a held id takes no room), so an unknown outcome loses
nothing. A
call that has not started by then (every call thread waits on the host) is withdrawn and never runs late.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from apache_beam.metrics.metric import Metrics

from pipeline.contract.call_outcome import Call
from pipeline.contract.stream_progress import Output
from pipeline.worker.runtime import (
    RuntimeSource,
    WorkerRuntime,
    client_id,
    process_record,
    reconnect,
    runtime_generation,
)
from pipeline.worker.runtime_settings import CallSettings

LOGGER = logging.getLogger(__name__)
# How many keys' waiting reports a process remembers (ProcessRecord.reported_waiting) before it starts afresh.
_MAX_REPORTS_REMEMBERED = 100_000
# A waiting count that has not changed is reported again after this long (reports lapse, admission_ledger).
_REPORT_AGAIN_S = 1.0
# How often a process says in the log that its runtime does not answer.
_SILENT_LOG_INTERVAL_S = 60.0
_T = TypeVar("_T")


class RuntimeSilent(TimeoutError):
    """The runtime's host did not answer a call within ``CallSettings.bound_s``: paused, hung or overloaded. What the
    call did is unknown (it may still be carried out), so the caller treats the host as unreachable for now."""


# Per process: the threads that carry calls to each runtime, by tag.
_CALLERS: dict[str, ThreadPoolExecutor] = {}
# While a call to a runtime is unanswered past the bound, its host is silent: a further call fails at once instead
# of waiting out the bound again, so a work item that makes several calls waits for the bound once.
# Per process: those calls, by tag, until they end.
_UNANSWERED: dict[str, set[Future[Any]]] = {}
# Per process: when it last logged that a runtime did not answer, by tag.
_SILENT_LOGGED: dict[str, float] = {}
_CALLERS_LOCK = threading.Lock()


def call_within(source: RuntimeSource, call: Callable[[WorkerRuntime], _T]) -> _T:
    """``call(runtime)`` on one of this process's call threads, waited for at most its call settings'
    ``bound_s``; raises what the call raised, or :class:`RuntimeSilent` (at once while an earlier
    call to the same runtime is still unanswered past the bound)."""
    bound_s, tag = source.settings.calls.bound_s, source.tag
    with _CALLERS_LOCK:
        if _UNANSWERED.get(tag):
            raise RuntimeSilent(f"the worker's runtime has not answered a call for over {bound_s:g} s")
        pool = _CALLERS.get(tag)
        if pool is None:
            pool = _CALLERS[tag] = ThreadPoolExecutor(call_threads(source.settings.calls),
                                                      thread_name_prefix="runtime-call")
    future = pool.submit(lambda: call(source.acquire()))
    try:
        return future.result(timeout=bound_s)
    except FutureTimeout:
        pass
    if future.cancel():  # never started: every call thread waits on the host; it will not run late
        raise RuntimeSilent(f"no call thread free for the worker's runtime within {bound_s:g} s")
    now = time.monotonic()
    with _CALLERS_LOCK:
        _UNANSWERED.setdefault(tag, set()).add(future)
        quiet = now - _SILENT_LOGGED.get(tag, float("-inf")) < _SILENT_LOG_INTERVAL_S
        if not quiet:
            _SILENT_LOGGED[tag] = now
    future.add_done_callback(lambda done: _answered(tag, done))
    if not quiet:
        LOGGER.warning("The worker's runtime did not answer a call within %g s: its host is paused, hung or "
                       "overloaded; calls count as unreachable until it answers", bound_s)
    raise RuntimeSilent(f"no answer from the worker's runtime within {bound_s:g} s")


def call_threads(calls: CallSettings) -> int:
    """How many threads a process keeps for its calls to the runtime: one for each of its harness threads (each
    waits for one call at a time) and two to spare, so a call waits for a thread only while earlier calls are
    stuck on a silent host."""
    return calls.harness_threads + 2


def _answered(tag: str, future: Future[Any]) -> None:
    with _CALLERS_LOCK:
        _UNANSWERED.get(tag, set()).discard(future)


# The heartbeat's counters: its thread runs outside every bundle, where Beam keeps no metric; the log says what
# failed, and the steps' own calls count the same host.
HEARTBEAT_NAMESPACE = "worker_heartbeat"
# Per process: the runtimes it sends its heartbeat to, by tag.
_HEARTBEATS: dict[str, threading.Thread] = {}


def start_heartbeat(source: RuntimeSource) -> None:
    """Tells ``source``'s runtime that this process is alive, several times a lease, for the life of the process:
    a process that pauses stops, and the runtime keeps its streams (:mod:`pipeline.engines.leases`)."""
    interval_s = min(max(source.settings.engine.stream_lease_s / 8, 0.025), 0.5)

    def beat() -> None:
        # The one policy, bounded by the call bound; an engine that raised is logged once a minute. A host found
        # gone is left to the steps' next call to rebuild: the beat outlives the pipeline that started it, and an
        # ended pipeline's beat must not start a runtime (a model server) that nothing will use.
        client = RuntimeClient(source, HEARTBEAT_NAMESPACE, reconnects=False, failures_logged_every_s=60.0)
        while True:
            client.heartbeat()
            time.sleep(interval_s)

    with _CALLERS_LOCK:
        if source.tag not in _HEARTBEATS:
            _HEARTBEATS[source.tag] = threading.Thread(target=beat, name=f"heartbeat-{source.tag}", daemon=True)
            _HEARTBEATS[source.tag].start()


class RuntimeClient:
    """A step's calls to its worker's runtime (``namespace``: the step's metrics namespace); ``reconnects``: a host
    found gone is acquired anew; a call the engine failed is logged at most once per ``failures_logged_every_s``."""

    def __init__(self, source: RuntimeSource, namespace: str, *, reconnects: bool = True,
                 failures_logged_every_s: float = 0.0) -> None:
        self._source = source
        self._reconnects, self._log_every_s = reconnects, failures_logged_every_s
        self._failure_logged_at = float("-inf")
        self._record = process_record(source.tag)
        self._client = client_id()  # the streams it polls run on this process's lease clocks
        self._failures = Metrics.counter(namespace, "engine_call_failures")
        self._unreachable = Metrics.counter(namespace, "runtime_unreachable")
        self._silent = Metrics.counter(namespace, "runtime_silent")

    def call(self, what: str, call: Callable[[WorkerRuntime], _T]) -> tuple[Call, _T | None]:
        """``(ANSWERED, call(runtime))``, ``(UNREACHABLE, None)`` or ``(FAILED, None)``, within the call bound."""
        generation = runtime_generation(self._source.tag)  # before the call takes its handle
        try:
            return Call.ANSWERED, call_within(self._source, call)
        except RuntimeSilent:
            self._silent.inc()
            return Call.UNREACHABLE, None
        except (ConnectionError, EOFError) as exc:
            self._unreachable.inc()
            if self._reconnects:
                reconnect(self._source, exc, seen=generation)
            return Call.UNREACHABLE, None
        except Exception:
            now = time.monotonic()
            if now - self._failure_logged_at >= self._log_every_s:
                self._failure_logged_at = now
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
        return outcome, tuple(keys) if keys is not None else ()

    def heartbeat(self) -> None:
        """Says this process is alive, to keep its streams' leases (:func:`start_heartbeat`)."""
        self.call("hear the heartbeat", lambda runtime: runtime.heartbeat(self._client))

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
