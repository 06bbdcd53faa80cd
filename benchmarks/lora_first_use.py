"""``make bench-lora-first-use``: what a request pays for naming a root adapter its worker has not loaded.

One managed vLLM, started the way the template starts it with ``lora_adapter_root`` (a folder of the
benchmark's untrained rank-8 adapters, ``max_loras=1``: one slot for the root), driven by the real engine
(:func:`~pipeline.engines.vllm_engine.vllm_engine`) one request at a time. Two adapters alternate, so every
switch unloads the other: the first request after a switch pays the load (from the worker's copy on disk, as
after an eviction), the second finds it loaded. The very first use of each also copies and checks it; it is
reported on its own line. Time to first chunk from the request's submission; cores isolated as in
``make bench``; fixed answer lengths; medians (range) over ``--reps`` alternations. Figures only.

    python -m benchmarks.lora_first_use [--reps 5] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shlex
import statistics
from datetime import UTC, datetime

from benchmarks.engine_cost import drive_engine
from benchmarks.lora import RANK, bench_adapters
from benchmarks.side_by_side import workload
from benchmarks.side_by_side.cores import plans
from local.core_placement import keep_off
from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from pipeline.contract.chunking import ChunkPolicy
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.serving.adapter_root import AdapterRoot
from pipeline.serving.vllm_server import ServerSpec

PAIR = ("adapter-0", "adapter-1")


def first_chunk_s(engine: Engine, prompt: workload.Prompt, max_tokens: int, tag: str,
                  adapter: str | None) -> float:
    (timing,) = drive_engine(engine, [prompt], max_tokens, tag, (adapter,))
    return timing.first - timing.sent


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_first_use", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="alternations between the two adapters")
    parser.add_argument("--max-tokens", type=int, default=16, help="every answer's fixed length")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    apply_server_environment()
    checkpoint = ensure_local_checkpoint()
    folder = os.path.dirname(bench_adapters(checkpoint)[0].location)
    (plan,) = plans(["isolated"])
    spec = ServerSpec(model=str(checkpoint), dtype=LOCAL_SERVER.dtype, served_model_name="smollm2",
                      extra_args=tuple(shlex.split(" ".join(LOCAL_SERVER.vllm_args))), start_timeout_s=1800,
                      adapter_root=AdapterRoot(folder), max_lora_rank=RANK, max_loras=1)
    saved = dict(os.environ)
    os.environ.update(plan.server_env())
    os.sched_setaffinity(0, plan.server)  # the server inherits these cores
    print("starting vLLM with a root of adapters", flush=True)
    try:
        engine = vllm_engine(EngineSettings(server=spec, prompt_format="completion", max_in_flight=4,
                                           chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=50)))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    os.sched_setaffinity(0, plan.server | plan.clients)
    keep_off(plan.server)  # this process's threads to the clients' cores; vLLM, in a session of its own, stays
    (prompt,) = workload.with_lengths(workload.mixed(1, 11), workload.FIXED)
    first_ever: list[float] = []
    after_switch: list[float] = []
    loaded: list[float] = []
    try:
        first_chunk_s(engine, prompt, args.max_tokens, "warm", None)  # session and pool, no adapter
        for rep in range(args.reps + 1):
            for adapter in PAIR:
                cold = first_chunk_s(engine, prompt, args.max_tokens, f"c{rep}-{adapter}", adapter)
                (first_ever if rep == 0 else after_switch).append(cold)
                loaded.append(first_chunk_s(engine, prompt, args.max_tokens, f"w{rep}-{adapter}", adapter))
                print(f"rep {rep} · {adapter}: {cold:.3f} s unloaded, {loaded[-1]:.3f} s loaded", flush=True)
    finally:
        engine.close()
    print(f"`make bench-lora-first-use`, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} cores ({plan.describe()}); untrained rank-{RANK} adapters, max_loras=1, one request at a "
          f"time, {args.max_tokens} tokens each; time to first chunk in seconds, median (range).\n")
    print("| request | first chunk (s) |\n|---|---|")
    print(f"| the adapter's first use on the worker (copy, check, load) | {spread(first_ever)} |")
    print(f"| after a switch unloaded it (load) | {spread(after_switch)} |")
    print(f"| loaded | {spread(loaded)} |")
    print(f"\nA load costs {statistics.median(after_switch) - statistics.median(loaded):.3f} s of first chunk "
          f"(median against median; {len(after_switch)} loads, {len(loaded)} loaded requests).")


if __name__ == "__main__":
    main()
