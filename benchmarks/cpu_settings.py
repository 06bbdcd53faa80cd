"""Which settings should the local vLLM (CPU build) run the embedded model with? Start time, speed, correctness.

For each candidate in :data:`local.cpu_server.CANDIDATES` (plus an AMX diagnostic
on CPUs that have AMX) this starts the model manager's real server cold (an
empty compile cache), asks it the known-answer chat question and a completions
prompt (greedy), then measures tokens/s for one stream and for 16 concurrent
streams, each answer fixed at ``--tokens`` tokens (``ignore_eos``) so every
candidate does the same work; repetitions are interleaved across the candidates,
all of which stay up meanwhile. Last, each server is stopped and started again
on its now warm compile cache. Printed: one row per candidate with medians and
ranges, and the CPU it ran on. Figures only; nothing is asserted.

    python -m benchmarks.cpu_settings [--reps 3] [--tokens 128] [--concurrent 16]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from local.cpu_server import (
    AMX_DIAGNOSTIC,
    CANDIDATES,
    KNOWN_QUESTION,
    LOCAL_SERVER,
    CpuServerSettings,
    apply_server_environment,
    cpu_description,
    has_amx,
    known_answer_problem,
)
from local.embedded_model import ensure_local_checkpoint
from pipeline.serving.vllm_server import ServerSpec, VLLMServer

SERVED = "smollm2"
COMPLETION_PROMPT = "The capital of France is"
STREAM_PROMPTS = ["Write a story about a lighthouse keeper.", "Explain how bread rises.",
                  "Describe a walk through a forest in autumn.", "List some uses of copper."]


@dataclass
class Candidate:
    settings: CpuServerSettings
    cache_dir: Path
    server: VLLMServer | None = None
    cold_start_s: float = 0.0
    warm_start_s: float | None = None
    chat_answer: str = ""
    completion_answer: str = ""
    single: list[float] = field(default_factory=list)
    concurrent: list[float] = field(default_factory=list)


def start(candidate: Candidate, checkpoint: Path) -> float:
    """Starts the candidate's server on its own compile cache; returns seconds to healthy."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(candidate.cache_dir)
    spec = ServerSpec(model=str(checkpoint), dtype=candidate.settings.dtype, served_model_name=SERVED,
                      extra_args=candidate.settings.vllm_args, start_timeout_s=1200)
    started = time.monotonic()
    candidate.server = VLLMServer(spec, log_sink=lambda line: None).start()
    return time.monotonic() - started


async def generate(session: aiohttp.ClientSession, base_url: str, body: dict) -> dict:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with session.post(f"{base_url}{path}", json={"model": SERVED, "temperature": 0, **body}) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        return await response.json()


async def answers(base_url: str) -> tuple[str, str]:
    async with aiohttp.ClientSession() as session:
        chat = await generate(session, base_url, {"messages": [{"role": "user", "content": KNOWN_QUESTION}],
                                                  "max_tokens": 24})
        completion = await generate(session, base_url, {"prompt": COMPLETION_PROMPT, "max_tokens": 8})
    return chat["choices"][0]["message"]["content"], completion["choices"][0]["text"]


async def tokens_per_s(base_url: str, streams: int, tokens: int) -> float:
    """Output tokens/s of ``streams`` concurrent requests of exactly ``tokens`` tokens each."""
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        results = await asyncio.gather(*(generate(session, base_url, {
            "messages": [{"role": "user", "content": STREAM_PROMPTS[i % len(STREAM_PROMPTS)]}],
            "max_tokens": tokens, "ignore_eos": True}) for i in range(streams)))
        elapsed = time.monotonic() - started
    produced = sum(r["usage"]["completion_tokens"] for r in results)
    if produced != streams * tokens:
        raise RuntimeError(f"expected {streams * tokens} tokens, the server produced {produced}")
    return produced / elapsed


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of every timed request")
    parser.add_argument("--concurrent", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # every candidate's server is up at once
    apply_server_environment()
    checkpoint = ensure_local_checkpoint()
    settings = list(CANDIDATES) + ([AMX_DIAGNOSTIC] if has_amx() else [])
    workdir = Path(tempfile.mkdtemp(prefix="cpu-settings-"))
    candidates = [Candidate(s, workdir / f"inductor-{i}") for i, s in enumerate(settings)]
    print(f"CPU: {cpu_description()}", flush=True)
    try:
        for candidate in candidates:
            candidate.cold_start_s = start(candidate, checkpoint)
            candidate.chat_answer, candidate.completion_answer = asyncio.run(answers(candidate.server.base_url))
            print(f"  started {candidate.settings.label}: {candidate.cold_start_s:.0f} s cold", flush=True)
        for rep in range(args.reps):
            for candidate in candidates[rep % len(candidates):] + candidates[:rep % len(candidates)]:
                url = candidate.server.base_url
                candidate.single.append(asyncio.run(tokens_per_s(url, 1, args.tokens)))
                candidate.concurrent.append(asyncio.run(tokens_per_s(url, args.concurrent, args.tokens)))
            print(f"  repetition {rep + 1} of {args.reps} done", flush=True)
        for candidate in candidates:
            candidate.server.stop()
            candidate.warm_start_s = start(candidate, checkpoint)
            candidate.server.stop()
    finally:
        for candidate in candidates:
            if candidate.server is not None:
                candidate.server.stop()
    print(f"\nCPU: {cpu_description()}; {args.tokens} output tokens a request (ignore_eos), "
          f"{args.reps} interleaved repetitions: median (range). Start: to /health 200, cold = empty compile cache.")
    print(f"{'settings':28} {'cold start':>10} {'warm start':>10} {'tok/s, 1 stream':>18} "
          f"{f'tok/s, {args.concurrent} streams':>20}  correct  chat answer | completion")
    for c in candidates:
        right = "yes" if known_answer_problem(c.chat_answer, c.settings) is None else "NO"
        chosen = " (chosen)" if c.settings == LOCAL_SERVER else ""
        print(f"{c.settings.label + chosen:28} {c.cold_start_s:9.0f}s {c.warm_start_s or 0:9.0f}s "
              f"{spread(c.single):>18} {spread(c.concurrent):>20}  {right:7}  "
              f"{c.chat_answer[:60]!r} | {c.completion_answer[:20]!r}")


if __name__ == "__main__":
    main()
