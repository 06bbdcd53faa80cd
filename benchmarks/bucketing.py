"""Bucketing benchmark: padding and waits, arrival order vs length buckets, on the DirectRunner.

A seeded mixed-length workload is published to the Pub/Sub emulator at a
steady rate and read by the template's own first stages (ParseRequests →
MeasurePromptLength → BatchRequests). Each batch is recorded as it leaves the
batcher. Printed per configuration: batch-size distribution, padding ratio
(padded tokens ÷ batch tokens, as if each batch were padded to its longest
prompt) and the measured wait from receipt to batch emission (p50/p99)
against the configured delay. Figures only; nothing is asserted.

    python -m benchmarks.bucketing [--requests 600] [--rate 300] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import apache_beam as beam
from apache_beam.io.gcp.pubsub import ReadFromPubSub
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from local.direct_runner import apply_local_runner_fixes
from local.emulators import PubSubEmulator
from pipeline.flow.batching import BatchingConfig, BatchRequests, default_boundaries, padding
from pipeline.intake.parsing import ParseRequests
from pipeline.intake.prompt_length import ESTIMATOR_CHARS, MeasurePromptLength, PromptLength


def workload(count: int, seed: int) -> list[int]:
    """Prompt lengths in tokens: mostly short chat turns, some documents, a few long contexts."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.70:
            lengths.append(rng.randint(8, 64))
        elif roll < 0.95:
            lengths.append(rng.randint(65, 512))
        else:
            lengths.append(rng.randint(513, 1800))
    return lengths


class _Record(beam.DoFn):
    def __init__(self, path: str) -> None:
        self._path = path

    def process(self, batch) -> None:
        now = time.time()
        _, requests = batch
        record = {"lengths": [r.prompt_tokens for r in requests], "waits_ms": [(now - r.received_at) * 1000
                                                                              for r in requests]}
        with open(self._path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def run_once(emulator: PubSubEmulator, config: BatchingConfig, lengths: list[int], rate: float, tag: str) -> list[dict]:
    topic = emulator.create_topic(f"bench-{tag}", subscription=f"bench-{tag}-sub")
    out = Path(tempfile.mkstemp(prefix=f"bench-{tag}-", suffix=".jsonl")[1])
    options = PipelineOptions(flags=[], runner="BundleBasedDirectRunner")
    options.view_as(StandardOptions).streaming = True
    apply_local_runner_fixes()
    pipeline = beam.Pipeline(options=options)
    parsed = (pipeline | ReadFromPubSub(subscription=emulator.subscription(f"bench-{tag}-sub"), with_attributes=True)
              | ParseRequests())
    measured = parsed.requests | MeasurePromptLength(PromptLength(estimator=ESTIMATOR_CHARS))
    (measured.requests | BatchRequests(config)).batches | beam.ParDo(_Record(str(out)))
    result = pipeline.run()
    from google.cloud import pubsub_v1

    publisher = pubsub_v1.PublisherClient(batch_settings=pubsub_v1.types.BatchSettings(max_latency=0.001))
    time.sleep(3)  # let the pipeline start reading
    started = time.monotonic()
    for index, tokens in enumerate(lengths):
        # 4 characters per token for the chars estimator: the prompt has exactly `tokens` tokens.
        publisher.publish(topic, json.dumps({"id": f"{tag}-{index}", "prompt": "abcd" * tokens}).encode())
        pause = started + (index + 1) / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    deadline = time.monotonic() + 30
    records: list[dict] = []
    while time.monotonic() < deadline:
        records = [json.loads(line) for line in out.read_text().splitlines()]
        if sum(len(r["lengths"]) for r in records) >= len(lengths):
            break
        time.sleep(0.5)
    threading.Thread(target=result.cancel, daemon=True).start()
    publisher.stop()
    out.unlink()
    return records


def summarize(records: list[dict]) -> dict:
    sizes = [len(r["lengths"]) for r in records]
    padded = total = 0
    for r in records:
        pad, tokens = padding(r["lengths"])
        padded, total = padded + pad, total + tokens
    waits = sorted(w for r in records for w in r["waits_ms"])
    return {
        "requests": sum(sizes), "batches": len(sizes), "mean_size": statistics.mean(sizes) if sizes else 0,
        "sizes": dict(sorted(Counter(sizes).items())), "padding_ratio": padded / total if total else 0.0,
        "wait_p50": waits[len(waits) // 2] if waits else float("nan"),
        "wait_p99": waits[min(len(waits) - 1, int(len(waits) * 0.99))] if waits else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=300.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--target", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    lengths = workload(args.requests, args.seed)
    buckets = default_boundaries(2048)
    configs = [("arrival order", 10, ())] + [("length buckets", d, buckets) for d in (10, 50, 200)]
    rows = []
    with PubSubEmulator() as emulator:
        emulator.activate()
        for index, (mode, delay, boundaries) in enumerate(configs):
            config = BatchingConfig(max_batch_delay_ms=delay, batch_size_target=args.target, boundaries=boundaries,
                                    num_shards=1)
            print(f"running {mode}, delay {delay} ms ...", flush=True)
            rows.append((mode, delay, summarize(run_once(emulator, config, lengths, args.rate, f"r{index}"))))
    print(f"\n{args.requests} requests at {args.rate:g}/s, seed {args.seed}, batch_size_target {args.target}, "
          f"one shard; buckets {list(buckets)} tokens")
    print(f"{'mode':<15} {'delay':>6} {'batches':>7} {'mean size':>9} {'padding':>8} {'wait p50':>9} {'wait p99':>9}"
          "  sizes (size: batches)")
    for mode, delay, s in rows:
        print(f"{mode:<15} {delay:>4}ms {s['batches']:>7} {s['mean_size']:>9.2f} {s['padding_ratio']:>8.1%} "
              f"{s['wait_p50']:>7.0f}ms {s['wait_p99']:>7.0f}ms  {s['sizes']}"
              + ("" if s["requests"] == args.requests else f"  (only {s['requests']} requests seen)"))
    base = rows[0][2]["padding_ratio"]
    same_delay = rows[1][2]["padding_ratio"]
    if same_delay:
        print(f"\npadding, arrival order ÷ length buckets at the same 10 ms delay: {base / same_delay:.1f}x")


if __name__ == "__main__":
    main()
