"""The systems under test, each behind one interface: start once, run a load shape, stop.

Each system stays up for every repetition and shape of a core plan, so start
and warm-up are paid once and kept out of the figures. Every run uses fresh
request ids, so nothing late from one run can count in another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import aiohttp

from benchmarks.side_by_side.completions_stream import completion_events
from benchmarks.side_by_side.completions_stream import session as client_session
from benchmarks.side_by_side.cores import peak_rss_mib, pin_tree, tree_cpu_seconds
from benchmarks.side_by_side.report import BEAM, RELAY
from benchmarks.side_by_side.stats import RequestTiming, RunResult
from benchmarks.side_by_side.workload import FIXED, NATURAL, Prompt
from local.emulators import PubSubEmulator
from local.harness import REPO_ROOT, LocalRun, OutputCollector

Progress = Callable[[int, int], None]  # (finished, expected)


class System(Protocol):
    name: str

    def start(self) -> None: ...

    def pause(self) -> None:
        """Stops using CPU while another system is measured (its idle polling would share their cores)."""

    def resume(self) -> None: ...

    def run(self, prompts: list[Prompt], offsets: list[float], *, shape: str, rep: int, cores: str,
            progress: Progress) -> RunResult: ...

    def stop(self) -> None: ...


def _run_ids(prompts: list[Prompt], shape: str, rep: int) -> list[Prompt]:
    return [dataclasses.replace(p, id=f"{shape}-r{rep}-{p.id}") for p in prompts]


def _timeout(offsets: list[float]) -> float:
    return max(offsets, default=0.0) + 600.0


# ---------------------------------------------------------------- raw vLLM: the floor

class RawVLLM:
    """An asyncio client streaming every request straight to the server: no pipeline at all."""

    name = "raw vLLM"

    def __init__(self, base_url: str, model: str, max_tokens: int, *, stream_interval: int | None = None) -> None:
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.stream_interval = stream_interval  # vLLM's: one event per this many tokens (None: every token)

    def start(self) -> None:
        asyncio.run(self._all([Prompt("warm-up", "Hi", "question")], [0.0], lambda done, total: None))

    def stop(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def run(self, prompts: list[Prompt], offsets: list[float], *, shape: str, rep: int, cores: str,
            progress: Progress) -> RunResult:
        prompts = _run_ids(prompts, shape, rep)
        cpu_before = time.thread_time()  # the event loop's thread is the whole client
        timings = asyncio.run(self._all(prompts, offsets, progress))
        return RunResult(self.name, shape, rep, cores, timings, len(prompts), cpu_s=time.thread_time() - cpu_before)

    async def _all(self, prompts: list[Prompt], offsets: list[float], progress: Progress) -> list[RequestTiming]:
        timings: list[RequestTiming] = []
        start = time.time()

        async def one(session: aiohttp.ClientSession, prompt: Prompt, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.time()))
            sent, first, tokens = time.time(), None, 0
            async for event in completion_events(session, self.base_url, self.model, prompt.prompt,
                                                   prompt.budget(self.max_tokens), prompt.min_tokens(self.max_tokens),
                                                   self.stream_interval):
                if first is None and event.get("choices") and event["choices"][0].get("text"):
                    first = time.time()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            done = time.time()
            timings.append(RequestTiming(prompt.id, prompt.kind, sent, first or done, done, tokens))
            progress(len(timings), len(prompts))

        async with client_session(_timeout(offsets)) as session:
            await asyncio.gather(*(one(session, p, o) for p, o in zip(prompts, offsets, strict=True)))
        return timings


# ---------------------------------------------------------------- publishing on a schedule

def publish_on_schedule(topic: str, prompts: list[Prompt], offsets: list[float], max_tokens: int) -> dict[str, float]:
    """Publishes each prompt at its offset; returns id → the time it was handed to the client."""
    from google.cloud import pubsub_v1

    publisher = pubsub_v1.PublisherClient(batch_settings=pubsub_v1.types.BatchSettings(max_latency=0.001))
    sent, futures = {}, []
    start = time.time()
    try:
        for prompt, offset in zip(prompts, offsets, strict=True):
            time.sleep(max(0.0, start + offset - time.time()))
            sent[prompt.id] = time.time()
            futures.append(publisher.publish(topic, json.dumps(prompt.as_message(max_tokens)).encode()))
        for future in futures:
            future.result(timeout=60)
    finally:
        publisher.stop()
    return sent


def _signal(process: subprocess.Popen[bytes] | None, signum: int) -> None:
    if process is not None and process.poll() is None:
        os.kill(process.pid, signum)


def _wait(collector: OutputCollector, ids: set[str], timeout_s: float, progress: Progress,
          alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        finished = len(ids & collector.finished_ids())
        progress(finished, len(ids))
        if finished == len(ids):
            return
        if not alive():
            raise RuntimeError("the system's process ended during the run")
        time.sleep(0.5)


# ---------------------------------------------------------------- this template

# The line the transformers engine logs per batch (pipeline.engines.transformers_engine.BATCH_LOG).
_BATCH_LINE = re.compile(r"Static batch: (\d+) requests, (\d+) token positions computed, (\d+) of them padding")


def padded_share(log_text: str) -> float | None:
    """The share of token positions that were padding, over every static batch the log reports."""
    positions = padding = 0
    for match in _BATCH_LINE.finditer(log_text):
        positions, padding = positions + int(match[2]), padding + int(match[3])
    return padding / positions if positions else None


def pipeline_timings(collector: OutputCollector, sent: dict[str, float], kinds: dict[str, str]) -> list[RequestTiming]:
    """Per-request timings of a Pub/Sub-fed system, with the first chunk split by hop from its records.

    Chunks travel on their own topic and may trail their completion, so they get
    a few seconds more; the first of each completion counts (a redelivery may follow).
    """
    completions, arrived = {}, {}
    for received in list(collector.completions):
        if received.data["id"] in sent and received.data["id"] not in completions:
            completions[received.data["id"]], arrived[received.data["id"]] = received.data, received.at
    with_text = {key for key, record in completions.items() if record["text"]}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and with_text - {c.data["id"] for c in list(collector.chunks) if c.data["text"]}:
        time.sleep(0.1)
    first_chunks: dict[str, tuple[float, dict]] = {}
    for chunk in list(collector.chunks):
        key = chunk.data["id"]
        if chunk.data["text"] and key in sent and (key not in first_chunks or chunk.at < first_chunks[key][0]):
            first_chunks[key] = (chunk.at, chunk.data)
    timings = []
    for key, record in completions.items():
        done = arrived[key]
        hops = None
        if key in first_chunks and record["time_to_first_token_ms"] is not None:
            at, chunk = first_chunks[key]
            token_at = record["received_at"] + record["time_to_first_token_ms"] / 1000
            hops = (record["received_at"] - sent[key], token_at - record["received_at"],
                    chunk["emitted_at"] - token_at, at - chunk["emitted_at"])
        first = first_chunks[key][0] if key in first_chunks else done
        timings.append(RequestTiming(key, kinds[key], sent[key], first, done, record["usage"]["completion_tokens"],
                                     hops, record.get("accelerator_seconds")))
    return timings


class Template:
    """``python -m template.main`` on the DirectRunner, Pub/Sub emulator in and out, as a user runs it.

    With a ``base_url`` it uses that vLLM server; without one, ``extra_args`` name
    its engine (``--engine=transformers --model=...``), which then runs on ``cores``.
    """

    def __init__(self, name: str, emulator: PubSubEmulator, base_url: str | None, max_tokens: int, *,
                 bucketing: bool, log_dir: Path, repo_root: Path = REPO_ROOT, extra_args: tuple[str, ...] = (),
                 cores: frozenset[int] | None = None) -> None:
        self.name = name
        self.holds_model = base_url is None  # its CPU time includes the model's
        self._args = [*([f"--server_url={base_url}"] if base_url else []), "--prompt_format=completion",
                      "--num_shards=4", f"--default_max_tokens={max_tokens}",
                      f"--length_bucketing={str(bucketing).lower()}", *extra_args]
        self._cores = cores
        self._emulator, self._max_tokens = emulator, max_tokens
        self._log = log_dir / f"{name.replace(' ', '-').replace('(', '').replace(')', '')}.log"
        self._repo_root = repo_root
        self._run: LocalRun | None = None
        self._collector: OutputCollector | None = None

    def start(self) -> None:
        self._run = LocalRun(self._args, log_path=self._log, emulator=self._emulator, repo_root=self._repo_root).start()
        if self._cores is not None:  # before the warm-up starts the engine's process, which inherits them
            pin_tree(self._run.process.pid, self._cores)
        self._collector = self._run.collector()
        warm = [Prompt("warm-up", "Hi", "question")]
        publish_on_schedule(self._topic(), warm, [0.0], 1)
        _wait(self._collector, {"warm-up"}, 300, lambda done, total: None, self._run.pipeline_alive)
        if "warm-up" not in self._collector.finished_ids():
            raise RuntimeError(f"{self.name} did not answer its warm-up:\n{self._run.log_tail()}")

    def pause(self) -> None:
        _signal(self._run.process if self._run else None, signal.SIGSTOP)

    def resume(self) -> None:
        _signal(self._run.process if self._run else None, signal.SIGCONT)

    def _topic(self) -> str:
        assert self._run is not None
        return self._emulator.topic(self._run.topic_name("prompts"))

    def stop(self) -> None:
        if self._collector is not None:
            self._collector.stop()
        if self._run is not None:
            self._run.stop()

    def run(self, prompts: list[Prompt], offsets: list[float], *, shape: str, rep: int, cores: str,
            progress: Progress) -> RunResult:
        assert self._run is not None and self._run.process is not None and self._collector is not None
        collector, pid = self._collector, self._run.process.pid
        prompts = _run_ids(prompts, shape, rep)
        collector.clear()
        cpu_before = tree_cpu_seconds(pid)
        log_offset = self._log.stat().st_size
        sent = publish_on_schedule(self._topic(), prompts, offsets, self._max_tokens)
        _wait(collector, set(sent), _timeout(offsets), progress, self._run.pipeline_alive)
        timings = pipeline_timings(collector, sent, {p.id: p.kind for p in prompts})
        cpu_s = tree_cpu_seconds(pid) - cpu_before
        with open(self._log, "rb") as log:
            log.seek(log_offset)
            padding = padded_share(log.read().decode("utf-8", "replace"))
        dead = [d.data for d in list(collector.dead_letters) if d.data.get("id") in sent]
        notes = [f"{len(dead)} dead letters: {sorted({d.get('reason', '?')[:60] for d in dead})}"] if dead else []
        return RunResult(self.name, shape, rep, cores, timings, len(prompts), cpu_s=cpu_s,
                         peak_rss_mib=peak_rss_mib(pid), notes=notes, padded_share=padding)


# ---------------------------------------------------------------- peers in a process of their own

class _OwnProcess:
    """A peer run as ``python -m module`` behind topics of its own, answering a warm-up before it counts.

    A peer names its module, its output kinds (collector lists), its own flags,
    and how its outputs become timings; starting, pausing, a run's CPU and
    memory, and stopping are the same for all.
    """

    name: str
    module: str
    outputs: tuple[str, ...]
    prefix: str

    def __init__(self, emulator: PubSubEmulator, max_tokens: int, *, log_dir: Path) -> None:
        self._emulator, self._max_tokens = emulator, max_tokens
        self._log = log_dir / f"{self.prefix}.log"
        self._tag = f"{self.prefix}-{int(time.time() * 1000) % 10**9}"
        self._process: subprocess.Popen[bytes] | None = None
        self._collector: OutputCollector | None = None

    def _flags(self, topics: dict[str, str]) -> list[str]:
        """The module's flags besides its input subscription, given each output kind's topic path."""
        raise NotImplementedError

    def _timings(self, sent: dict[str, float], kinds: dict[str, str]) -> list[RequestTiming]:
        raise NotImplementedError

    def start(self) -> None:
        emulator, tag = self._emulator, self._tag
        for kind in ("in", *self.outputs):
            emulator.create_topic(f"{tag}-{kind}", subscription=f"{tag}-{kind}-sub")
        command = [sys.executable, "-m", self.module, f"--input_subscription={emulator.subscription(tag + '-in-sub')}",
                   *self._flags({kind: emulator.topic(f"{tag}-{kind}") for kind in self.outputs})]
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log, "wb") as log:
            self._process = subprocess.Popen(command, cwd=REPO_ROOT, env=dict(os.environ, **emulator.env()),
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._collector = OutputCollector({kind: emulator.subscription(f"{tag}-{kind}-sub")
                                           for kind in self.outputs}).start()
        publish_on_schedule(emulator.topic(f"{tag}-in"), [Prompt("warm-up", "Hi", "question")], [0.0], 1)
        _wait(self._collector, {"warm-up"}, 300, lambda done, total: None, self._alive)
        if "warm-up" not in self._collector.finished_ids():
            raise RuntimeError(f"{self.name} did not answer its warm-up; see {self._log}")

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def pause(self) -> None:
        _signal(self._process, signal.SIGSTOP)

    def resume(self) -> None:
        _signal(self._process, signal.SIGCONT)

    def stop(self) -> None:
        if self._collector is not None:
            self._collector.stop()
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def run(self, prompts: list[Prompt], offsets: list[float], *, shape: str, rep: int, cores: str,
            progress: Progress) -> RunResult:
        assert self._process is not None and self._collector is not None
        prompts = _run_ids(prompts, shape, rep)
        self._collector.clear()
        cpu_before = tree_cpu_seconds(self._process.pid)
        sent = publish_on_schedule(self._emulator.topic(f"{self._tag}-in"), prompts, offsets, self._max_tokens)
        _wait(self._collector, set(sent), _timeout(offsets), progress, self._alive)
        timings = self._timings(sent, {p.id: p.kind for p in prompts})
        return RunResult(self.name, shape, rep, cores, timings, len(prompts),
                         cpu_s=tree_cpu_seconds(self._process.pid) - cpu_before,
                         peak_rss_mib=peak_rss_mib(self._process.pid))


class _BeamJob(_OwnProcess):
    """Beam 2.77's RunInference + VLLMCompletionsModelHandler in its own DirectRunner process."""

    name = BEAM
    module, outputs = "benchmarks.side_by_side.beam_handler_job", ("completions",)

    def __init__(self, emulator: PubSubEmulator, port: int, model: str, max_tokens: int, *, fixed: bool,
                 log_dir: Path) -> None:
        self.prefix = f"beam-handler-{'fixed' if fixed else 'natural'}"
        super().__init__(emulator, max_tokens, log_dir=log_dir)
        self._port, self._model, self._fixed = port, model, fixed

    def _flags(self, topics: dict[str, str]) -> list[str]:
        return [f"--output_topic={topics['completions']}", f"--port={self._port}", f"--model={self._model}",
                f"--max_tokens={self._max_tokens}", *([f"--min_tokens={self._max_tokens}"] if self._fixed else [])]

    def _timings(self, sent: dict[str, float], kinds: dict[str, str]) -> list[RequestTiming]:
        # It answers whole completions: its first output is its completion.
        answers = {c.data["id"]: c for c in list(self._collector.completions) if c.data["id"] in sent}
        return [RequestTiming(key, kinds[key], sent[key], received.at, received.at, received.data["tokens"])
                for key, received in answers.items()]


