"""Serving benchmark: our pipeline vs raw vLLM vs Beam's RunInference + VLLMCompletionsModelHandler.

One local vLLM server (the embedded SmolLM2 on the CPU build) serves all three,
with the same seeded prompts, side by side in one run:

- raw vLLM: an asyncio client streams every request straight to the server —
  the floor, with no pipeline at all;
- this template: Pub/Sub emulator → the pipeline on the DirectRunner → chunks
  and completions back on Pub/Sub, measured at the subscriber;
- Beam's handler: the same Pub/Sub in and out around ``RunInference`` with
  ``VLLMCompletionsModelHandler`` (its batching and non-streaming requests,
  unchanged; only ``load_model`` is pointed at the shared server).

All three use the completions API, ``temperature=0`` and one ``max_tokens``
(Beam's handler takes one ``inference_args`` for every element). Printed: time
to first token (first chunk with text; for Beam's handler, its whole answer;
for an empty answer, its end) and
completion latency as p50/p90 from the moment each prompt was sent, output
tokens per second, and ratios. Figures only; nothing is asserted.

    python -m benchmarks.serving [--requests 32] [--max-tokens 96] [--seed 11]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import threading
import time

import aiohttp
import apache_beam as beam
from apache_beam.io.gcp.pubsub import ReadFromPubSub
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
from apache_beam.ml.inference.vllm_inference import VLLMCompletionsModelHandler
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from local.emulators import PubSubEmulator
from local.harness import REPO_ROOT, LocalRun
from pipeline.local_model import ensure_local_checkpoint
from pipeline.local_runner import apply_local_runner_fixes
from pipeline.model_manager import ServerSpec, VLLMServer
from pipeline.pubsub_sink import PublishJson

SHORT = ["What is the capital of France?", "Name a primary color.", "What is 7 times 8?", "Say hello in Spanish.",
         "Which planet is closest to the sun?", "What do bees make?", "How many days are in a week?",
         "What is the opposite of hot?"]
LONG = ["Write a detailed essay about the history of the printing press.",
        "Explain step by step how a bicycle works.", "Describe a journey across the Sahara desert.",
        "Write a long story about a lighthouse keeper.", "Explain how vaccines train the immune system.",
        "Describe the water cycle in detail."]


def workload(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prompts = [rng.choice(SHORT) if rng.random() < 0.6 else rng.choice(LONG) for _ in range(count)]
    return [{"id": f"q{i}", "prompt": prompt} for i, prompt in enumerate(prompts)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(name: str, first: dict[str, float], done: dict[str, float], tokens: dict[str, int],
            sent: dict[str, float], short_ids: set[str]) -> dict:
    ttft = [first[k] - sent[k] for k in done]
    latency = [done[k] - sent[k] for k in done]
    wall = max(done.values()) - min(sent.values()) if done else float("nan")
    return {"name": name, "n": len(done), "ttft_p50": percentile(ttft, 0.5), "ttft_p90": percentile(ttft, 0.9),
            "lat_p50": percentile(latency, 0.5), "lat_p90": percentile(latency, 0.9),
            "tok_s": sum(tokens.values()) / wall if wall else float("nan"),
            "short_ttft_p50": statistics.median(
                [first[k] - sent[k] for k in done if k in short_ids] or [float("nan")])}


def short_ids(prompts: list[dict]) -> set[str]:
    return {p["id"] for p in prompts if p["prompt"] in SHORT}


# ---------------------------------------------------------------- raw vLLM

async def raw_vllm(base_url: str, model: str, prompts: list[dict], max_tokens: int) -> dict:
    sent, first, done, tokens = {}, {}, {}, {}

    async def one(session: aiohttp.ClientSession, item: dict) -> None:
        sent[item["id"]] = time.time()
        payload = {"model": model, "prompt": item["prompt"], "max_tokens": max_tokens, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{base_url}/v1/completions", json=payload) as response:
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("choices") and event["choices"][0].get("text") and item["id"] not in first:
                    first[item["id"]] = time.time()
                if event.get("usage"):
                    tokens[item["id"]] = event["usage"]["completion_tokens"]
        done[item["id"]] = time.time()
        first.setdefault(item["id"], done[item["id"]])

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, item) for item in prompts))
    return summary("raw vLLM (stream)", first, done, tokens, sent, short_ids(prompts))


# ---------------------------------------------------------------- this template

def our_pipeline(emulator: PubSubEmulator, base_url: str, prompts: list[dict], max_tokens: int) -> dict:
    run = LocalRun([f"--server_url={base_url}", "--prompt_format=completion", "--num_shards=4",
                    f"--default_max_tokens={max_tokens}"],
                   log_path=REPO_ROOT / ".cache" / "bench" / "pipeline.log", emulator=emulator).start()
    collector = run.collector()
    try:
        run.publish([{"id": "warm-up", "prompt": "Hi", "max_tokens": 1}])
        if collector.wait_for(["warm-up"], 120):
            raise RuntimeError("pipeline did not answer the warm-up:\n" + run.log_tail())
        collector.clear()
        sent = {}
        for item in prompts:
            sent[item["id"]] = time.time()
            run.publish([{**item, "temperature": 0, "max_tokens": max_tokens}])
        missing = collector.wait_for([p["id"] for p in prompts], 300)
        if missing:
            raise RuntimeError(f"no outcome for {missing}")
        time.sleep(0.5)
        first: dict[str, float] = {}
        for chunk in collector.chunks:
            if chunk.data["text"]:
                first[chunk.data["id"]] = min(first.get(chunk.data["id"], chunk.at), chunk.at)
        done = {c.data["id"]: c.at for c in collector.completions}
        for key in done:
            first.setdefault(key, done[key])
        tokens = {c.data["id"]: c.data["usage"]["completion_tokens"] for c in collector.completions}
        # Only requests that produced text have a first token (over the completions API some short
        # questions get an empty answer).
        records = {c.data["id"]: c.data for c in collector.completions if c.data["time_to_first_token_ms"]}
        intake = [records[k]["received_at"] - sent[k] for k in records]
        engine = [records[k]["time_to_first_token_ms"] / 1000 for k in records]
        delivery = [first[k] - records[k]["received_at"] - records[k]["time_to_first_token_ms"] / 1000
                    for k in records]
        print(f"  this template, first token p50 split: publish to pipeline intake {statistics.median(intake):.2f} s, "
              f"intake to first token {statistics.median(engine):.2f} s, "
              f"first token to the subscriber {statistics.median(delivery):.2f} s", flush=True)
        return summary("this template (DirectRunner)", first, done, tokens, sent, short_ids(prompts))
    finally:
        collector.stop()
        run.stop()


# ---------------------------------------------------------------- Beam's handler

class _SharedServer:
    """What Beam's handler gets from load_model: the address of the shared server."""

    def __init__(self, port: int) -> None:
        self._port = port

    def get_server_port(self) -> int:
        return self._port

    def check_connectivity(self) -> None:
        pass


