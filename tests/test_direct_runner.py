"""The local-only DirectRunner fixes, checked on real pipelines: a streaming read from the Pub/Sub emulator, and a batch one."""

from __future__ import annotations

import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.testing.util import assert_that, equal_to

from local.direct_runner import apply_local_runner_fixes


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


def test_the_local_source_admits_through_the_ledger_and_the_admission_step_takes_its_places_over():
    """Fix 7: messages are admitted before they are parsed, under place-holders; the admission step's requests take
    their places without waiting; a place-holder nothing takes over (a message that failed to parse) lapses."""
    from local.direct_runner import SourceAdmission
    from pipeline.engines.engine_settings import EngineSettings
    from pipeline.worker.admission_ledger import AdmissionLedger

    settings = EngineSettings(server=None, server_url="http://127.0.0.1:1", max_in_flight=2, worker_queue=1,
                              admission_transit_s=0.3)
    ledger = AdmissionLedger(settings, unfinished=lambda: 0)
    source = SourceAdmission(ledger)  # the ledger's calls are the runtime's
    assert source.admit_messages(5) == 3, "max_in_flight + worker_queue"
    assert ledger.counts() == (0, 0, 3) and ledger.admit(["other"]) == 0
    # As the admission step calls it, naming its read bundle (AdmitFn._admit).
    assert source.admit(["a", "b"], bundle="bundle-1") == 2, "each request takes a place-holder's place: no wait"
    assert ledger.counts() == (0, 0, 3), "two requests and the third place-holder"
    time.sleep(0.4)
    assert ledger.counts() == (0, 0, 2), "the place-holder nobody took over lapsed; the requests count until they arrive"
    ledger.report_waiting("shard-0", 0, arrived=["a", "b"])
    assert ledger.counts() == (0, 0, 0)
    assert source.admit(["c"], bundle="bundle-2") == 1 and ledger.counts() == (0, 0, 1), \
        "no place-holder left: the ledger's own rule"


def test_a_request_takes_over_its_place_holder_even_after_the_place_holder_lapsed():
    """On a slow machine the admission step may run after a place-holder's transit lapsed; its request still takes
    the place (it was admitted), so the step never waits or refuses on the DirectRunner."""
    from local.direct_runner import SourceAdmission
    from pipeline.engines.engine_settings import EngineSettings
    from pipeline.worker.admission_ledger import AdmissionLedger

    settings = EngineSettings(server=None, server_url="http://127.0.0.1:1", max_in_flight=1, worker_queue=1,
                              admission_transit_s=0.2)
    streams = [0]
    ledger = AdmissionLedger(settings, unfinished=lambda: streams[0])
    source = SourceAdmission(ledger)
    assert source.admit_messages(2) == 2
    streams[0] = 2  # full of streams by the time the step runs
    time.sleep(0.3)
    assert ledger.counts() == (2, 0, 0), "the place-holders lapsed"
    assert source.admit(["a", "b"]) == 2, "each request still takes its place-holder's place"
