"""A backlog through the template, end to end (emulator → ``python -m template.main`` → vLLM).

A backlog several times what can finish within ``request_timeout_s``: every request is served, none times out
waiting, and the engine stays bounded. (Hostile messages, redeliveries, reused ids and a ``kill -9`` of the model
server go to tests/test_pipeline_e2e.py's vLLM run, which owns its server, so they cost no start of their own.)
"""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest

from local.harness import REPO_ROOT, LocalRun, requests_at_server
from tests.conftest import SERVED_NAME, wait_until

pytestmark = pytest.mark.engine

BACKLOG = 60  # at the 1-3 requests a second a 2-core machine serves: two to six times what ends in 10 s
# A bound on one request's generation from its sending, not on its wait at the worker: it is the hold that keeps the
# backlog in Pub/Sub. It leaves room for make test's other process to slow the local server down several times.
BACKLOG_TIMEOUT_S = 10
BACKLOG_IN_FLIGHT = 2
BACKLOG_QUEUE = 4
MAX_HELD = BACKLOG_IN_FLIGHT + BACKLOG_QUEUE
# A completion reaches the collector up to a second or so after its request left the worker's hold (at 2-3
# requests a second: up to 4 of them), and a kill loses those not yet published, on top of what the worker held.
COLLECTOR_LAG = 4
KILL_AFTER = 12  # completions before the first pipeline is killed: with what it holds, well under half the backlog


def load_lines(path) -> list[dict]:
    """The local launcher's load log: one JSON line per half second (see local/direct_runner.py)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_a_backlog_waits_in_the_subscription_and_is_served_whole(vllm_server, emulator, tmp_path):
    """Several times what finishes within request_timeout_s: the worker holds a bounded share, the rest stays
    unacknowledged in Pub/Sub (a pipeline started after the first one is killed finds it there) and is served."""
    args = [f"--server_url={vllm_server.base_url}", f"--served_model_name={SERVED_NAME}",
            f"--max_in_flight={BACKLOG_IN_FLIGHT}", f"--worker_queue={BACKLOG_QUEUE}",
            f"--request_timeout_s={BACKLOG_TIMEOUT_S}", "--default_max_tokens=8", "--num_shards=4"]
    logs = REPO_ROOT / ".cache" / "test-e2e"
    first_load, second_load = tmp_path / "first-load.jsonl", tmp_path / "second-load.jsonl"
    first = LocalRun([*args, f"--load_log={first_load}"], log_path=logs / "backlog.log", emulator=emulator)
    second = first.successor([*args, f"--load_log={second_load}"], log_path=logs / "backlog-after-kill.log")
    first.start()
    collector = first.collector()
    peaks = {"in_flight": 0.0, "rss": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            run = second if second.pipeline_alive() else first
            try:
                peaks["in_flight"] = max(peaks["in_flight"], requests_at_server(vllm_server.base_url))
                pipeline = psutil.Process(run.process.pid)
                tree = [pipeline, *pipeline.children(recursive=True)]
                peaks["rss"] = max(peaks["rss"], sum(p.memory_info().rss for p in tree if p.is_running()))
            except (psutil.Error, OSError, AttributeError):
                pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    ids = [f"backlog-{i}" for i in range(BACKLOG)]
    try:
        first.publish([{"id": "warm-up", "prompt": "Say hi.", "max_tokens": 2}])
        assert not collector.wait_for(["warm-up"], 300), first.log_tail()
        sampler.start()
        published_at = time.time()
        first.publish({"id": request_id, "prompt": f"Name a number bigger than {i}."}
                      for i, request_id in enumerate(ids))
        assert wait_until(lambda: len(collector.finished_ids() & set(ids)) >= KILL_AFTER, 600), first.log_tail()
        first.kill()
        killed_at, finished_by_kill = time.time(), len(collector.finished_ids() & set(ids))
        second.start()
        # What the first took and had not finished, or not yet published, died with it (on Dataflow it would
        # survive in state); everything else must still have been in the subscription.
        assert wait_until(lambda: len(set(ids) - collector.finished_ids()) <= MAX_HELD + COLLECTOR_LAG, 900), (
            f"{len(set(ids) - collector.finished_ids())} without an outcome:\n{second.log_tail()}")
    finally:
        stop.set()
        collector.stop()
        first.kill()
        second.stop()
    letters = [d.data for d in collector.dead_letters if d.data.get("id", "").startswith("backlog-")]
    assert not letters, f"{len(letters)} dead letters, e.g. {letters[0]['reason']}"
    finished = sorted(c.at for c in collector.completions if c.data["id"].startswith("backlog-"))
    first_lines, second_lines = load_lines(first_load), load_lines(second_load)
    assert first_lines and second_lines, "the launcher wrote no load log"
    rate = len([t for t in finished if t <= killed_at]) / max(killed_at - published_at, 1e-3)
    # When each request ended at the worker (its record's own stamp, same clock), not when the collector got it:
    # on two busy cores the sink's publish can trail the end by seconds, which read as requests still held.
    outcomes = sorted([c.data["finished_at"] for c in collector.completions]
                      + [d.data.get("at") or d.at for d in collector.dead_letters])

    # The step's own count of what it holds, and the same measured from outside: taken by the read
    # minus outcomes received by then (in flight at the engine counts; a completion on its way may lag).
    print(f"\nbacklog: {BACKLOG} requests, {BACKLOG / (rate * BACKLOG_TIMEOUT_S):.0f}x what finishes within "
          f"request_timeout_s={BACKLOG_TIMEOUT_S} ({rate:.1f}/s); max_in_flight={BACKLOG_IN_FLIGHT}, "
          f"worker_queue={BACKLOG_QUEUE}; first pipeline killed after {finished_by_kill} completions")
    print("   s  pipeline  held (step)  taken-done  not yet taken (in Pub/Sub)")
    done_by_kill = sum(1 for at in outcomes if at <= killed_at)
    for name, lines, offset in (("first", first_lines, 0), ("second", second_lines, first_lines[-1]["taken"])):
        for n, line in enumerate(lines):
            done = sum(1 for at in outcomes if at <= line["t"])
            outside = line["taken"] - (done if name == "first" else done - done_by_kill)
            if n % 10 == 0 or n == len(lines) - 1:
                print(f"{line['t'] - published_at:5.0f}  {name:8}  {line['held']:11}  {outside:10}  "
                      f"{BACKLOG + 1 - line['taken'] - offset:5}")
            # A key's report trails its submit by one call: a request being sent can count twice, briefly.
            assert line["held"] <= MAX_HELD + BACKLOG_IN_FLIGHT, line
            # Outside, a completion the first pipeline made but did not publish before its kill is never counted.
            assert outside <= MAX_HELD + COLLECTOR_LAG, (name, line, done)
    assert first_lines[-1]["taken"] < BACKLOG / 2, "the first pipeline must have left most of the backlog in Pub/Sub"
    print(f"peak in flight at the server {peaks['in_flight']:.0f}; peak pipeline memory {peaks['rss'] / 2**20:.0f} MiB")
    assert peaks["in_flight"] <= BACKLOG_IN_FLIGHT, "the engine must not queue the backlog at the server"
    assert peaks["rss"] < 2 * 2**30, "pipeline memory (without the server) must stay bounded"
