"""The local-only DirectRunner fixes, checked on a real streaming read from the Pub/Sub emulator."""

from __future__ import annotations

import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from pipeline.local_runner import apply_local_runner_fixes


def test_an_idle_streaming_read_leaves_no_pending_bundles_behind(emulator):
    """Unfixed, each read added an empty bundle that was never removed: thousands within seconds."""
    emulator.create_topic("idle-read-topic", subscription="idle-read-sub")
    apply_local_runner_fixes()
    options = PipelineOptions(runner="BundleBasedDirectRunner")
    options.view_as(StandardOptions).streaming = True
    pipeline = beam.Pipeline(options=options)
    pipeline | beam.io.ReadFromPubSub(subscription=emulator.subscription("idle-read-sub")) | beam.Map(len)
    result = pipeline.run()
    try:
        watermarks = result._evaluation_context._watermark_manager._transform_to_watermarks.values()
        sizes = []
        for _ in range(4):
            time.sleep(2)
            sizes.append(max(len(tw._pending) for tw in watermarks))
    finally:
        result.cancel()
    assert max(sizes) <= 2, f"pending bundles grew: {sizes}"
