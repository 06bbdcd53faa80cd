"""Reliability probe: what hostile input, duplicates, a server kill and a backlog do to a template checkout.

Runs the template as a user does (``python -m template.main`` on the
DirectRunner, Pub/Sub emulator, vLLM) from a checkout, ``--repo`` (default:
this one), so the same probe measures the code before and after a change.
Two phases, each its own pipeline:

- **faults**: valid requests, a seeded hostile corpus (``tests/hostile_inputs.py``),
  exact duplicates, a reused id with another prompt, and a ``kill -9`` of the
  managed vLLM server while requests stream; then more valid requests;
- **backlog**: a burst of requests many times what finishes within a short
  ``request_timeout_s``, against a server the probe starts.

Printed per phase: inputs, outcomes (completions, dead letters by stage),
inputs without an outcome, whether the pipeline was still running, peak
requests at the server, and peak pipeline memory (without the server). Figures
only; nothing is asserted.

    python -m benchmarks.reliability [--repo DIR] [--hostile 120] [--backlog 300]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

import psutil

from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from local.emulators import PubSubEmulator
from local.harness import REPO_ROOT, LocalRun, requests_at_server, server_pids_in_log
from pipeline.serving.vllm_server import ServerSpec, VLLMServer
from tests.hostile_inputs import carries_too_long_id, hostile_corpus

LOGGER = logging.getLogger("reliability")
SERVED = "smollm2"


class Peaks:
    """Samples the pipeline's memory (its process tree, less any vLLM server) and the server's load."""

    def __init__(self, run: LocalRun, server_url: str | None) -> None:
        self.run, self.server_url = run, server_url
        self.rss = 0
        self.at_server = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                pipeline = psutil.Process(self.run.process.pid)
                servers = set(server_pids_in_log(self.run.log_path.read_text(errors="replace")))
                tree = [pipeline]
                for child in pipeline.children(recursive=True):
                    if child.pid in servers or any(p.pid in servers for p in child.parents()):
                        continue
                    tree.append(child)
                self.rss = max(self.rss, sum(p.memory_info().rss for p in tree))
            except (psutil.Error, OSError):
                pass
            if self.server_url:
                with contextlib.suppress(OSError):
                    self.at_server = max(self.at_server, requests_at_server(self.server_url))
            time.sleep(0.1)


class PipelineStopped(Exception):
    pass


def wait(collector, run: LocalRun, ids, timeout_s: float) -> None:
    """Waits for every id's outcome, or until the pipeline has stopped (nothing more will come)."""
    def progress(done: int, total: int) -> None:
        print(f"  ... {done}/{total} have an outcome", flush=True)
        if not run.pipeline_alive():
            raise PipelineStopped

    try:
        collector.wait_for(ids, timeout_s, progress)
    except PipelineStopped:
        time.sleep(2)


def report(phase: str, inputs: int, expected: set[str], collector, run: LocalRun, peaks: Peaks) -> None:
    completions = collections.Counter(c.data["id"] for c in collector.completions)
    letters = collections.Counter(d.data.get("stage") for d in collector.dead_letters)
    reasons = collections.Counter(d.data.get("reason", "")[:60] for d in collector.dead_letters)
    missing = expected - set(completions) - {d.data.get("id") for d in collector.dead_letters}
    print(f"\n== {phase}: {inputs} messages in; {sum(completions.values())} completions "
          f"({sum(n - 1 for n in completions.values())} duplicated), {sum(letters.values())} dead letters "
          f"{dict(letters)}; {len(missing)} without an outcome; pipeline "
          f"{'still running' if run.pipeline_alive() else f'exited with {run.process.returncode}'}; "
          f"peak at the server {peaks.at_server:.0f}; peak pipeline memory {peaks.rss / 2**20:.0f} MiB")
    for reason, count in reasons.most_common(5):
        print(f"   {count:4d} × {reason}")


