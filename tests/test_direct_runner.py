"""The local-only DirectRunner fixes, checked on real pipelines: a streaming read from the Pub/Sub emulator, and a batch one."""

from __future__ import annotations

import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.testing.util import assert_that, equal_to

from local.direct_runner import apply_local_runner_fixes
from tests.conftest import wait_until
from tests.feed_harness import ACK_DEADLINE_S, short_deadline_subscription


def idle_streaming_read(emulator, name: str):
    """A streaming pipeline reading an empty subscription on the fixed DirectRunner; cancel what it returns."""
    emulator.create_topic(f"{name}-topic", subscription=f"{name}-sub")
    apply_local_runner_fixes()
    options = PipelineOptions(runner="BundleBasedDirectRunner")
    options.view_as(StandardOptions).streaming = True
    pipeline = beam.Pipeline(options=options)
    pipeline | beam.io.ReadFromPubSub(subscription=emulator.subscription(f"{name}-sub")) | beam.Map(len)
    return pipeline.run()


def test_an_idle_streaming_read_leaves_no_pending_bundles_behind(emulator):
    """Unfixed, each read added an empty bundle that was never removed: thousands within seconds."""
    result = idle_streaming_read(emulator, "idle-read")
    try:
        watermarks = result._evaluation_context._watermark_manager._transform_to_watermarks.values()
        sizes = []
        for _ in range(4):
            time.sleep(2)
            sizes.append(max(len(tw._pending) for tw in watermarks))
    finally:
        result.cancel()
    assert max(sizes) <= 2, f"pending bundles grew: {sizes}"