class _HandlerOnSharedServer(VLLMCompletionsModelHandler):
    """Beam's handler unchanged except that it uses the benchmark's server instead of starting one."""

    def __init__(self, model_name: str, port: int) -> None:
        super().__init__(model_name)
        self._shared_port = port

    def load_model(self) -> _SharedServer:
        return _SharedServer(self._shared_port)


def beam_handler(emulator: PubSubEmulator, port: int, model: str, prompts: list[dict], max_tokens: int) -> dict:
    tag = f"beam{int(time.time())}"
    emulator.create_topic(f"{tag}-in", subscription=f"{tag}-in-sub")
    emulator.create_topic(f"{tag}-out", subscription=f"{tag}-out-sub")
    options = PipelineOptions(flags=[], runner="BundleBasedDirectRunner")
    options.view_as(StandardOptions).streaming = True
    apply_local_runner_fixes()
    pipeline = beam.Pipeline(options=options)
    (pipeline
     | ReadFromPubSub(subscription=emulator.subscription(f"{tag}-in-sub"))
     | beam.Map(lambda data: (json.loads(data)["id"], json.loads(data)["prompt"]))
     | RunInference(KeyedModelHandler(_HandlerOnSharedServer(model, port)),
                    inference_args={"max_tokens": max_tokens, "temperature": 0})
     | beam.Map(lambda kv: {"id": kv[0], "text": kv[1].inference.choices[0].text,
                            "tokens": kv[1].inference.usage.completion_tokens})
     | PublishJson(emulator.topic(f"{tag}-out")))
    result = pipeline.run()
    from google.cloud import pubsub_v1

    received: dict[str, tuple[float, int]] = {}
    lock = threading.Lock()

    def on_message(message) -> None:
        data = json.loads(message.data)
        with lock:
            received[data["id"]] = (time.time(), data["tokens"])
        message.ack()

    subscriber = pubsub_v1.SubscriberClient()
    future = subscriber.subscribe(emulator.subscription(f"{tag}-out-sub"), callback=on_message)
    publisher = pubsub_v1.PublisherClient()
    try:
        publisher.publish(emulator.topic(f"{tag}-in"), json.dumps({"id": "warm-up", "prompt": "Hi"}).encode()).result()
        deadline = time.time() + 120
        while "warm-up" not in received and time.time() < deadline:
            time.sleep(0.1)
        sent = {}
        for item in prompts:
            sent[item["id"]] = time.time()
            publisher.publish(emulator.topic(f"{tag}-in"), json.dumps(item).encode())
        deadline = time.time() + 300
        while len(set(sent) & set(received)) < len(sent) and time.time() < deadline:
            time.sleep(0.1)
        done = {k: received[k][0] for k in sent if k in received}
        tokens = {k: received[k][1] for k in done}
        return summary("Beam RunInference + vLLM handler", dict(done), done, tokens, sent, short_ids(prompts))
    finally:
        future.cancel()
        subscriber.close()
        threading.Thread(target=result.cancel, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    prompts = workload(args.requests, args.seed)
    checkpoint = ensure_local_checkpoint()
    print("starting the shared vLLM server ...", flush=True)
    server = VLLMServer(ServerSpec(model=str(checkpoint), dtype="bfloat16", served_model_name="smollm2",
                                   extra_args=("--enforce-eager",), start_timeout_s=900)).start()
    rows = []
    try:
        with PubSubEmulator() as emulator:
            emulator.activate()
            print("raw vLLM ...", flush=True)
            rows.append(asyncio.run(raw_vllm(server.base_url, "smollm2", prompts, args.max_tokens)))
            print("this template ...", flush=True)
            rows.append(our_pipeline(emulator, server.base_url, prompts, args.max_tokens))
            print("Beam's handler ...", flush=True)
            rows.append(beam_handler(emulator, server.port, "smollm2", prompts, args.max_tokens))
    finally:
        server.stop()
    print(f"\n{args.requests} prompts ({len(short_ids(prompts))} short questions, the rest long requests), all sent at once, "
          f"max_tokens {args.max_tokens}, temperature 0, seed {args.seed}; one vLLM server (CPU), 2 cores")
    print(f"{'':34} {'first token p50':>15} {'p90':>7} {'short q. p50':>12} {'done p50':>9} {'p90':>7} {'tok/s':>7}")
    for r in rows:
        print(f"{r['name']:34} {r['ttft_p50']:>13.2f} s {r['ttft_p90']:>5.2f} s {r['short_ttft_p50']:>10.2f} s "
              f"{r['lat_p50']:>7.2f} s {r['lat_p90']:>5.2f} s {r['tok_s']:>7.1f}"
              + ("" if r["n"] == args.requests else f"  (only {r['n']} finished)"))
    raw, ours, beam_row = rows
    print(f"\nfirst token p50: Beam's handler / this template = {beam_row['ttft_p50'] / ours['ttft_p50']:.1f}x; "
          f"this template / raw vLLM = {ours['ttft_p50'] / raw['ttft_p50']:.1f}x")
    print(f"short questions' first token p50: Beam's handler / this template = "
          f"{beam_row['short_ttft_p50'] / ours['short_ttft_p50']:.1f}x")
    print(f"throughput: this template / raw vLLM = {ours['tok_s'] / raw['tok_s']:.2f}; "
          f"this template / Beam's handler = {ours['tok_s'] / beam_row['tok_s']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
