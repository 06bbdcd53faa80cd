"""The worker's load as Beam gauges: what a Dataflow job's monitoring shows of each worker's hold.

Namespace :data:`LOAD_NAMESPACE`, set at most once a second per process and
step: ``held_requests`` and ``max_held_requests`` (the worker's hold and its
bound, :mod:`pipeline.engines.worker_hold`), ``in_flight_requests``,
``waiting_requests``, ``server_running_requests`` and
``server_waiting_requests`` (vLLM's own ``/metrics``). The admission step and
the generate step both report them.
"""

from __future__ import annotations

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


class LoadGauges:
    """The worker's load as Beam gauges, refreshed by a step at most every :data:`GAUGE_INTERVAL_S` per process.

    The interval is kept per process and step, not per instance: a runner may build a DoFn
    instance per bundle (the DirectRunner does), and a step polls many times a second.
    """

    def __init__(self, step: str) -> None:
        self._step = step
        self._gauges = {key: Metrics.gauge(LOAD_NAMESPACE, name) for key, name in _GAUGES.items()}

    def update(self, engine: EngineBase) -> None:
        now = time.monotonic()
        if now - _UPDATED_AT.get(self._step, float("-inf")) < GAUGE_INTERVAL_S:
            return
        _UPDATED_AT[self._step] = now
        try:
            load = engine.load()
        except (ConnectionError, EOFError):
            return  # the engine is being reconnected; the next update reports
        for key, gauge in self._gauges.items():
            if load.get(key) is not None:
                gauge.set(int(load[key]))