def test_a_streaming_read_resolves_its_subscription_once_not_per_read(emulator, monkeypatch):
    """Unfixed, every read (one per 20 ms) re-parsed every pipeline option to look up the project."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions
    from apache_beam.runners.direct import transform_evaluator

    lookups, reads = [], []
    view_as = PipelineOptions.view_as
    monkeypatch.setattr(PipelineOptions, "view_as",
                        lambda self, cls: (lookups.append(cls) if cls is GoogleCloudOptions else None) or view_as(self, cls))
    read = transform_evaluator._PubSubReadEvaluator._read_from_pubsub
    monkeypatch.setattr(transform_evaluator._PubSubReadEvaluator, "_read_from_pubsub",
                        lambda self, *args: reads.append(1) or read(self, *args))
    result = idle_streaming_read(emulator, "resolve-once")
    try:
        time.sleep(2)
        lookups_before = len(lookups)
        time.sleep(2)
    finally:
        result.cancel()
    assert len(reads) >= 20, f"the read ran only {len(reads)} times"
    assert len(lookups) - lookups_before == 0, f"{len(lookups) - lookups_before} option lookups in 2 s of reads"


def test_a_dofn_methods_arguments_are_inspected_once_per_class_not_per_bundle(monkeypatch):
    """Unfixed, each bundle's runner re-inspected every method's signature; what Beam wraps per object still is."""
    from apache_beam.transforms import core

    apply_local_runner_fixes()
    inspected = []
    original = core.get_function_args_defaults
    monkeypatch.setattr(core, "get_function_args_defaults", lambda f: inspected.append(f) or original(f))

    class Double(beam.DoFn):
        def process(self, element):
            yield element * 2

    with beam.Pipeline(options=PipelineOptions(runner="BundleBasedDirectRunner")) as pipeline:
        doubled = pipeline | beam.Create(range(300)) | beam.Reshuffle() | beam.ParDo(Double())
        assert_that(doubled, equal_to([2 * n for n in range(300)]))
    assert len(inspected) < 500, f"{len(inspected)} signature inspections"  # 1,171 unfixed, 236 fixed


def test_the_local_read_hands_over_only_what_the_worker_has_places_for_and_the_admission_step_takes_them(emulator):
    """Fix 7: the local read takes a place in the worker's hold for each message before it hands it over, as the
    job's reader does on Dataflow (pipeline/worker/read_places.py): from a backlog of 10 it hands over the
    worker's room, 3, and the admission step's requests each take one of those places over."""
    from google.cloud import pubsub_v1

    from local import direct_runner
    from pipeline.engines.engine_settings import EngineSettings
    from pipeline.engines.vllm_engine import vllm_engine
    from pipeline.worker import read_places
    from pipeline.worker.runtime import WorkerRuntime
    from pipeline.worker.runtime_settings import AdmissionSettings

    emulator.create_topic("fix7-topic", subscription="fix7-sub")
    publisher = pubsub_v1.PublisherClient()
    for i in range(10):
        publisher.publish(emulator.topic("fix7-topic"), f"m{i}".encode()).result()
    # An engine for an unreachable server: it is asked only how many streams it runs, none.
    settings = EngineSettings(server=None, server_url="http://127.0.0.1:1", served_model_name="m", max_in_flight=2)
    runtime = WorkerRuntime(vllm_engine(settings), AdmissionSettings(worker_queue=1, transit_s=60.0))
    client = direct_runner._PrefetchingPullClient(pubsub_v1.SubscriberClient(), max_messages=100)
    tag = f"fix7-{time.monotonic_ns()}"
    with direct_runner._RUNTIMES_LOCK:
        saved = dict(direct_runner._RUNTIMES)
        direct_runner._RUNTIMES.clear()
        direct_runner._RUNTIMES[tag] = runtime
    try:
        handed, deadline = 0, time.monotonic() + 30
        while time.monotonic() < deadline and handed < 3:
            handed += len(client.pull(emulator.subscription("fix7-sub")).received_messages)
        time.sleep(1.0)  # the prefetch has had time to fetch more: still nothing more is handed over
        handed += len(client.pull(emulator.subscription("fix7-sub")).received_messages)
        assert handed == 3, "max_in_flight + worker_queue"
        assert runtime.admission.counts() == (0, 0, 3)
        places = read_places.take(tag, 10)
        assert len(places) == 3
        assert runtime.admit(["a", "b"], in_place_of=places[:2]) == 2, "each request in a place: no room needed"
        assert runtime.admission.counts() == (0, 0, 3), "two requests and the third place"
    finally:
        client.close()
        with direct_runner._RUNTIMES_LOCK:
            direct_runner._RUNTIMES.clear()
            direct_runner._RUNTIMES.update(saved)


def test_the_local_read_of_the_bulk_subscription_prefetches_the_lanes_least_wave_and_keeps_it_leased(emulator):
    """The bulk lane's places come at its pace (one stream's, beside live traffic): a prefetch of the worker's whole
    room held messages past their ack deadline, and Pub/Sub sent each again, a copy the job read and dropped. It
    prefetches at most BULK_QUEUED_MIN, the rest stays in the subscription, and what it holds is kept leased past
    the subscription's ack deadline (Pub/Sub's least, 10 s)."""
    from google.cloud import pubsub_v1

    from local import direct_runner
    from pipeline.engines.engine_settings import EngineSettings
    from pipeline.engines.vllm_engine import vllm_engine
    from pipeline.worker.admission_ledger import BULK_QUEUED_MIN
    from pipeline.worker.runtime import WorkerRuntime
    from pipeline.worker.runtime_settings import AdmissionSettings

    topic, subscription = short_deadline_subscription(emulator, f"bulk-prefetch-{time.monotonic_ns()}")
    publisher = pubsub_v1.PublisherClient()
    for i in range(20):
        publisher.publish(topic, f"m{i}".encode()).result()
    settings = EngineSettings(server=None, server_url="http://127.0.0.1:1", served_model_name="m", max_in_flight=16)
    runtime = WorkerRuntime(vllm_engine(settings), AdmissionSettings(worker_queue=16, transit_s=60.0))
    client = direct_runner._PrefetchingPullClient(pubsub_v1.SubscriberClient(), max_messages=100)
    with direct_runner._RUNTIMES_LOCK:
        saved = dict(direct_runner._RUNTIMES)
        direct_runner._RUNTIMES.clear()
        direct_runner._RUNTIMES[f"bulk-prefetch-{time.monotonic_ns()}"] = runtime
    direct_runner._BULK_SUBSCRIPTIONS.add(subscription)
    try:
        client.pull(subscription)  # starts the prefetch
        assert wait_until(lambda: len(client._queue) == BULK_QUEUED_MIN, 30), "it prefetched the least wave"
        held = {message.message.data for message in client._queue}
        time.sleep(ACK_DEADLINE_S + 3.0)
        assert len(client._queue) == BULK_QUEUED_MIN, "and no more, with room for 32 and 20 waiting"
        others, subscriber = set(), pubsub_v1.SubscriberClient()
        for _ in range(5):
            response = subscriber.pull(subscription=subscription, max_messages=100, timeout=5.0)
            others |= {message.message.data for message in response.received_messages}
        assert len(others) == 20 - BULK_QUEUED_MIN and not others & held, "what it holds is not sent again"
    finally:
        client.close()
        direct_runner._BULK_SUBSCRIPTIONS.discard(subscription)
        with direct_runner._RUNTIMES_LOCK:
            direct_runner._RUNTIMES.clear()
            direct_runner._RUNTIMES.update(saved)


def test_a_stateful_steps_waiting_bundles_run_in_the_order_they_were_scheduled():
    """Beam's serial evaluation (one bundle at a time for a stateful step, every key's together) served its queue
    newest first, so a request's bundle waited while keys' poll timers passed it. Fixed: oldest first."""
    from apache_beam.runners.direct import executor

    apply_local_runner_fixes()

    class Pool:  # the runner's thread pool, as the serial state hands it work: one at a time
        def __init__(self) -> None:
            self.submitted: list[str] = []

        def submit(self, work: str) -> None:
            self.submitted.append(work)

    pool = Pool()
    serial = executor._SerialEvaluationState(pool, set())
    for work in ("timer-a", "request", "timer-b", "timer-c"):
        serial.schedule(work)
    assert pool.submitted == ["timer-a"], "one at a time"
    for done in ("timer-a", "request", "timer-b"):
        serial.complete(done)
    assert pool.submitted == ["timer-a", "request", "timer-b", "timer-c"]



def test_a_timer_fires_once_for_each_setting_however_long_its_firing_waits_to_run(emulator, tmp_path):
    """Beam's monitor fired an expired timer again at each of its cycles until the bundle of its first firing had
    committed the timer's clearing, so a firing that waited behind other work of its step (here: each firing runs
    0.2 s, one at a time, while more keys' requests arrive and their timers come due) ran again: under load, the
    queue grew without bound. Fixed: once a setting, as Dataflow fires one."""
    from apache_beam.coders import StrUtf8Coder
    from apache_beam.transforms.timeutil import TimeDomain
    from apache_beam.transforms.userstate import ReadModifyWriteStateSpec, TimerSpec, on_timer
    from apache_beam.utils.timestamp import Timestamp
    from google.cloud import pubsub_v1

    log = str(tmp_path / "firings")

    def fired() -> list[str]:
        try:
            with open(log) as firings:
                return firings.read().splitlines()
        except FileNotFoundError:
            return []

    class FireSoon(beam.DoFn):
        KEY = ReadModifyWriteStateSpec("key", StrUtf8Coder())
        SOON = TimerSpec("soon", TimeDomain.REAL_TIME)

        def process(self, element, key_state=beam.DoFn.StateParam(KEY), soon=beam.DoFn.TimerParam(SOON)):
            key_state.write(element[0])
            soon.set(Timestamp.of(time.time() + 0.05))

        @on_timer(SOON)
        def on_soon(self, key_state=beam.DoFn.StateParam(KEY), fired_at=beam.DoFn.TimestampParam):
            time.sleep(0.2)  # meanwhile the other keys' timers come due and wait
            with open(log, "a") as firings:  # the DoFn runs as a copy: a file, not a list, is shared
                firings.write(f"{key_state.read()} {fired_at.micros}\n")
            yield key_state.read()

    topic = emulator.create_topic("timers-topic", subscription="timers-sub")
    apply_local_runner_fixes()
    options = PipelineOptions(runner="BundleBasedDirectRunner")
    options.view_as(StandardOptions).streaming = True
    pipeline = beam.Pipeline(options=options)
    (pipeline | beam.io.ReadFromPubSub(subscription=emulator.subscription("timers-sub"))
     | beam.Map(lambda data: (data.decode(), 1)) | beam.ParDo(FireSoon()))
    result = pipeline.run()
    keys = [f"key-{n}" for n in range(16)]
    try:
        publisher = pubsub_v1.PublisherClient()
        for key in keys:  # read in a few bundles: later keys arrive while earlier keys' firings run or wait
            publisher.publish(topic, key.encode()).result()
        assert wait_until(lambda: {line.split()[0] for line in fired()} == set(keys), 60), fired()
        time.sleep(2)  # a firing run again would come within this
    finally:
        result.cancel()
    assert len(fired()) == len(keys), f"fired {len(fired())} times for {len(keys)} settings: {sorted(fired())}"
