"""``make bench-engine-cost``: what the engine costs a worker per token, apart from the DirectRunner.

On Dataflow the DirectRunner's machinery does not run. What runs on every
GPU worker is the engine (:func:`~pipeline.engines.vllm_engine.vllm_engine`: the
server-sent-event client, chunk assembly, the chunk publisher, submit and
poll) and the vLLM server's API front end, which turns generated tokens into
HTTP events. This drives the real engine directly, as the generate step does
(submit, then poll every half chunk interval), against the same server and
prompts as a raw asyncio client, in one run: the engine with vLLM's
``stream_interval`` (what it sends), with its chunks handed back through
``poll`` and published to the Pub/Sub emulator; the raw client per token and
at the same interval.

    python -m benchmarks.engine_cost [--reps 3] [--requests 48] [--max-tokens 96]

Cores isolated as in ``make bench``: the server on its own core (a GPU
worker's shape), this process and the emulator on the rest. Fixed answer
lengths, so every system generates the same tokens (checked). Figures only;
nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import platform
import threading
import time
from datetime import UTC, datetime

from benchmarks.side_by_side import workload
from benchmarks.side_by_side.cores import plans
from benchmarks.side_by_side.report import fmt, work_note
from benchmarks.side_by_side.server import BenchServer
from benchmarks.side_by_side.stats import RequestTiming, RunResult, Spread, ratio, summarize
from benchmarks.side_by_side.systems import RawVLLM
from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.emulators import PubSubEmulator
from local.engine_driver import drive_to_end
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.engines.accelerator_time import BusyShares
from pipeline.engines.engine import COMPLETION, Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.generation.generate import template_poll_interval_ms

CHUNKS = ChunkPolicy()  # the template's defaults: chunk_tokens 8, interval 200 ms
POLL_S = template_poll_interval_ms(CHUNKS.interval_ms) / 1000  # the generate step's polling cadence
RAW_PER_TOKEN = "raw client, every token"
COST_RECORD_ANSWERS = 20_000  # answers the cost record is timed over, per engine run


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    engine: bool
    per_token: bool  # the raw client only: the engine always asks for stream_interval
    publish: bool = False


VARIANTS = (
    Variant(RAW_PER_TOKEN, engine=False, per_token=True),
    Variant(f"raw client, stream_interval {CHUNKS.chunk_tokens}", engine=False, per_token=False),
    Variant(f"engine, stream_interval {CHUNKS.chunk_tokens}", engine=True, per_token=False),
    Variant(f"engine, stream_interval {CHUNKS.chunk_tokens}, publishing", engine=True, per_token=False, publish=True),
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One variant, one repetition: ``make bench``'s run record, plus the server's API process on its own."""

    result: RunResult  # cpu_s: this process (the client, or the engine's loop, publisher and polling caller);
    # model_cpu_s: the server's process tree (on this CPU, mostly the model's compute)
    front_end_cpu_s: float  # the server's API process alone: HTTP, (de)tokenizing, one event per stream_interval
    cost_record_cpu_s: float = math.nan  # what the engine's cost record took for this run's answers (engines only)

    def figures(self) -> dict[str, float]:
        figures, per_1k = summarize(self.result), 1000 / self.result.output_tokens
        return {**figures, "server_cpu_per_1k": self.result.model_cpu_s * per_1k,
                "front_end_cpu_per_1k": self.front_end_cpu_s * per_1k,
                "cost_record_cpu_per_1k": self.cost_record_cpu_s * per_1k}


def drive_engine(engine: Engine, prompts: list[workload.Prompt], max_tokens: int,
                 tag: str, adapters: tuple[str | None, ...] = (None,)) -> list[RequestTiming]:
    """Submits every prompt at once and polls like the generate step until each has its completion.

    The prompts name ``adapters`` in turn (LoRA adapters the server serves; None for the model itself).
    """
    requests = [InferenceRequest(id=f"{tag}-{p.id}", prompt=p.prompt, max_tokens=p.budget(max_tokens),
                                 min_tokens=p.min_tokens(max_tokens), temperature=0,
                                 adapter=adapters[index % len(adapters)], received_at=time.time())
                for index, p in enumerate(prompts)]
    kinds = {f"{tag}-{p.id}": p.kind for p in prompts}
    if engine.settings.max_in_flight < len(requests):
        raise RuntimeError("the engine would refuse requests: raise max_in_flight")
    drive = drive_to_end(engine, requests, timeout_s=900, poll_s=POLL_S)
    if drive.dead_letters():
        raise RuntimeError(f"dead letter: {str(drive.dead_letters()[0])[:300]}")
    timings = []
    for request in requests:
        (record,) = [record for kind, record in drive.outputs[request.id] if kind == COMPLETION]
        first = request.received_at + (record["time_to_first_token_ms"] or 0) / 1000
        timings.append(RequestTiming(request.id, kinds[request.id], request.received_at, first,
                                     drive.finished_at[request.id], record["usage"]["completion_tokens"]))
    return timings


