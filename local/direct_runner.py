"""Local-only fixes for how the Python DirectRunner reads Pub/Sub and runs stateful DoFns.

1. It reads with a blocking ``pull(timeout=30)`` on the thread that also fires
   timers, so while input is idle our millisecond batch timers and chunk polls
   fire up to 30 s late, and ``cancel()`` takes as long. :func:`apply_local_runner_fixes`
   moves the pull to a background thread; the executor only takes what has
   arrived, without blocking. A read that finds nothing waits 2 ms (the
   thread's timers come first), or, while the worker holds no request and no
   read has a message waiting, until the next message arrives or 20 ms pass:
   an idle pipeline then takes a fraction of the CPU that re-reading every
   2 ms took.
2. It schedules its sources only in a cycle where no timer fired and nothing
   else runs, so while streams are active (their poll timers fire every few
   tens of milliseconds) new messages wait — seconds, under load. The sources
   are kept scheduled at least every ``read_interval_s``.
3. It re-inspects every stateful DoFn's method signatures for each bundle
   (measured: 40 % of its only thread while chunks stream). The inspection
   depends only on the DoFn's class, so it is cached per class.
4. Each Pub/Sub read leaves a new, empty "unprocessed" bundle in the read's
   set of pending bundles, and nothing ever removes it; every watermark
   refresh walks that set. Read every 20 ms, the set grew by 50 a second
   until, after about ten minutes, the refreshes took the whole thread and
   timers stopped firing (seen: a pipeline at 80 % CPU serving nothing). An
   empty bundle holds no element, so it cannot hold a watermark back: empty
   bundles are no longer added.

5. Each Pub/Sub read builds its evaluator anew, and the evaluator looks up the
   project by re-parsing every pipeline option (``view_as``: an argparse parser
   over every registered option class, the template's forty included). Measured
   with py-spy in a burst of 32: 39 % of the pipeline's busy CPU, on the cores the
   model needs. The subscription is resolved once per read transform.

6. Each bundle of a DoFn builds a new runner, which re-inspects the signature
   of every DoFn method (fix 3 caches only the state and timer specs). Measured
   with py-spy (samples holding the GIL) in bursts of 32 after fix 5: 13 % of the
   pipeline's CPU. A method the class itself defines has the same arguments for
   every instance, so those are inspected once per class.

7. Its read acknowledges every message it pulls, and the prefetch above pulled up
   to 500 ahead: a backlog left the subscription for the pipeline's memory
   within seconds. On Dataflow the job's own reader pulls only what the worker
   has room for (:mod:`pipeline.flow.subscription_reader`), a splittable DoFn
   this runner cannot run in streaming. So the read here does what that reader
   does, through the same places (:mod:`pipeline.worker.read_places`): it hands
   over only as many messages as the worker's admission ledger grants places for,
   and prefetches no more than the worker has room for. The admission step then
   admits each request in place of one of them, as on Dataflow. The places are
   taken on the worker's runtime as the pipeline's steps acquired it (recorded
   by wrapping ``acquire_runtime``).

8. It runs a stateful DoFn's bundles one at a time per step, every key's together,
   from a queue it serves last in, first out: while keys' poll timers keep firing,
   a bundle that waits (a request arriving at its key) is passed by every newer
   one. Seen in ``make bench-lanes``: live requests beside a saturated bulk lane
   took 20-110 s from parsing to the engine, the later ones first. On Dataflow
   keys run in parallel work items (docs/architecture.md). The queue is served in
   arrival order here, so a bundle waits at most for those queued before it, once
   fix 9 keeps each setting of a key's timer to one firing queued.

9. It fires a timer again at every cycle of its monitor (many a second) until the
   bundle of its first firing has run and committed the timer's clearing: the
   watermark manager extracts expired timers from the committed state without
   clearing them. While a stateful step's queue is short that is the duplicate
   firing a DoFn must tolerate; once the queue is longer than a cycle, each
   waiting firing adds more, and the queue grows without bound (traced in ``make
   bench-lanes`` beside a bulk lane of 48 streams: 16 keys, up to 277 bundles
   queued, about 180 a second run, live requests 6 to 10 s from their read to the
   engine). A timer is now fired once until its firing's bundle is done, as
   Dataflow fires one once per setting (again where a work item is retried).

All nine touch private DirectRunner internals (the seventh records the worker's
runtime from outside), so they live outside the worker
package (``pipeline/``) and are applied only by the local launcher,
``python -m local.direct_runner TEMPLATE_ARGS`` (what ``make smoke``, the tests
and the benchmarks run), never on Dataflow, which has none of these problems.
The launcher also gives a local vLLM its CPU settings' environment
(:mod:`local.cpu_server`) and keeps the pipeline's threads off the cores that
vLLM computes on (:mod:`local.core_placement`).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any

from apache_beam.runners.runner import PipelineResult

from pipeline.worker import read_places
from pipeline.worker.admission_ledger import BULK_QUEUED_MIN
from pipeline.worker.runtime import WorkerRuntime
from pipeline.worker.runtime_settings import RuntimeSettings

LOGGER = logging.getLogger(__name__)


# How long a read that found nothing waits: 2 ms while the worker holds requests (the executor's only thread fires
# their timers), up to 20 ms while it holds none, a wait that a message arriving for any read (live or bulk) ends.
BUSY_WAIT_S, IDLE_WAIT_S = 0.002, 0.02
_ARRIVED = threading.Event()
# How often the prefetch extends the ack deadline of what it holds, and to what: the bulk lane's prefetch waits for
# places at the lane's pace, which beside live traffic can pass a subscription's deadline (Pub/Sub's least is 10 s).
PREFETCH_RENEW_S, PREFETCH_ACK_DEADLINE_S = 5.0, 60


class _PrefetchingPullClient:
    """Wraps a SubscriberClient: a background thread pulls, ``pull`` returns what has arrived.

    The DirectRunner calls ``pull`` on its only executor thread; here it never
    blocks. The evaluator acks what ``pull`` returns, so ``pull`` returns only
    what the worker's admission grants (fix 7), and the prefetch queue holds no
    more than the worker has room for: the rest stays in the subscription.
    """

    def __init__(self, client: Any, max_messages: int, max_prefetched: int = 500) -> None:
        self._client = client
        self._max_messages = max_messages
        self._max_prefetched = max_prefetched
        self._queue: collections.deque[Any] = collections.deque()
        self._subscription: str | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.taken = 0  # messages handed to the pipeline (and so acknowledged)

    def close(self) -> None:
        """Stops the prefetch after its pull in progress (a pipeline's read keeps it for the process's life)."""
        self._closed.set()

    def _prefetch_target(self) -> int:
        """How many messages to hold ready: the worker's room (one before its engine is set up); for the bulk
        lane's subscription, at most its least wave (``BULK_QUEUED_MIN``): its places come at the lane's pace, a
        stream's answer at a time when live traffic holds it to one, and a message held here past the
        subscription's ack deadline comes again, a copy the job then reads and drops."""
        load = _source_load()
        if load is None:
            return 1
        room = min(max(load["max_held"] - load["held"] - load["on_the_way"], 1), self._max_prefetched)
        return min(room, BULK_QUEUED_MIN) if self._subscription in _BULK_SUBSCRIPTIONS else room

    def _prefetch(self) -> None:
        from google.api_core import exceptions

        renewed = time.monotonic()
        while not self._closed.is_set():  # a daemon thread: it ends with the process, or at close()
            if time.monotonic() - renewed >= PREFETCH_RENEW_S:
                with self._lock:
                    held = [message.ack_id for message in self._queue]
                self._renew(held)
                renewed = time.monotonic()
            want = min(self._prefetch_target(), self._max_messages) - len(self._queue)
            if want <= 0:
                self._closed.wait(0.01)
                continue
            try:
                response = self._client.pull(subscription=self._subscription, max_messages=want,
                                             timeout=5.0, retry=None)
            except (exceptions.DeadlineExceeded, exceptions.ServiceUnavailable):
                continue
            except Exception:  # the client was closed at shutdown, or the emulator went away
                LOGGER.debug("prefetching pull failed", exc_info=True)
                self._closed.wait(0.5)
                continue
            self._renew([message.ack_id for message in response.received_messages])  # from its arrival on
            self._queue.extend(response.received_messages)
            if response.received_messages:
                _ARRIVED.set()

    def _renew(self, ack_ids: list[str]) -> None:
        """Extends the ack deadline of what the prefetch holds, so Pub/Sub does not send it again meanwhile (one
        handed over since is acknowledged already: an extension of it does nothing)."""
        if not ack_ids:
            return
        try:
            self._client.modify_ack_deadline(subscription=self._subscription, ack_ids=ack_ids,
                                             ack_deadline_seconds=PREFETCH_ACK_DEADLINE_S, timeout=5.0, retry=None)
        except Exception:  # noqa: BLE001 - at worst a copy comes again, which the job drops
            LOGGER.debug("extending prefetched messages' ack deadline failed", exc_info=True)

    def pull(self, subscription: str, max_messages: int = 10, timeout: float | None = None) -> Any:
        from google.cloud.pubsub_v1 import types

        with self._lock:
            if self._subscription is None:
                self._subscription = subscription
                threading.Thread(target=self._prefetch, name="pubsub-prefetch", daemon=True).start()
        ready = min(len(self._queue), self._max_messages)
        found = _source_runtime()
        if not ready or found is None:
            granted = min(ready, 1)  # before the engine is set up: one at a time, counted by the admission step
        else:
            tag, runtime = found
            places = read_places.reserve(runtime, ready, subscription in _BULK_SUBSCRIPTIONS)
            read_places.settle(runtime, tag, places, len(places))
            runtime.dispatched(places)  # its output is committed at once; the admission step runs later
            granted = len(places)
        received = [self._queue.popleft() for _ in range(granted)]
        self.taken += len(received)
        if not received:  # an idle source must not spin the executor thread
            if not _prefetched() and (load := _source_load()) is not None and load["held"] == load["on_the_way"] == 0:
                _ARRIVED.clear()
                if not _prefetched():  # looked at again: an arrival since sets the event after the clear
                    _ARRIVED.wait(IDLE_WAIT_S)
            else:
                time.sleep(BUSY_WAIT_S)
        return types.PullResponse(received_messages=received)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


