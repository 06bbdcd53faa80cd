"""Keying: stable across processes, spread as the scale-out simulation assumes, and the defaults it chose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from apache_beam.options.pipeline_options import PipelineOptions

from benchmarks.scale import simulate, worker_of
from pipeline.config.settings import JobSettings
from pipeline.contract.keying import generate_key, shard_of
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.parameters import DATAFLOW_GENERATE_SHARDS
from pipeline.generation.generate import _by_generate_key

REPO = Path(__file__).resolve().parent.parent
IDS = [f"req-{i}" for i in range(20_000)] + ["é-ünïcode", "🦙", "x" * 512]


def test_keys_are_the_same_in_every_process_whatever_its_hash_seed():
    code = ("import json, sys; from pipeline.contract.keying import shard_of, generate_key; "
            "ids = json.load(sys.stdin); "
            "print(json.dumps([[shard_of(i, 16), generate_key(i, 262144)] for i in ids]))")
    here = [[shard_of(i, 16), generate_key(i, 262144)] for i in IDS]
    for seed in ("0", "12345"):
        result = subprocess.run([sys.executable, "-c", code], input=json.dumps(IDS), capture_output=True, text=True,
                                cwd=REPO, env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120, check=True)
        assert json.loads(result.stdout) == here


def test_shards_and_worker_ranges_spread_uniformly():
    shards = Counter(shard_of(i, 64) for i in IDS)
    expected = len(IDS) / 64
    chi_square = sum((shards[s] - expected) ** 2 / expected for s in range(64))
    assert len(shards) == 64 and chi_square < 120  # 63 degrees of freedom: p > 0.9999 for a fair hash
    workers = Counter(worker_of(i.encode(), 10) for i in IDS)
    assert sorted(workers) == list(range(10)) and max(workers.values()) < 1.1 * len(IDS) / 10


def test_a_batch_is_regrouped_by_generate_key_with_every_copy_of_an_id_together():
    requests = [InferenceRequest(id=f"r{i % 50}", prompt=str(i)) for i in range(200)]
    groups = list(_by_generate_key((3, requests), 64))
    assert sorted(r.prompt for _, group in groups for r in group) == sorted(r.prompt for r in requests)
    for key, group in groups:
        assert 0 <= key < 64 and {generate_key(r.id, 64) for r in group} == {key}
    assert len({key for key, group in groups for r in group if r.id == "r7"}) == 1


def test_the_default_generate_keys_keep_a_hundred_workers_busy_and_local_runs_use_the_batchers():
    """The claim behind DATAFLOW_GENERATE_SHARDS (pipeline/contract/parameters.py): per-request keys do no better at 100 workers,
    where the batcher's 16 shards leave most GPUs idle (benchmarks/scale.py places real ids on workers)."""
    rows = {(r.keying, r.workers): r for r in simulate(20_000, seed=1, in_flight=1024, requests_per_s=200,
                                                         poll_interval_s=0.05)}
    default, per_request = rows[(f"{DATAFLOW_GENERATE_SHARDS} shards", 100)], rows[("request id", 100)]
    assert default.usable_share >= 0.9 * per_request.usable_share and default.idle_workers == 0
    assert rows[("16 shards", 100)].usable_share < 0.5 * default.usable_share
    args = ["--input_subscription=projects/my-project/subscriptions/in-sub",
            "--output_chunks_topic=projects/my-project/topics/chunks",
            "--dead_letter_topic=projects/my-project/topics/dead", "--num_shards=8"]
    settings = JobSettings.from_options(PipelineOptions(args))
    assert settings.generate_keys(local=False) == DATAFLOW_GENERATE_SHARDS
    assert settings.generate_keys(local=True) == 8
    assert JobSettings.from_options(PipelineOptions(args + ["--generate_shards=1024"])).generate_keys(
        local=False) == 1024


def test_the_batchers_shard_is_the_generate_key_when_the_counts_agree():
    """Why the template skips re-keying when generate_shards equals num_shards (as on local runners)."""
    from pipeline.flow.batching import BatchingConfig, _keyed

    config = BatchingConfig(boundaries=(16, 64), num_shards=8)
    for request_id in IDS[:2000]:
        (key, _), = _keyed(config, InferenceRequest(id=request_id, prompt="x", prompt_tokens=20))
        assert int(key.rsplit(":", 1)[1]) == generate_key(request_id, 8)
