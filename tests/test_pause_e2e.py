"""A pause is not a key move, end to end: the pipeline process stopped (SIGSTOP) for longer than the stream lease.

A worker process can stop for seconds to minutes while its model server goes on (a long GC, memory pressure, a
live migration); its timers then fire late, all at once. Here the pipeline runs as users run it
(``python -m local.direct_runner`` on the Pub/Sub emulator, with the engine's host process, which a SIGSTOP to
the pipeline's process does not reach), with ``stream_lease_s=4``, and is stopped for 15 s while long answers
stream, then for 20 s while short ones finish at the server. Every request must end with one completion of
attempt 1 and one chunk stream: nothing generated twice.

The streams' leases live in the engine's registry whichever server it talks to, so the run uses the suite's
vLLM (``--server_url``) and starts none of its own: what owning the server changes is proved by the end-to-end
tests of the managed server (tests/test_pipeline_e2e.py's vLLM run, its kill -9 among them).
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import pytest

from local.harness import REPO_ROOT, LocalRun
from tests.conftest import SERVED_NAME, wait_until

pytestmark = pytest.mark.engine
LEASE_S = 4
# Five leases: a finished stream's text kept for the lease, not for request_timeout_s, would be gone long before
# the pipeline resumes, and its request generated again (attempt 2).
LONG_PAUSE_S = 5 * LEASE_S


def requests(prefix: str, count: int, tokens: int) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "prompt": f"Count from {i} to 400 in digits, separated by commas.",
             "temperature": 0, "max_tokens": tokens, "min_tokens": tokens} for i in range(count)]


@pytest.fixture(scope="module")
def paused_run(vllm_server, emulator):
    run = LocalRun([f"--server_url={vllm_server.base_url}", f"--served_model_name={SERVED_NAME}", "--num_shards=2",
                    f"--stream_lease_s={LEASE_S}", "--chunk_tokens=8", "--chunk_interval_ms=100"],
                   log_path=REPO_ROOT / ".cache" / "test-e2e" / "pause.log", emulator=emulator)
    run.start()
    collector = run.collector()
    try:
        run.publish([{"id": "warm-up", "prompt": "Say ok.", "max_tokens": 4}])
        assert not collector.wait_for({"warm-up"}, timeout_s=600), run.log_tail()
        yield run, collector
    finally:
        collector.stop()
        run.stop()


def pause(run: LocalRun, seconds: float) -> None:
    os.kill(run.process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(run.process.pid, signal.SIGCONT)


def outcomes(collector, ids: list[str]) -> tuple[dict, dict]:
    completions = defaultdict(list)
    for received in collector.completions:
        completions[received.data["id"]].append(received.data)
    streams = defaultdict(set)
    for received in collector.chunks:
        streams[received.data["id"]].add(received.data["stream"])
    return {i: completions[i] for i in ids}, {i: streams[i] for i in ids}


def assert_served_once(run: LocalRun, collector, ids: list[str]) -> None:
    assert not collector.wait_for(set(ids), timeout_s=300), run.log_tail()
    time.sleep(3)  # a completion can arrive before its stream's last chunks (another topic)
    completions, streams = outcomes(collector, ids)
    for request_id in ids:
        assert len(completions[request_id]) == 1, (request_id, completions[request_id])
        completion = completions[request_id][0]
        assert completion["attempt"] == 1, (request_id, completion["attempt"])
        assert streams[request_id] == {completion["stream"]}, (request_id, streams[request_id])
    assert not collector.dead_letters, [d.data for d in collector.dead_letters]


def test_a_pause_longer_than_the_lease_mid_stream_generates_nothing_twice(paused_run):
    run, collector = paused_run
    batch = requests("mid", 4, 96)
    run.publish(batch)
    ids = [r["id"] for r in batch]
    assert wait_until(lambda: {c.data["id"] for c in collector.chunks} >= set(ids), timeout_s=120), run.log_tail()
    pause(run, 15)
    assert_served_once(run, collector, ids)


def test_streams_that_finish_at_the_server_during_a_long_pause_are_collected_not_regenerated(paused_run):
    run, collector = paused_run
    batch = requests("short", 4, 12)
    run.publish(batch)
    ids = [r["id"] for r in batch]
    assert wait_until(lambda: any(c.data["id"] in ids for c in collector.chunks), timeout_s=120), run.log_tail()
    pause(run, LONG_PAUSE_S)
    assert_served_once(run, collector, ids)
    log = run.log_path.read_text(errors="replace")
    assert "sent again as" not in log and "not polled for stream_lease_s" not in log
