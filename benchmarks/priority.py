"""Does sending short prompts first help? vLLM priority scheduling on a saturated server.

One vLLM server started with ``--scheduling-policy priority`` and few
sequence slots (so requests queue), a seeded mix of short questions and long
documents, all sent at once, twice: every request at the same priority (first
come, first served) and with priority by prompt length (shorter first, as
length buckets would send them). Printed: mean and p50 time to first token,
overall and per kind, and the ratio. Figures only; nothing is asserted.

    python -m benchmarks.priority [--requests 40] [--max-num-seqs 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time

import aiohttp

from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from pipeline.contract.keying import bucket_index
from pipeline.flow.batching import default_boundaries
from pipeline.intake.prompt_length import estimate_tokens
from pipeline.serving.vllm_server import ServerSpec, VLLMServer

SHORT = ["What is the capital of France?", "Name a primary color.", "What is 7 times 8?", "What do bees make?"]
PARAGRAPH = ("The river wound through the valley, past farms and mills, carrying boats of grain to the towns "
             "downstream, where merchants weighed it, argued over prices and loaded it onto carts. ")


def workload(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for index in range(count):
        if rng.random() < 0.6:
            prompt = rng.choice(SHORT)
        else:
            prompt = PARAGRAPH * rng.randint(20, 45) + "\nSummarize the text above in one sentence."
        items.append({"id": f"p{index}", "prompt": prompt, "long": len(prompt) > 200})
    return items


async def run(base_url: str, items: list[dict], by_length: bool) -> dict[str, float]:
    boundaries = default_boundaries(2048)
    ttft: dict[str, float] = {}

    async def one(session: aiohttp.ClientSession, item: dict) -> None:
        priority = 0
        if by_length:  # the length bucket, as the template's buckets would order them
            priority = bucket_index(boundaries, estimate_tokens(item["prompt"]))
        payload = {"model": "smollm2", "messages": [{"role": "user", "content": item["prompt"]}],
                   "max_tokens": 24, "temperature": 0, "stream": True, "priority": priority}
        started = time.time()
        async with session.post(f"{base_url}/v1/chat/completions", json=payload) as response:
            if response.status != 200:
                raise RuntimeError(await response.text())
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    event = json.loads(line[5:])
                    if event["choices"] and event["choices"][0]["delta"].get("content"):
                        ttft.setdefault(item["id"], time.time() - started)
        ttft.setdefault(item["id"], time.time() - started)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, item) for item in items))
    return ttft


def describe(ttft: dict[str, float], items: list[dict]) -> str:
    short = [ttft[i["id"]] for i in items if not i["long"]]
    long = [ttft[i["id"]] for i in items if i["long"]]
    every = list(ttft.values())
    return (f"mean {statistics.mean(every):6.2f} s  p50 {statistics.median(every):6.2f} s  "
            f"short mean {statistics.mean(short):6.2f} s  long mean {statistics.mean(long):6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    apply_server_environment()
    items = workload(args.requests, args.seed)
    server = VLLMServer(ServerSpec(
        model=str(ensure_local_checkpoint()), dtype=LOCAL_SERVER.dtype, served_model_name="smollm2",
        extra_args=(*LOCAL_SERVER.vllm_args, "--scheduling-policy", "priority", "--max-num-seqs",
                    str(args.max_num_seqs)))).start()
    try:
        asyncio.run(run(server.base_url, items[:4], by_length=False))  # warm-up
        results = {}
        for label, by_length in (("same priority (FCFS)", False), ("shorter prompts first", True),
                                 ("same priority (FCFS), again", False), ("shorter prompts first, again", True)):
            results[label] = asyncio.run(run(server.base_url, items, by_length))
    finally:
        server.stop()
    longs = sum(i["long"] for i in items)
    print(f"\n{len(items)} requests ({len(items) - longs} short questions, {longs} documents of ~600-1400 tokens), "
          f"all at once; max-num-seqs {args.max_num_seqs}, max_tokens 24")
    for label, ttft in results.items():
        print(f"{label:30} {describe(ttft, items)}")
    fcfs = statistics.mean(statistics.mean(results[k].values()) for k in results if "FCFS" in k)
    prio = statistics.mean(statistics.mean(results[k].values()) for k in results if "first" in k)
    print(f"\nmean time to first token, shorter-first ÷ FCFS: {prio / fcfs:.2f}")


if __name__ == "__main__":
    main()
