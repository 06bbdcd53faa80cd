"""What a production stream does to the template, end to end (emulator → ``python -m template.main`` → vLLM).

* Hostile messages, redeliveries, reused ids and a ``kill -9`` of the model
  server mixed into valid traffic: every input ends with exactly one outcome,
  each completion's chunk stream is whole, and the pipeline still serves after.
* A backlog several times what can finish within ``request_timeout_s``: every
  request is served, none times out waiting, and the engine stays bounded.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import psutil
import pytest

from local import core_placement
from local.cpu_server import LOCAL_SERVER
from local.harness import REPO_ROOT, LocalRun, OutputCollector, requests_at_server, server_pids_in_log
from tests.conftest import SERVED_NAME, wait_until
from tests.hostile_inputs import carries_too_long_id, hostile_corpus

pytestmark = pytest.mark.engine

LONG = [{"id": f"long-{i}", "prompt": f"Count from 1 to 500 in digits, separated by commas. Start at {i}.",
         "temperature": 0, "max_tokens": 160} for i in range(4)]
SHORT = [{"id": f"short-{i}", "prompt": q, "max_tokens": 16} for i, q in enumerate(
    ["What is 2 + 2?", "Name a color.", "Say hello.", "Name a fruit.", "What is ice?", "Say yes."])]
# Plain text that starts like JSON, served as text; and a JSON-looking payload marked as text.
TEXT_LIKE_JSON = {"inst-text": "[INST] Name a planet. [/INST]", "brace-text": "{name} is a placeholder. Say ok."}
MARKED_TEXT = ("marked-text", '{"prompt": "this is all prompt text"} Say ok.')
REUSED = [{"id": "short-0", "prompt": "A different question that reuses an id: name a tree.", "max_tokens": 8},
          {"id": "long-1", "prompt": "Another request reusing a long id.", "max_tokens": 8}]
AFTER = [{"id": f"after-{i}", "prompt": "Name an animal.", "max_tokens": 8} for i in range(3)]
HOSTILE = hostile_corpus(seed=2026, size=60)
# A payload id too long for an ordering key overrides the attribute id: its dead letter has no id.
NAMELESS = {f"hostile-{i}" for i, (payload, _) in enumerate(HOSTILE) if carries_too_long_id(payload)}
HOSTILE_IDS = [f"hostile-{i}" for i in range(len(HOSTILE))]


def chunk_streams(collector) -> dict[str, list[dict]]:
    streams: dict[str, dict[int, dict]] = defaultdict(dict)
    for chunk in collector.chunks:
        streams[chunk.data["stream"]][chunk.data["seq"]] = chunk.data  # a redelivery is one chunk
    return {key: [seqs[s] for s in sorted(seqs)] for key, seqs in streams.items()}


@dataclass(frozen=True)
class HostileRun:
    """The pipeline after the hostile traffic: its vLLM was killed mid-stream (that server's pid and the cores its
    engine was bound to) and restarted by the model manager."""

    run: LocalRun
    collector: OutputCollector
    killed_pid: int
    killed_cores: frozenset[int]


@pytest.fixture(scope="module")
def hostile_run(checkpoint, emulator):
    local_run = LocalRun([f"--model={checkpoint}", f"--served_model_name={SERVED_NAME}",
                          *LOCAL_SERVER.template_args(), "--num_shards=4", "--max_in_flight=8",
                          "--default_max_tokens=24", "--chunk_tokens=4", "--chunk_interval_ms=100"],
                         log_path=REPO_ROOT / ".cache" / "test-e2e" / "resilience.log", emulator=emulator)
    local_run.start()
    collector = local_run.collector()
    try:
        local_run.publish([{"id": "warm-up", "prompt": "Say hi.", "max_tokens": 4}])
        assert not collector.wait_for(["warm-up"], 600), "the pipeline never served:\n" + local_run.log_tail()
        local_run.publish(LONG + SHORT)
        local_run.publish(LONG[:2] + SHORT[:2])  # redeliveries / publisher retries of the same requests
        local_run.publish(REUSED)
        for request_id, text in TEXT_LIKE_JSON.items():
            local_run.publish([text], attributes={"id": request_id})
        local_run.publish([MARKED_TEXT[1]], attributes={"id": MARKED_TEXT[0], "content_type": "text/plain"})
        for index, (payload, _) in enumerate(HOSTILE):
            local_run.publish([payload], attributes={"id": f"hostile-{index}"})
        # kill -9 the model server while the long requests stream.
        assert wait_until(lambda: any(c.data["id"].startswith("long-") and c.data["seq"] >= 2
                                      for c in collector.chunks), 300), local_run.log_tail()
        server_pid = server_pids_in_log(local_run.log_path.read_text())[-1]
        model_cores = core_placement.bound_cores(server_pid)
        os.kill(server_pid, signal.SIGKILL)
        time.sleep(2)
        local_run.publish(LONG[2:3])  # a redelivery while the server is down
        wanted = ([r["id"] for r in LONG + SHORT] + list(TEXT_LIKE_JSON) + [MARKED_TEXT[0]]
                  + [i for i in HOSTILE_IDS if i not in NAMELESS])
        missing = collector.wait_for(wanted, 900)
        assert not missing, f"no outcome for {missing}:\n{local_run.log_tail()}"
        local_run.publish(AFTER)  # still serving after all of it
        missing = collector.wait_for(wanted + [r["id"] for r in AFTER], 300)
        assert not missing, f"no outcome for {missing}:\n{local_run.log_tail()}"
        unfinished = collector.wait_for_streams({c.data["stream"] for c in collector.completions}, 60)
        assert not unfinished, f"streams without all their chunks: {unfinished}\n{local_run.log_tail()}"
        yield HostileRun(local_run, collector, server_pid, model_cores)
    finally:
        collector.stop()
        local_run.stop()


def test_every_input_ends_with_exactly_one_outcome(hostile_run):
    collector = hostile_run.collector
    completions = Counter(c.data["id"] for c in collector.completions)
    letters = Counter(d.data.get("id") for d in collector.dead_letters)
    assert all(n == 1 for n in completions.values()), completions
    expected = ({r["id"] for r in LONG + SHORT + AFTER} | set(TEXT_LIKE_JSON) | {MARKED_TEXT[0], "warm-up"}
                | set(HOSTILE_IDS) - NAMELESS)
    assert expected <= set(completions) | set(letters)
    # Each hostile message once; the two reused ids once more each, as dead letters; nothing else.
    assert all(completions[i] + letters[i] == 1 for i in HOSTILE_IDS if i not in NAMELESS)
    assert letters[None] == len(NAMELESS) and all(letters[i] == 0 for i in NAMELESS)
    assert sum(completions.values()) + sum(letters.values()) == len(expected) + len(NAMELESS) + len(REUSED)


def test_duplicates_are_served_once_and_a_reused_id_is_refused_by_name(hostile_run):
    collector = hostile_run.collector
    completions = {c.data["id"]: c.data for c in collector.completions}
    for request in LONG + SHORT:
        assert request["id"] in completions, request["id"]
        assert completions[request["id"]]["prompt"] == request["prompt"], "never another request's answer"
    reuse_letters = [d.data for d in collector.dead_letters if d.data.get("id") in {r["id"] for r in REUSED}]
    assert sorted(d["id"] for d in reuse_letters) == sorted(r["id"] for r in REUSED)
    assert all("another request with this id" in d["reason"] for d in reuse_letters)
    assert {json.loads(d["payload"])["prompt"] for d in reuse_letters} == {r["prompt"] for r in REUSED}


def test_text_that_looks_like_json_is_served_as_text(hostile_run):
    collector = hostile_run.collector
    completions = {c.data["id"]: c.data for c in collector.completions}
    for request_id, text in [*TEXT_LIKE_JSON.items(), MARKED_TEXT]:
        assert completions[request_id]["prompt"] == text


def test_after_a_kill_9_every_completion_has_a_whole_chunk_stream(hostile_run):
    collector, server_pid = hostile_run.collector, hostile_run.killed_pid
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
    assert "Restarting vLLM server" in hostile_run.run.log_path.read_text()
    streams = chunk_streams(collector)
    completions = {c.data["id"]: c.data for c in collector.completions}
    assert any(c["attempt"] > 1 for c in completions.values()), "the kill should have cut a stream mid-way"
    for request_id, completion in completions.items():
        chunks = streams[completion["stream"]]
        assert [c["seq"] for c in chunks] == list(range(len(chunks))), request_id
        assert chunks[-1]["final"] and not any(c["final"] for c in chunks[:-1]), request_id
        assert "".join(c["text"] for c in chunks) == completion["text"], request_id


def test_the_restarted_vllm_is_bound_to_the_cores_the_killed_one_had(hostile_run):
    """The pipeline moved its own threads off the model's cores once the first server started (as on a CPU
    worker), the model manager's among them: the server it starts again must not inherit what is left to them."""
    restarted = server_pids_in_log(hostile_run.run.log_path.read_text())[-1]
    assert restarted != hostile_run.killed_pid
    assert hostile_run.killed_cores and core_placement.bound_cores(restarted) == hostile_run.killed_cores


def test_hostile_dead_letters_say_where_and_why_and_keep_the_raw_message(hostile_run):
    collector = hostile_run.collector
    raw = {f"hostile-{i}": payload for i, (payload, _) in enumerate(HOSTILE)}
    for letter in (d.data for d in collector.dead_letters):
        assert letter["stage"] in ("parse", "validate", "measure", "batch", "inference", "sink") and letter["reason"]
        if letter.get("id") not in raw:
            continue
        kept = (base64.b64decode(letter["payload"]) if letter["payload_encoding"] == "base64"
                else letter["payload"].encode("utf-8", "surrogatepass"))
        if letter["stage"] == "parse" or kept == raw[letter["id"]]:
            assert kept == raw[letter["id"]]
        else:  # refused after parsing (e.g. too long for the context): the request as parsed
            request = json.loads(kept)
            assert request["id"] == letter["id"] and "received_at" in request
    reasons = " ".join(d.data["reason"] for d in collector.dead_letters)
    # Refused by the contract's own checks, not caught by the last-resort element guard or the engine.
    assert "stage failed on this message" not in reasons and "internal error" not in reasons


# The backlog -----------------------------------------------------------------------------------------

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
