"""``make bench-lora``: what serving LoRA adapters costs, against the model alone.

Two servers of the same model, started the way the template starts them: one
alone, one with four adapters (``--enable-lora``, the template's
``lora_adapters``; untrained, random, rank 8, built here with peft). The real
engine (:func:`~pipeline.engines.vllm_engine.vllm_engine`) drives each with the
same burst of mixed prompts, polled as the generate step polls, and the
prompts name no adapter, one, or four in turn:

- **model alone**: the server without LoRA, the floor;
- **LoRA server, 0 adapters**: every request for the model itself (what
  enabling LoRA costs a stream that uses none);
- **LoRA server, 1 adapter** and **4 adapters**: every request names one.

    python -m benchmarks.lora [--reps 3] [--requests 32] [--max-tokens 96]

Cores isolated as in ``make bench`` (both servers on the server's core, one
busy at a time); fixed answer lengths, so every system generates the same
tokens (checked); three interleaved repetitions, medians and ranges. Figures
only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import time
from contextlib import ExitStack
from datetime import UTC, datetime

from benchmarks.engine_cost import CHUNKS, POLL_S, add_burst_arguments, drive_engine
from benchmarks.side_by_side import workload
from benchmarks.side_by_side.cores import plans
from benchmarks.side_by_side.report import fmt, work_note
from benchmarks.side_by_side.server import BenchServer
from benchmarks.side_by_side.stats import RunResult, Spread, ratio, summarize
from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from local.toy_adapters import build_adapter
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.serving.lora_adapters import Adapter
from pipeline.serving.model_weights import cache_root

ADAPTERS = 4
RANK = 8
ALONE = "model alone"


@dataclasses.dataclass(frozen=True)
class Mix:
    name: str
    lora_server: bool
    adapters: tuple[str | None, ...]  # named by the prompts in turn; None: the model itself


MIXES = (
    Mix(ALONE, lora_server=False, adapters=(None,)),
    Mix("LoRA server, 0 adapters", lora_server=True, adapters=(None,)),
    Mix("LoRA server, 1 adapter", lora_server=True, adapters=("adapter-0",)),
    Mix(f"LoRA server, {ADAPTERS} adapters", lora_server=True,
        adapters=tuple(f"adapter-{i}" for i in range(ADAPTERS))),
)


def bench_adapters(checkpoint) -> tuple[Adapter, ...]:
    """The benchmark's untrained adapters, built once into the cache (seeded: the same every time)."""
    folder = cache_root() / "bench-lora-adapters"
    adapters = []
    for index in range(ADAPTERS):
        target = folder / f"adapter-{index}"
        if not (target / "adapter_config.json").is_file():
            print(f"building adapter-{index} with peft (rank {RANK}, untrained)", flush=True)
            build_adapter(checkpoint, target, rank=RANK, seed=index)
        adapters.append(Adapter(f"adapter-{index}", str(target)))
    return tuple(adapters)


def measure(mix: Mix, server: BenchServer, prompts: list[workload.Prompt], max_tokens: int, rep: int) -> RunResult:
    engine = vllm_engine(EngineSettings(
        server=None, server_url=server.base_url, served_model_name=server.model, prompt_format="completion",
        chunk_policy=CHUNKS, max_in_flight=len(prompts) + 1))
    try:
        drive_engine(engine, prompts[:1], max_tokens, f"warm-{rep}-{mix.name}", mix.adapters)  # session, pool
        cpu = time.process_time()
        timings = drive_engine(engine, prompts, max_tokens, f"r{rep}-{mix.name}", mix.adapters)
        cpu = time.process_time() - cpu
    finally:
        engine.close()
    return RunResult(mix.name, "burst", rep, "isolated", timings, len(prompts), cpu_s=cpu,
                     requested_tokens=workload.requested_tokens(prompts, max_tokens))


def report(runs: list[RunResult], context: str) -> str:
    by_mix: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        by_mix.setdefault(run.system, []).append(summarize(run))
    spreads = {mix.name: {key: Spread.of(f[key] for f in by_mix[mix.name]) for key in by_mix[mix.name][0]}
               for mix in MIXES if mix.name in by_mix}
    alone = spreads[ALONE]
    lines = [context, "", work_note(runs, "isolated", "burst"), "",
             "| mix | tokens/s | against the model alone | first chunk p50 / p95 (s) |", "|---|---|---|---|"]
    for name, figures in spreads.items():
        lines.append(f"| {name} | {fmt(figures['tok_s'])} | {ratio(figures['tok_s'], alone['tok_s']):.2f}× | "
                     f"{fmt(figures['first_p50'])} / {fmt(figures['first_p95'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.splitlines()[0])
    add_burst_arguments(parser, requests=32)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    apply_server_environment()
    checkpoint = ensure_local_checkpoint()
    adapters = bench_adapters(checkpoint)
    prompts = workload.with_lengths(workload.mixed(args.requests, args.seed), workload.FIXED)
    (plan,) = plans(["isolated"])
    runs: list[RunResult] = []
    with ExitStack() as stack:
        common = dict(model=str(checkpoint), dtype=LOCAL_SERVER.dtype, vllm_args=" ".join(LOCAL_SERVER.vllm_args))
        print("starting the model alone, and the model with LoRA adapters", flush=True)
        servers = {False: stack.enter_context(BenchServer(plan, **common)),
                   True: stack.enter_context(BenchServer(plan, **common, adapters=adapters, max_lora_rank=RANK))}
        for lora, server in servers.items():
            print(f"server {'with' if lora else 'without'} LoRA started in {server.start_s:.0f} s; warming it",
                  flush=True)
            measure(MIXES[3 if lora else 0], server, prompts, args.max_tokens, rep=0)
        for rep in range(1, args.reps + 1):
            turn = rep % len(MIXES)
            for mix in MIXES[turn:] + MIXES[:turn]:  # a different order each repetition
                runs.append(measure(mix, servers[mix.lora_server], prompts, args.max_tokens, rep))
                print(f"rep {rep}/{args.reps} · {mix.name}: {summarize(runs[-1])['tok_s']:.0f} tokens/s", flush=True)
    context = (f"`make bench-lora`, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
               f"{os.cpu_count()} cores ({plan.describe()}); {ADAPTERS} untrained rank-{RANK} adapters; a burst of "
               f"{len(prompts)} mixed prompts through the engine, every answer {args.max_tokens} tokens, polled every "
               f"{POLL_S * 1000:.0f} ms; {args.reps} interleaved repetitions, medians (range).")
    print(report(runs, context))


if __name__ == "__main__":
    main()