def cost_record_cpu_s(answers: int, together: int) -> float:
    """CPU seconds the record of what each answer cost takes for ``answers`` answers, ``together`` running at
    once: the calls the engine makes per attempt (one begin, one end on the busy-time ledger,
    :mod:`pipeline.engines.accelerator_time`, under a lock and on the monotonic clock, as the engine takes them)."""
    shares, lock = BusyShares(), threading.Lock()
    keys = [f"cost-{i}" for i in range(answers)]
    started = time.process_time()
    for first in range(0, answers, together):
        group = keys[first:first + together]
        for key in group:
            with lock:
                shares.begin(key, time.monotonic())
        for key in group:
            with lock:
                shares.end(key, time.monotonic())
    return time.process_time() - started


def measure(variant: Variant, server: BenchServer, emulator: PubSubEmulator, topic: str,
            prompts: list[workload.Prompt], args: argparse.Namespace, rep: int) -> Run:
    engine = None
    if variant.engine:
        engine = vllm_engine(EngineSettings(
            server=None, server_url=server.base_url, served_model_name=server.model, prompt_format="completion",
            chunk_policy=CHUNKS, max_in_flight=len(prompts) + 1, chunk_topic=topic if variant.publish else None,
            chunks_to_pipeline=not variant.publish))
        drive_engine(engine, prompts[:1], args.max_tokens, f"warm-{rep}-{variant.name}")  # the session, the pool
    client = RawVLLM(server.base_url, server.model, args.max_tokens,
                     stream_interval=None if variant.per_token else CHUNKS.chunk_tokens)
    cpu, server_cpu, front_end_cpu = time.process_time(), server.cpu_seconds(), server.front_end_cpu_seconds()
    try:
        if engine is not None:
            timings = drive_engine(engine, prompts, args.max_tokens, f"r{rep}-{variant.name}")
        else:
            timings = client.run(prompts, [0.0] * len(prompts), shape="burst", rep=rep, cores="isolated",
                                 progress=lambda done, total: None).timings
        cpu = time.process_time() - cpu
        server_cpu = server.cpu_seconds() - server_cpu
        front_end_cpu = server.front_end_cpu_seconds() - front_end_cpu
        record = math.nan
        if engine is not None:  # timed over many answers, scaled to this run's
            record = cost_record_cpu_s(COST_RECORD_ANSWERS, len(prompts)) * len(prompts) / COST_RECORD_ANSWERS
    finally:
        if engine is not None:
            engine.close()
    return Run(RunResult(variant.name, "burst", rep, "isolated", timings, len(prompts), cpu_s=cpu,
                         model_cpu_s=server_cpu, requested_tokens=workload.requested_tokens(prompts, args.max_tokens)),
               front_end_cpu, record)