class BeamHandler:
    """Beam's handler, one job per answer length: its ``inference_args`` are one for every element and run.

    A run goes to the job whose ``min_tokens`` matches its prompts (fixed lengths, or none).
    """

    name = BEAM

    def __init__(self, emulator: PubSubEmulator, port: int, model: str, max_tokens: int, *, lengths: list[str],
                 log_dir: Path) -> None:
        self._jobs = {mode: _BeamJob(emulator, port, model, max_tokens, fixed=mode == FIXED, log_dir=log_dir)
                      for mode in lengths}

    def start(self) -> None:
        for job in self._jobs.values():
            job.start()

    def pause(self) -> None:
        for job in self._jobs.values():
            job.pause()

    def resume(self) -> None:
        for job in self._jobs.values():
            job.resume()

    def stop(self) -> None:
        for job in self._jobs.values():
            job.stop()

    def run(self, prompts: list[Prompt], offsets: list[float], *, shape: str, rep: int, cores: str,
            progress: Progress) -> RunResult:
        modes = {FIXED if p.fixed else NATURAL for p in prompts}
        if len(modes) != 1 or not modes <= set(self._jobs):
            raise ValueError(f"Beam's handler runs answers of one length per job; got {sorted(modes)}")
        return self._jobs[modes.pop()].run(prompts, offsets, shape=shape, rep=rep, cores=cores, progress=progress)


class PubSubRelay(_OwnProcess):
    """:mod:`benchmarks.side_by_side.pubsub_relay`: raw vLLM behind Pub/Sub, the hops and nothing else."""

    name = RELAY
    module, outputs, prefix = "benchmarks.side_by_side.pubsub_relay", ("chunks", "completions"), "pubsub-relay"

    def __init__(self, emulator: PubSubEmulator, base_url: str, model: str, max_tokens: int, *, log_dir: Path) -> None:
        super().__init__(emulator, max_tokens, log_dir=log_dir)
        self._base_url, self._model = base_url, model

    def _flags(self, topics: dict[str, str]) -> list[str]:
        return [f"--chunks_topic={topics['chunks']}", f"--completions_topic={topics['completions']}",
                f"--base_url={self._base_url}", f"--model={self._model}", f"--max_tokens={self._max_tokens}"]

    def _timings(self, sent: dict[str, float], kinds: dict[str, str]) -> list[RequestTiming]:
        return pipeline_timings(self._collector, sent, kinds)
