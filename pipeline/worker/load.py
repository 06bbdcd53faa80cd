"""The worker's load as Beam gauges: what a Dataflow job's monitoring shows of each worker's hold.

Namespace :data:`LOAD_NAMESPACE`, set at most once a second per process and
step: ``held_requests`` and ``max_held_requests`` (the worker's hold and its
bound, :mod:`pipeline.worker.hold`), ``in_flight_requests``,
``waiting_requests``, ``server_running_requests`` and
``server_waiting_requests`` (vLLM's own ``/metrics``), ``bulk_cap``, ``bulk_prompt_budget``,
``live_first_token_p95_ms`` and ``live_inter_token_p95_ms`` (how many bulk streams the lane may run and bulk
prompt tokens start a second, and the live latencies it follows: :mod:`pipeline.engines.lane_governor`),
``model_busy_ms`` (how
long the model has had a request running, so far: its busy share of the
worker's time), ``chunks_published`` and ``chunks_unconfirmed`` (by the engine,
to the chunk topic), and with ``engine=transformers`` the token positions its
batches computed and how many were padding (``batch_requests``,
``prompt_positions``, ``prompt_padding``, ``decode_positions``,
``decode_padding``). The admission step and the generate step both report them.

Beside them, the counters ``server_restarts`` (how many times the worker's
model server was restarted) and the bulk lane's governor's
(:data:`pipeline.engines.lane_governor.TOTALS`): totals the runtime keeps, which has no Beam context to count
in, counted once per VM whichever step of whichever SDK process takes them
(``WorkerRuntime.load_and_counts``). Cloud Monitoring charts counters, not gauges
(docs/operations.md).
"""

from __future__ import annotations

import time

from apache_beam.metrics.metric import Metrics

from pipeline.contract.call_outcome import Call
from pipeline.engines.lane_governor import TOTALS
from pipeline.worker.runtime import ProcessRecord
from pipeline.worker.runtime_client import RuntimeClient

LOAD_NAMESPACE = "worker_load"
_GAUGES = {"held": "held_requests", "max_held": "max_held_requests", "in_flight": "in_flight_requests",
           "waiting": "waiting_requests", "server_running": "server_running_requests",
           "server_waiting": "server_waiting_requests", "busy_ms": "model_busy_ms",
           "chunks_published": "chunks_published", "chunks_unconfirmed": "chunks_unconfirmed",
           **{name: name for name in ("bulk_cap", "bulk_prompt_budget", "live_first_token_p95_ms",
                                      "live_inter_token_p95_ms")},
           **{name: name for name in ("batch_requests", "prompt_positions", "prompt_padding", "decode_positions",
                                      "decode_padding")}}
# Totals the engine keeps (its runtime has no Beam context) are counted here as Beam counters of the same name,
# by what each grew since any step of the VM last took them (WorkerRuntime.load_and_counts): once per VM.
GAUGE_INTERVAL_S = 1.0


class LoadGauges:
    """The worker's load as Beam gauges, refreshed by a step at most every :data:`GAUGE_INTERVAL_S` per process.

    The interval is kept per process and step (in the runtime's :class:`~pipeline.worker.runtime.ProcessRecord`),
    not per instance: a runner may build a DoFn instance per bundle (the DirectRunner does), and a step polls many
    times a second.
    """

    def __init__(self, step: str) -> None:
        self._step = step
        self._gauges = {key: Metrics.gauge(LOAD_NAMESPACE, name) for key, name in _GAUGES.items()}
        self._counters = {  # each by its name, as the dashboard queries them
            "server_restarts": Metrics.counter(LOAD_NAMESPACE, "server_restarts"),
            **{name: Metrics.counter(LOAD_NAMESPACE, name) for name in TOTALS}}

    def update(self, client: RuntimeClient, record: ProcessRecord) -> None:
        """Through the step's own client, the one call policy: bounded, a lost host reconnected, an engine that
        raised logged and counted; gauges are advisory, so any outcome but an answer leaves them as they were."""
        now = time.monotonic()
        with record.lock:
            if now - record.gauges_at.get(self._step, float("-inf")) < GAUGE_INTERVAL_S:
                return
            record.gauges_at[self._step] = now
        outcome, answer = client.call("read the load", lambda runtime: runtime.load_and_counts())
        if outcome is not Call.ANSWERED or answer is None:
            return
        load, grown = answer
        for name, more in grown.items():
            if more and name in self._counters:
                self._counters[name].inc(more)
        for key, gauge in self._gauges.items():
            value = load.get(key)
            if value is not None:
                gauge.set(int(value))