_RUNTIMES: dict[str, WorkerRuntime] = {}  # by tag: the runtime the pipeline's steps acquired
_RUNTIMES_LOCK = threading.Lock()


def _record_runtimes() -> None:
    """Fix 7: every runtime a step of this process acquires is recorded, for the read to take places on."""
    from pipeline.worker import runtime as worker_runtime

    original = worker_runtime.acquire_runtime

    def acquire(settings: RuntimeSettings, tag: str, *, fresh: bool = False) -> WorkerRuntime:
        runtime = original(settings, tag, fresh=fresh)
        with _RUNTIMES_LOCK:
            _RUNTIMES[tag] = runtime
        return runtime

    worker_runtime.acquire_runtime = acquire


def _source_runtime() -> tuple[str, WorkerRuntime] | None:
    """The worker's runtime and its tag, once the pipeline's steps have set it up: one pipeline, one runtime, in
    a local run."""
    with _RUNTIMES_LOCK:
        return next(iter(_RUNTIMES.items()), None)


def _prefetched() -> bool:
    """Whether any read (live or bulk) has messages waiting to be taken."""
    return any(client._queue for client in list(_CLIENTS.values()))


def _source_load() -> dict | None:
    found = _source_runtime()
    return found[1].load() if found is not None else None


_applied = False
# Per process: the job's bulk_subscription, whose reads take places as the bulk lane's (the launcher sets it).
_BULK_SUBSCRIPTIONS: set[str] = set()
_CLIENTS: dict[int, _PrefetchingPullClient] = {}  # one per read transform