def report(runs: list[Run], context: str) -> str:
    by_variant: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        by_variant.setdefault(run.result.system, []).append(run.figures())
    spreads = {name: {key: Spread.of(f[key] for f in figures) for key in figures[0]}
               for name, figures in by_variant.items()}
    lines = [context, "", work_note([run.result for run in runs], "isolated", "burst"), "",
             "| system | tokens/s | first chunk p50 / p95 (s) | CPU s / 1k tokens, this process | "
             "server CPU s / 1k tokens: whole / API process |", "|---|---|---|---|---|"]
    for name, figures in spreads.items():
        lines.append(f"| {name} | {fmt(figures['tok_s'])} | {fmt(figures['first_p50'])} / {fmt(figures['first_p95'])} "
                     f"| {fmt(figures['cpu_s_per_1k_tokens'])} | {fmt(figures['server_cpu_per_1k'])} / "
                     f"{fmt(figures['front_end_cpu_per_1k'])} |")
    raw = spreads.get(RAW_PER_TOKEN)
    if raw is not None:
        lines += ["", f"Against the {RAW_PER_TOKEN} (targets for the engine without publishing: its CPU ≤ 2×, the "
                      "server's ≤ 1×, tokens/s ≥ 0.98×):"]
        for name, figures in spreads.items():
            if name != RAW_PER_TOKEN:
                cpu = ratio(figures['cpu_s_per_1k_tokens'], raw['cpu_s_per_1k_tokens'])
                lines.append(f"- {name}: CPU {cpu:.2f}×, server CPU "
                             f"{ratio(figures['server_cpu_per_1k'], raw['server_cpu_per_1k']):.2f}× (API process "
                             f"{ratio(figures['front_end_cpu_per_1k'], raw['front_end_cpu_per_1k']):.2f}×), tokens/s "
                             f"{ratio(figures['tok_s'], raw['tok_s']):.2f}×")
    lines += ["", "The cost record (each answer's queue time and share of the model's busy time: one begin and one "
                  "end an attempt on the busy-time ledger, under a lock as the engine takes it), timed after each "
                  "engine run:"]
    for name, figures in spreads.items():
        record = figures["cost_record_cpu_per_1k"]
        if record.count:
            lines.append(f"- {name}: {record.median * 1000:.2f} CPU-ms / 1k tokens, "
                         f"{100 * ratio(record, figures['cpu_s_per_1k_tokens']):.2f} % of the engine's CPU per token")
    return "\n".join(lines)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_burst_arguments(parser: argparse.ArgumentParser, *, requests: int) -> None:
    """The burst an engine benchmark drives: repetitions, prompts of the mixed workload, fixed answer length."""
    parser.add_argument("--reps", type=_at_least_one, default=3, help="repetitions of every system, interleaved")
    parser.add_argument("--requests", type=_at_least_one, default=requests,
                        help="prompts in the burst (the mixed workload)")
    parser.add_argument("--max-tokens", type=_at_least_one, default=96, help="every answer's fixed length")
    parser.add_argument("--seed", type=int, default=11)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_cost", description=__doc__.splitlines()[0])
    add_burst_arguments(parser, requests=48)
    parser.add_argument("--model", help="model for the server (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=LOCAL_SERVER.dtype)
    parser.add_argument("--vllm-args", default=" ".join(LOCAL_SERVER.vllm_args))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    apply_server_environment()
    prompts = workload.with_lengths(workload.mixed(args.requests, args.seed), workload.FIXED)
    (plan,) = plans(["isolated"])
    runs: list[Run] = []
    with PubSubEmulator() as emulator:
        emulator.activate()
        name = f"engine-cost-chunks-{os.getpid()}"
        emulator.create_topic(name, subscription=f"{name}-sub")  # chunks kept, as a subscribed topic keeps them
        with BenchServer(plan, model=args.model, dtype=args.dtype, vllm_args=args.vllm_args) as server:
            print("warming the server with one untimed burst", flush=True)
            RawVLLM(server.base_url, server.model, args.max_tokens).run(
                prompts, [0.0] * len(prompts), shape="burst", rep=0, cores="isolated",
                progress=lambda done, total: None)
            for rep in range(1, args.reps + 1):
                turn = rep % len(VARIANTS)
                for variant in VARIANTS[turn:] + VARIANTS[:turn]:  # a different order each repetition
                    runs.append(measure(variant, server, emulator, emulator.topic(name), prompts, args, rep))
                    print(f"rep {rep}/{args.reps} · {variant.name}: {runs[-1].figures()['tok_s']:.0f} tokens/s",
                          flush=True)
    context = (f"`make bench-engine-cost`, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
               f"{os.cpu_count()} cores ({plan.describe()}); a burst of {len(prompts)} mixed prompts, every answer "
               f"{args.max_tokens} tokens; chunk policy {CHUNKS.chunk_tokens} tokens / {CHUNKS.interval_ms:g} ms, "
               f"polled every {POLL_S * 1000:.0f} ms; {args.reps} interleaved repetitions, medians (range).")
    print(report(runs, context))


if __name__ == "__main__":
    main()
