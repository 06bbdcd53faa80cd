"""Keying: the keys the template's own transforms produce are stable across processes, spread evenly, and keep
every copy of an id together; the defaults by runner are what the parameters say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_stream import TestStream as EventStream

from pipeline.config.settings import JobSettings
from pipeline.contract.keying import generate_key, shard_of
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.parameters import DATAFLOW_GENERATE_SHARDS
from pipeline.flow.batching import BatchingConfig, BatchRequests
from pipeline.generation.generate import KeyByGenerateShard

REPO = Path(__file__).resolve().parent.parent
IDS = [f"req-{i}" for i in range(20_000)] + ["é-ünïcode", "🦙", "x" * 512]
_SEEN: dict[str, list] = {}  # run id -> what a pipeline's last step saw (DoFns are pickled: no closures)


class _Keep(beam.DoFn):
    def __init__(self, run: str) -> None:
        self._run = run

    def process(self, element):
        _SEEN.setdefault(self._run, []).append(element)


def _run(build) -> list:
    """Runs ``build(pipeline)`` on the DirectRunner and returns what its last step emitted."""
    run = uuid.uuid4().hex
    with beam.Pipeline(options=PipelineOptions(runner="BundleBasedDirectRunner")) as pipeline:
        build(pipeline) | beam.ParDo(_Keep(run))
    return _SEEN.pop(run, [])


def test_keys_are_the_same_in_every_process_whatever_its_hash_seed():
    code = ("import json, sys; from pipeline.contract.keying import shard_of, generate_key; "
            "ids = json.load(sys.stdin); "
            "print(json.dumps([[shard_of(i, 16), generate_key(i, 262144)] for i in ids]))")
    here = [[shard_of(i, 16), generate_key(i, 262144)] for i in IDS]
    for seed in ("0", "12345"):
        result = subprocess.run([sys.executable, "-c", code], input=json.dumps(IDS), capture_output=True, text=True,
                                cwd=REPO, env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120, check=True)
        assert json.loads(result.stdout) == here


def test_the_generate_step_rekeys_a_batch_by_shard_evenly_with_every_copy_of_an_id_together():
    batches = [(shard, [InferenceRequest(id=IDS[i], prompt=str(i)) for i in range(shard, len(IDS), 8)])
               for shard in range(8)]
    batches.append((0, [InferenceRequest(id="r7", prompt=f"copy {n}") for n in range(5)]))
    keyed = _run(lambda p: p | beam.Create(batches) | KeyByGenerateShard(64))
    requests = [(key, r) for key, group in keyed for r in group]
    assert sorted(r.prompt for _, r in requests) == sorted(r.prompt for _, group in batches for r in group)
    assert all(key == generate_key(r.id, 64) for key, r in requests)
    assert len({key for key, r in requests if r.id == "r7"}) == 1
    per_key = Counter(key for key, r in requests if r.id != "r7")
    expected = len(IDS) / 64
    chi_square = sum((per_key[k] - expected) ** 2 / expected for k in range(64))
    assert len(per_key) == 64 and chi_square < 120  # 63 degrees of freedom: p > 0.9999 for a fair hash


def test_the_batchers_shard_is_the_generate_key_when_the_counts_agree():
    """Why the template skips re-keying when generate_shards equals num_shards (as on local runners)."""
    config = BatchingConfig(boundaries=(16, 64), num_shards=8, batch_size_target=4)
    requests = [InferenceRequest(id=request_id, prompt="x", prompt_tokens=20) for request_id in IDS[:400]]
    stream = EventStream().add_elements(requests).advance_watermark_to_infinity()

    def build(pipeline):
        return (pipeline | stream | BatchRequests(config, clock=lambda: 0.0)).batches

    batches = _run(build)
    assert sum(len(group) for _, group in batches) == len(requests)
    assert all(shard == generate_key(r.id, 8) for shard, group in batches for r in group)


def test_the_generate_keys_default_by_runner():
    args = ["--input_subscription=projects/my-project/subscriptions/in-sub",
            "--output_chunks_topic=projects/my-project/topics/chunks",
            "--dead_letter_topic=projects/my-project/topics/dead", "--num_shards=8"]
    settings = JobSettings.from_options(PipelineOptions(args))
    assert settings.generate_keys(local=False) == DATAFLOW_GENERATE_SHARDS
    assert settings.generate_keys(local=True) == 8
    assert JobSettings.from_options(PipelineOptions(args + ["--generate_shards=1024"])).generate_keys(
        local=False) == 1024