def _inspect_methods_once_per_class() -> None:
    """Fix 6: Beam's ``get_function_arguments``, cached per class for the methods a class defines."""
    from apache_beam.transforms import core

    original = core.get_function_arguments
    by_class: dict[tuple[type, str], tuple[list[str], list[Any]]] = {}

    def arguments_once_per_class(obj: Any, func: str) -> tuple[list[str], list[Any]]:
        # Only a method the class itself defines has the same arguments for every instance.
        if (hasattr(obj, f"_inspect_{func}") or func in getattr(obj, "__dict__", {})
                or not inspect.isfunction(getattr(type(obj), func, None))):
            return original(obj, func)
        key = (type(obj), func)
        if key not in by_class:
            by_class[key] = original(obj, func)
        args, defaults = by_class[key]
        return list(args), list(defaults)

    core.get_function_arguments = arguments_once_per_class


def _serve_serial_steps_in_arrival_order() -> None:
    """Fix 8: the oldest scheduled bundle of a serially run step runs next."""
    from apache_beam.runners.direct import executor

    serial = executor._SerialEvaluationState

    def update_in_arrival_order(self, new_work, completed_work):
        with self._lock:
            if new_work:
                self.serial_queue.append(new_work)
            if completed_work:
                assert self.currently_evaluating == completed_work
                self.currently_evaluating = None
            if self.serial_queue and not self.currently_evaluating:
                self.currently_evaluating = self.serial_queue.popleft()
                executor._TransformEvaluationState.schedule(self, self.currently_evaluating)

    serial._update_currently_evaluating = update_in_arrival_order


