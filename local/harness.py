"""Runs the template locally and watches its outputs: shared by smoke, tests and benchmarks.

:class:`LocalRun` starts the Pub/Sub emulator with the template's topics and
the pipeline itself (``python -m local.direct_runner``: the template on the DirectRunner) as a
subprocess, exactly as a user would; :class:`OutputCollector` subscribes to
the output topics and records every message with its arrival time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local.emulators import PubSubEmulator

LOGGER = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent

TOPICS = {"prompts": "prompts", "bulk": "bulk-prompts", "chunks": "llm-chunks", "completions": "llm-completions",
          "dead_letters": "llm-dead-letters"}


@dataclass
class Received:
    data: dict[str, Any]
    at: float  # wall-clock arrival time at the subscriber


@dataclass
class OutputCollector:
    """Streaming-pulls the output subscriptions into lists, calling ``on_message`` for each."""

    subscriptions: dict[str, str]  # kind (chunks, completions, dead_letters) -> subscription path
    on_message: Callable[[str, Received], None] | None = None
    chunks: list[Received] = field(default_factory=list)
    completions: list[Received] = field(default_factory=list)
    dead_letters: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: list[Any] = []
        self._subscriber = None

    def start(self) -> OutputCollector:
        from google.cloud import pubsub_v1

        self._subscriber = pubsub_v1.SubscriberClient()
        for kind, path in self.subscriptions.items():
            self._futures.append(self._subscriber.subscribe(path, callback=self._callback(kind)))
        return self

    def _callback(self, kind: str) -> Callable[[Any], None]:
        target = getattr(self, kind)

        def receive(message: Any) -> None:
            item = Received(json.loads(message.data.decode("utf-8")), time.time())
            with self._lock:
                target.append(item)
            message.ack()
            if self.on_message:
                self.on_message(kind, item)

        return receive

    def clear(self) -> None:
        """Forgets what has been received so far (after a warm-up, say)."""
        with self._lock:
            self.chunks.clear()
            self.completions.clear()
            self.dead_letters.clear()

    def finished_ids(self) -> set[str]:
        with self._lock:
            return {r.data["id"] for r in self.completions} | {r.data.get("id") for r in self.dead_letters}

    def wait_for(self, ids: Iterable[str], timeout_s: float,
                 progress: Callable[[int, int], None] | None = None) -> set[str]:
        """Waits until every id has a completion or a dead letter; returns the missing ones."""
        wanted = set(ids)
        deadline = time.monotonic() + timeout_s
        last_report = 0.0
        while time.monotonic() < deadline:
            missing = wanted - self.finished_ids()
            if not missing:
                return set()
            if progress and time.monotonic() - last_report >= 10:
                progress(len(wanted) - len(missing), len(wanted))
                last_report = time.monotonic()
            time.sleep(0.2)
        return wanted - self.finished_ids()

    def wait_for_streams(self, streams: Iterable[str], timeout_s: float) -> set[str]:
        """Waits until each stream's chunks have all arrived, its final one among them: a completion, on a topic of
        its own, can come before its stream's last chunks. Returns the streams still incomplete."""
        wanted = set(streams)

        def incomplete() -> set[str]:
            seqs: dict[str, set[int]] = {stream: set() for stream in wanted}
            ends: dict[str, int] = {}
            with self._lock:
                for chunk in self.chunks:
                    stream = chunk.data["stream"]
                    if stream in seqs:
                        seqs[stream].add(chunk.data["seq"])
                        if chunk.data["final"]:
                            ends[stream] = chunk.data["seq"]
            return {stream for stream in wanted if stream not in ends or seqs[stream] != set(range(ends[stream] + 1))}

        deadline = time.monotonic() + timeout_s
        while (missing := incomplete()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return missing

    def stop(self) -> None:
        for future in self._futures:
            future.cancel()
        for future in self._futures:
            with contextlib.suppress(Exception):
                future.result(timeout=5)
        if self._subscriber is not None:
            self._subscriber.close()


class LocalRun:
    """The emulator, the template's topics, and the pipeline as a subprocess."""

    def __init__(self, pipeline_args: list[str], *, log_path: Path, emulator: PubSubEmulator | None = None,
                 repo_root: Path = REPO_ROOT, bulk_lane: bool = False) -> None:
        """``repo_root`` is the checkout whose template runs (another one, to compare before and after);
        ``bulk_lane``: the job reads the bulk topic's subscription as its bulk_subscription."""
        self.repo_root = repo_root
        self.bulk_lane = bulk_lane
        self.owns_emulator = emulator is None
        self.emulator = emulator or PubSubEmulator()
        self.extra_args = pipeline_args
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._publisher = None
        self._run_id = f"{int(time.time() * 1000) % 10**9}"
        self._topics_exist = False

    def successor(self, pipeline_args: list[str], *, log_path: Path) -> LocalRun:
        """Another pipeline on this run's emulator, topics and subscriptions (as a restarted job would be)."""
        after = LocalRun(pipeline_args, log_path=log_path, emulator=self.emulator, repo_root=self.repo_root,
                         bulk_lane=self.bulk_lane)
        after._run_id, after._topics_exist = self._run_id, True
        return after

    def topic_name(self, kind: str) -> str:
        return f"{TOPICS[kind]}-{self._run_id}"

    def start(self) -> LocalRun:
        if self.owns_emulator:
            self.emulator.start()
        self.emulator.activate()
        for kind in () if self._topics_exist else TOPICS:
            ordering = kind == "chunks"
            self.emulator.create_topic(self.topic_name(kind), subscription=f"{self.topic_name(kind)}-sub",
                                       ordering=ordering)
        # An older checkout (bench-reliability REPO=DIR) has no local launcher: its entry point applied its fixes.
        has_launcher = (self.repo_root / "local" / "direct_runner.py").is_file()
        launcher = "local.direct_runner" if has_launcher else "template.main"
        args = [
            sys.executable, "-m", launcher, "--runner=BundleBasedDirectRunner",
            f"--input_subscription={self.emulator.subscription(self.topic_name('prompts') + '-sub')}",
            f"--output_chunks_topic={self.emulator.topic(self.topic_name('chunks'))}",
            f"--output_completions_topic={self.emulator.topic(self.topic_name('completions'))}",
            f"--dead_letter_topic={self.emulator.topic(self.topic_name('dead_letters'))}",
            *([f"--bulk_subscription={self.emulator.subscription(self.topic_name('bulk') + '-sub')}"]
              if self.bulk_lane else []),
            *self.extra_args,
        ]
        env = dict(os.environ, **self.emulator.env(), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(args, cwd=self.repo_root, env=env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT)
        LOGGER.info("Pipeline started (pid %d), log: %s", self.process.pid, self.log_path)
        return self

    def collector(self, on_message: Callable[[str, Received], None] | None = None) -> OutputCollector:
        subscriptions = {kind: self.emulator.subscription(f"{self.topic_name(kind)}-sub")
                         for kind in ("chunks", "completions", "dead_letters")}
        return OutputCollector(subscriptions, on_message).start()

    def publish(self, payloads: Iterable[bytes | str | dict[str, Any]], attributes: dict[str, str] | None = None,
                kind: str = "prompts") -> None:
        """Publishes to the job's input topic (``kind="bulk"``: its bulk lane's)."""
        from google.cloud import pubsub_v1

        if self._publisher is None:
            self._publisher = pubsub_v1.PublisherClient()
        topic = self.emulator.topic(self.topic_name(kind))
        futures = []
        for payload in payloads:
            if isinstance(payload, dict):
                payload = json.dumps(payload)
            if isinstance(payload, str):
                payload = payload.encode("utf-8")
            futures.append(self._publisher.publish(topic, payload, **(attributes or {})))
        for future in futures:
            future.result(timeout=30)

    def pipeline_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the pipeline, as a crashed worker: nothing of its own is cleaned up (the emulator stays)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the pipeline (it cancels itself and stops its model server), then the emulator."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    LOGGER.error("Pipeline did not stop within %.0f s; killing it", timeout_s)
                    self.process.kill()
                    self.process.wait()
            code = self.process.returncode
        if self._publisher is not None:
            self._publisher.stop()
            self._publisher = None
        if self.owns_emulator:
            self.emulator.stop()
        return code


def requests_at_server(base_url: str) -> float:
    """Requests a vLLM server holds now, running and waiting, from its Prometheus metrics."""
    from pipeline.serving.vllm_server import server_metrics

    return sum(server_metrics(base_url).values())


def server_pids_in_log(log_text: str) -> list[int]:
    """PIDs of vLLM servers the pipeline reported starting (model manager log lines)."""
    pids = []
    for line in log_text.splitlines():
        if "vLLM server process started: pid " in line:
            pids.append(int(line.rsplit("pid ", 1)[1].split()[0]))
    return pids
