"""The worker's load as Beam gauges: what a Dataflow job's monitoring shows of each worker's hold.

Namespace :data:`LOAD_NAMESPACE`, set at most once a second per process and
step: ``held_requests`` and ``max_held_requests`` (the worker's hold and its
bound, :mod:`pipeline.worker.hold`), ``in_flight_requests``,
``waiting_requests``, ``server_running_requests`` and
``server_waiting_requests`` (vLLM's own ``/metrics``). The admission step and
the generate step both report them.

Beside them, the counter ``server_restarts``: how many times this process's
model server was restarted, counted once per process whichever step notices
(the server is restarted by its monitor thread, which has no Beam context to
count in). Cloud Monitoring charts counters, not gauges (docs/operations.md).
"""

from __future__ import annotations

import threading
import time

from apache_beam.metrics import Metrics

from pipeline.engines.engine import EngineBase

LOAD_NAMESPACE = "worker_load"
_GAUGES = {"held": "held_requests", "max_held": "max_held_requests", "in_flight": "in_flight_requests",
           "waiting": "waiting_requests", "server_running": "server_running_requests",
           "server_waiting": "server_waiting_requests"}
GAUGE_INTERVAL_S = 1.0
# Per step, when this process last refreshed the load gauges.
_UPDATED_AT: dict[str, float] = {}
# The server restarts this process has counted so far, whichever step counted them.
_RESTARTS_COUNTED = [0]
_RESTARTS_LOCK = threading.Lock()


class LoadGauges:
    """The worker's load as Beam gauges, refreshed by a step at most every :data:`GAUGE_INTERVAL_S` per process.

    The interval is kept per process and step, not per instance: a runner may build a DoFn
    instance per bundle (the DirectRunner does), and a step polls many times a second.
    """

    def __init__(self, step: str) -> None:
        self._step = step
        self._gauges = {key: Metrics.gauge(LOAD_NAMESPACE, name) for key, name in _GAUGES.items()}
        self._restarts = Metrics.counter(LOAD_NAMESPACE, "server_restarts")

    def update(self, engine: EngineBase) -> None:
        now = time.monotonic()
        if now - _UPDATED_AT.get(self._step, float("-inf")) < GAUGE_INTERVAL_S:
            return
        _UPDATED_AT[self._step] = now
        try:
            load = engine.load()
            restarts = engine.server_restarts()
        except (ConnectionError, EOFError):
            return  # the engine is being reconnected; the next update reports
        with _RESTARTS_LOCK:
            new = max(restarts - _RESTARTS_COUNTED[0], 0)
            _RESTARTS_COUNTED[0] += new
        if new:
            self._restarts.inc(new)
        for key, gauge in self._gauges.items():
            if load.get(key) is not None:
                gauge.set(int(load[key]))