def _fire_each_timer_once() -> None:
    """Fix 9: a timer whose firing is scheduled is not fired again until that firing's bundle is done.

    The monitor's ``_fire_timers`` is Beam's but for the filter: each firing it schedules is remembered, per run and
    step, by what names the timer's setting (key, window, name, domain, dynamic tag, time); one already scheduled is
    left out, and taken off the step's record of fired timers (a skipped firing never completes, which is what
    takes one off it). A firing is forgotten once its bundle's result is committed, the timer's clearing in the
    key's state with it (not before: a monitor cycle between the two would find the timer still set and fire it
    again), or once its bundle failed for good (its timer is still set, and fires again, as Beam's would)."""
    from apache_beam.runners.direct import executor

    scheduled: weakref.WeakKeyDictionary[Any, dict[Any, set[tuple]]] = weakref.WeakKeyDictionary()  # by run
    lock = threading.Lock()

    def setting(firing: Any) -> tuple:
        return (firing.encoded_key, firing.window, firing.name, firing.time_domain, firing.dynamic_timer_tag,
                firing.timestamp)

    class ForgettingCallback(executor._CompletionCallback):
        """Beam's completion callback for a timer bundle, which then forgets the bundle's firings."""

        def __init__(self, context: Any, all_updates: Any, step: Any, firings: list[Any]) -> None:
            super().__init__(context, all_updates, timer_firings=firings)
            self._step = step

        def handle_result(self, transform_executor, input_committed_bundle, transform_result):
            try:
                return super().handle_result(transform_executor, input_committed_bundle, transform_result)
            finally:
                self._forget()

        def handle_exception(self, transform_executor, exception):
            self._forget()
            super().handle_exception(transform_executor, exception)

        def _forget(self) -> None:
            with lock:
                scheduled[self._evaluation_context][self._step].difference_update(map(setting, self._timer_firings))

    def fire_timers_once(self) -> bool:
        context = self._executor.evaluation_context
        transform_fired_timers, _ = context.extract_all_timers()
        fired = False
        for applied_ptransform, fired_timers in transform_fired_timers:
            with lock:
                pending = scheduled.setdefault(context, {}).setdefault(applied_ptransform, set())
                fresh = [firing for firing in fired_timers if setting(firing) not in pending]
                pending.update(map(setting, fresh))
            again = [firing for firing in fired_timers if firing not in fresh]
            if again:
                watermarks = context._watermark_manager.get_watermarks(applied_ptransform)
                with watermarks._lock:
                    watermarks._fired_timers.difference_update(again)
            if not fresh:
                continue
            empty_bundle = context.create_empty_committed_bundle(applied_ptransform.inputs[0])
            callback = ForgettingCallback(context, self._executor.all_updates, applied_ptransform, fresh)
            self._executor.schedule_consumption(applied_ptransform, empty_bundle, fresh, callback)
            fired = True
        return fired

    executor._ExecutorServiceParallelExecutor._MonitorTask._fire_timers = fire_timers_once