def faults(emulator: PubSubEmulator, repo: Path, checkpoint: Path, hostile: int, seed: int) -> None:
    run = LocalRun([f"--model={checkpoint}", f"--served_model_name={SERVED}",
                    *LOCAL_SERVER.template_args(), "--num_shards=4", "--max_in_flight=8", "--default_max_tokens=24"],
                   log_path=REPO_ROOT / ".cache" / "bench" / "reliability-faults.log", emulator=emulator,
                   repo_root=repo).start()
    collector = run.collector()
    valid = [{"id": f"v{i}", "prompt": f"Count from {i} to {i + 60} in digits.", "max_tokens": 80, "temperature": 0}
             for i in range(12)]
    after = [{"id": f"after{i}", "prompt": "Name an animal.", "max_tokens": 8} for i in range(4)]
    corpus = hostile_corpus(seed, hostile)
    # A payload whose own id is too long for an ordering key is refused under no id: not waited for by name.
    nameless = {f"h{i}" for i, (payload, _) in enumerate(corpus) if carries_too_long_id(payload)}
    expected = {r["id"] for r in valid + after} | {f"h{i}" for i in range(hostile)} - nameless
    inputs = 0
    try:
        run.publish([{"id": "warm-up", "prompt": "Hi", "max_tokens": 2}])
        if collector.wait_for(["warm-up"], 600):  # the server's first start
            raise RuntimeError("the pipeline never answered:\n" + run.log_tail())
        collector.clear()
        with Peaks(run, None) as peaks:
            run.publish(valid)
            run.publish(valid[:4])  # redeliveries
            run.publish([{"id": "v0", "prompt": "Another prompt reusing an id.", "max_tokens": 8}])
            for index, (payload, _) in enumerate(corpus):
                run.publish([payload], attributes={"id": f"h{index}"})
            inputs += len(valid) + 4 + 1 + len(corpus)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any(c.data["id"].startswith("v") for c in collector.chunks):
                time.sleep(0.2)
            pids = server_pids_in_log(run.log_path.read_text())
            try:
                os.kill(pids[-1], signal.SIGKILL)
                print(f"kill -9 of the vLLM server (pid {pids[-1]}) while requests streamed")
            except (IndexError, ProcessLookupError):
                print("no server to kill: the pipeline (and with it its server) had already stopped")
            time.sleep(5)
            if run.pipeline_alive():
                run.publish(after)
            inputs += len(after)
            wait(collector, run, expected, 600)
            time.sleep(5)
        report("faults", inputs, expected, collector, run, peaks)
    finally:
        collector.stop()
        run.stop()


def backlog(emulator: PubSubEmulator, repo: Path, checkpoint: Path, size: int, timeout_s: int) -> None:
    server = VLLMServer(ServerSpec(model=str(checkpoint), dtype=LOCAL_SERVER.dtype, served_model_name=SERVED,
                                   extra_args=LOCAL_SERVER.vllm_args, start_timeout_s=900)).start()
    run = LocalRun([f"--server_url={server.base_url}", f"--served_model_name={SERVED}", "--max_in_flight=2",
                    f"--request_timeout_s={timeout_s}", "--default_max_tokens=8", "--num_shards=4"],
                   log_path=REPO_ROOT / ".cache" / "bench" / "reliability-backlog.log", emulator=emulator,
                   repo_root=repo).start()
    collector = run.collector()
    ids = [f"b{i}" for i in range(size)]
    try:
        run.publish([{"id": "warm-up", "prompt": "Hi", "max_tokens": 2}])
        collector.wait_for(["warm-up"], 300)
        collector.clear()
        with Peaks(run, server.base_url) as peaks:
            started = time.time()
            run.publish({"id": request_id, "prompt": f"Name a number bigger than {i}."}
                        for i, request_id in enumerate(ids))
            wait(collector, run, ids, 900)
            print(f"backlog of {size} drained in {time.time() - started:.0f} s with request_timeout_s={timeout_s}")
        report("backlog", size, set(ids), collector, run, peaks)
    finally:
        collector.stop()
        run.stop()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO_ROOT, help="checkout whose template to run")
    parser.add_argument("--hostile", type=int, default=120, help="hostile messages in the faults phase")
    parser.add_argument("--backlog", type=int, default=300, help="requests in the backlog burst")
    parser.add_argument("--backlog-timeout", type=int, default=3, help="request_timeout_s for the backlog phase")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--phase", choices=("faults", "backlog", "both"), default="both")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apply_server_environment()
    checkpoint = ensure_local_checkpoint()
    print(f"Template under test: {args.repo.resolve()}")
    with PubSubEmulator() as emulator:
        emulator.activate()
        if args.phase in ("faults", "both"):
            faults(emulator, args.repo, checkpoint, args.hostile, args.seed)
        if args.phase in ("backlog", "both"):
            backlog(emulator, args.repo, checkpoint, args.backlog, args.backlog_timeout)


if __name__ == "__main__":
    main()
