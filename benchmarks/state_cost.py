"""What the generate step costs Streaming Engine: timer firings and state writes, measured on the real step.

Streaming Engine bills and limits by the state a job reads and writes and the
timers it fires; ``make bench-scale`` projects those for a whole job. This
benchmark measures the per-key figures it needs, on the real generate DoFn
and the real engine against the local vLLM, under the runner stand-in of
:mod:`local.runner_semantics` (firing each poll timer when it is due, as
Dataflow would):

- a key **streaming**: requests in flight, polled at the template's default
  cadence, chunks passing through the poll;
- a key whose requests only **wait** for room while the engine is full.

Prints timer firings, state writes (adds, writes, clears, timer settings) and
bytes written per second for the streaming key, per firing for the waiting
one, and per request submitted. ``python -m benchmarks.state_cost``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from local.runner_semantics import Driver, KeyState, Worker, generate_fn, in_process
from pipeline.config.settings import JobSettings
from pipeline.contract.messages import InferenceRequest
from pipeline.engines.engine import Engine
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.generation.generate import template_poll_interval_ms
from pipeline.generation.key_events import WAITING_POLL_CAP_S

IN_FLIGHT = 3


@dataclass
class Phase:
    firings: int = 0
    writes: int = 0
    bytes: int = 0

    def add(self, state: KeyState) -> None:
        self.firings += 1
        self.writes += state.writes
        self.bytes += state.bytes_written


def template_engine() -> tuple[Engine, float]:
    """The engine the template builds for the local model (its own managed server), and its poll cadence."""
    settings = JobSettings.from_mapping({
        "input_subscription": "projects/local-project/subscriptions/unused",
        "output_completions_topic": "projects/local-project/topics/unused",
        "dead_letter_topic": "projects/local-project/topics/unused", "model": str(ensure_local_checkpoint()),
        "served_model_name": "smollm2", "dtype": LOCAL_SERVER.dtype, "vllm_args": " ".join(LOCAL_SERVER.vllm_args),
        "max_in_flight": IN_FLIGHT, "server_start_timeout_s": 900}).engine
    return vllm_engine(settings), template_poll_interval_ms(settings.chunk_policy.interval_ms)


def measure(engine: Engine, poll_ms: float, max_tokens: int) -> dict:
    """Fires the keys' timers when due until every request ended; per-key costs by phase."""
    dofn = generate_fn(in_process(engine, "state-cost"), poll_ms, dedupe_window_s=600)
    driver = Driver([Worker("w", dofn, engine)])
    stamp = time.time()
    busy = [InferenceRequest(id=f"busy-{stamp}-{i}", prompt="Count from 1 to 300.", max_tokens=max_tokens,
                             temperature=0, received_at=stamp) for i in range(IN_FLIGHT)]
    waiting = [InferenceRequest(id=f"wait-{stamp}-{i}", prompt="Say yes.", max_tokens=2, received_at=stamp)
               for i in range(2)]
    submit = Phase()
    for key, requests in (("busy", busy), ("waiter", waiting)):
        driver.deliver(key, requests)
        submit.add(driver.last)
    streaming, only_waiting = Phase(), Phase()
    started, streaming_until = time.monotonic(), None
    while True:
        busy = driver.busy_keys()
        if not busy:
            break
        key = min(busy, key=busy.get)
        waits_only = not driver.state[key].bags["inflight"] and bool(driver.state[key].bags["waiting"])
        driver.fire(key)
        (only_waiting if waits_only else streaming).add(driver.last)
        if key == "busy" and not driver.state["busy"].bags["inflight"] and streaming_until is None:
            streaming_until = time.monotonic()
    seconds = (streaming_until or time.monotonic()) - started
    return {"poll_interval_ms": poll_ms, "streaming_seconds": round(seconds, 1),
            "streaming_key_per_s": {"firings": round(streaming.firings / seconds, 2),
                                    "writes": round(streaming.writes / seconds, 2),
                                    "bytes": round(streaming.bytes / seconds)},
            "waiting_key_per_firing": {"firings": only_waiting.firings,
                                       "writes": round(only_waiting.writes / max(only_waiting.firings, 1), 2),
                                       "bytes": round(only_waiting.bytes / max(only_waiting.firings, 1))},
            "per_request_submitted": {"writes": round(submit.writes / (len(busy) + len(waiting)), 2),
                                      "bytes": round(submit.bytes / (len(busy) + len(waiting)))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    apply_server_environment()
    engine, poll_ms = template_engine()
    try:
        result = measure(engine, poll_ms, args.max_tokens)
    finally:
        engine.close()
    print(json.dumps(result, indent=1))
    print(f"A key whose requests only wait fires at most every {WAITING_POLL_CAP_S:g} s once backed off; "
          "chunks here pass through the poll (the costlier path; with output_chunks_topic the engine publishes "
          "them and the poll carries only completions).")


if __name__ == "__main__":
    main()