def apply_local_runner_fixes(max_messages: int = 100, read_interval_s: float = 0.02) -> None:
    """Applies the nine DirectRunner fixes (idempotent)."""
    global _applied
    if _applied:
        return
    from apache_beam.runners.direct import executor, transform_evaluator, watermark_manager
    from apache_beam.transforms import userstate

    evaluator = transform_evaluator._PubSubReadEvaluator
    original_client = evaluator._get_subscriber_client.__func__

    def prefetching(cls, transform):
        # One prefetching client per read transform, kept across bundles.
        key = id(transform)
        if key not in _CLIENTS:
            _CLIENTS[key] = _PrefetchingPullClient(original_client(cls, transform), max_messages)
        return _CLIENTS[key]

    evaluator._get_subscriber_client = classmethod(prefetching)

    original_init = evaluator.__init__
    subscriptions: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def init_resolving_once(self, evaluation_context, applied_ptransform, input_committed_bundle, side_inputs):
        if applied_ptransform not in subscriptions:
            original_init(self, evaluation_context, applied_ptransform, input_committed_bundle, side_inputs)
            subscriptions[applied_ptransform] = self._sub_name
            return
        transform_evaluator._TransformEvaluator.__init__(self, evaluation_context, applied_ptransform,
                                                          input_committed_bundle, side_inputs)
        self.source = applied_ptransform.transform._source
        self._sub_name = subscriptions[applied_ptransform]

    evaluator.__init__ = init_resolving_once

    monitor = executor._ExecutorServiceParallelExecutor._MonitorTask
    original_add_work = monitor._add_work_if_necessary

    def add_work_keeping_sources_read(self, timers_fired):
        original_add_work(self, timers_fired)
        parallel = self._executor
        now = time.monotonic()
        if now - getattr(parallel, "_last_source_schedule", 0.0) < read_interval_s:
            return
        parallel._last_source_schedule = now
        for root in parallel.root_nodes:
            if parallel.evaluation_context.is_done(root):
                continue
            # A read in flight has no pending bundle, so nothing is scheduled twice.
            for bundle in parallel.node_to_pending_bundles.get(root, []):
                parallel.schedule_consumption(root, bundle, [], parallel.default_completion_callback)
            parallel.node_to_pending_bundles[root] = []

    monitor._add_work_if_necessary = add_work_keeping_sources_read

    original_specs = userstate.get_dofn_specs
    specs_by_class: dict[type, Any] = {}

    def dofn_specs_by_class(dofn):
        cls = type(dofn)
        if cls not in specs_by_class:
            specs_by_class[cls] = original_specs(dofn)
        return specs_by_class[cls]

    userstate.get_dofn_specs = dofn_specs_by_class
    transform_evaluator.get_dofn_specs = dofn_specs_by_class

    _inspect_methods_once_per_class()
    _record_runtimes()

    watermarks = watermark_manager._TransformWatermarks
    original_add_pending = watermarks.add_pending

    def add_pending_with_elements(self, pending):
        if pending.has_elements():
            original_add_pending(self, pending)

    watermarks.add_pending = add_pending_with_elements
    _serve_serial_steps_in_arrival_order()
    _fire_each_timer_once()
    _applied = True
    LOGGER.info("DirectRunner Pub/Sub read prefetched in the background and scheduled every %.0f ms "
                "(local runs only)", read_interval_s * 1000)


def _log_load(path: str, interval_s: float = 0.5) -> None:
    """Appends {"t", "taken", and the engine's load()} lines while the pipeline runs."""
    import json

    with open(path, "a", encoding="utf-8") as log:
        while True:
            time.sleep(interval_s)
            load = _source_load()
            if load is not None:
                taken = sum(client.taken for client in _CLIENTS.values())
                log.write(json.dumps({"t": round(time.time(), 3), "taken": taken, **load}) + "\n")
                log.flush()


def main(argv: list[str] | None = None) -> int:
    """Runs the template on the DirectRunner with the fixes above; takes the template's own arguments."""
    parser = argparse.ArgumentParser(description="The template on the local DirectRunner, with local-only fixes, "
                                     "until SIGINT or SIGTERM cancels it; every other argument goes to the template.",
                                     allow_abbrev=False)
    parser.add_argument("--keep_pipeline_off_model_cores", choices=("true", "false"), default="true",
                        help="move the pipeline's threads off the cores a vLLM on this machine computes on")
    parser.add_argument("--server_url", help="the template's own parameter; read here to find a loopback server")
    parser.add_argument("--bulk_subscription", help="the template's own parameter; read here to read it as the "
                                                    "bulk lane")
    parser.add_argument("--load_log", metavar="PATH",
                        help="append the worker's load (what it holds, what the read took) as a JSON line twice a "
                             "second")
    own, template_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if own.server_url:
        template_args.append(f"--server_url={own.server_url}")
    if own.bulk_subscription:
        template_args.append(f"--bulk_subscription={own.bulk_subscription}")
        _BULK_SUBSCRIPTIONS.add(own.bulk_subscription)
    from local.core_placement import keep_pipeline_off_local_model
    from local.cpu_server import apply_server_environment
    from local.emulators import use_bigquery_emulator
    from pipeline.assembly import run
    from pipeline.config.options import ConfigError
    from template.main import configure_logging

    configure_logging()
    apply_local_runner_fixes()
    use_bigquery_emulator()  # when the smoke run or a test named one
    if own.load_log:
        threading.Thread(target=_log_load, args=(own.load_log,), name="load-log", daemon=True).start()
    apply_server_environment()
    if own.keep_pipeline_off_model_cores == "true" and hasattr(os, "sched_setaffinity"):  # Linux's call
        keep_pipeline_off_local_model(own.server_url)
    # Beam's default DirectRunner first tries Prism, which needs a download: the bundle-based one runs here.
    template_args = [arg for arg in template_args
                     if arg not in ("--runner=DirectRunner", "--runner=SwitchingDirectRunner")]
    if not any(arg.startswith("--runner") for arg in template_args):
        template_args.append("--runner=BundleBasedDirectRunner")
    try:
        result = run(template_args)
    except ConfigError as exc:
        LOGGER.error("%s", exc)
        return 2
    _wait_until_stopped(result)
    return 0


def _wait_until_stopped(result: PipelineResult) -> None:
    """Blocks until the pipeline fails or a SIGINT/SIGTERM arrives, then cancels it.

    The DirectRunner's ``wait_until_finish`` never returns after ``cancel()``,
    so it runs on a helper thread while this one waits for either outcome.
    """
    stop = threading.Event()
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            result.wait_until_finish()
        except BaseException as exc:  # surfaced below
            failure.append(exc)
        stop.set()

    def on_signal(signum: int, _frame: object) -> None:
        LOGGER.info("Received signal %d: cancelling the pipeline", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=wait, name="wait-until-finish", daemon=True).start()
    while not stop.wait(0.5):
        pass
    if failure:
        raise failure[0]
    result.cancel()
    LOGGER.info("Pipeline stopped (%s)", result.state)


if __name__ == "__main__":
    sys.exit(main())
