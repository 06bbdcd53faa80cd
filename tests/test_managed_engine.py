"""The managed vLLM as a worker runs it: the engine the template builds from its parameters, its server started,
watched and restarted by the engine's own manager (never a server_url), with a root of adapters and a bulk lane.

One engine serves the embedded model and a root with one adapter (built here with peft, untrained: its random
weights change the answers), one slot for the root, and a server that runs two sequences at a time
(``--max-num-seqs 2``), so requests queue at vLLM itself. The tests hold the adapter's digest while a stream of
the model runs (a large adapter hashes for as long), kill the server under the engine, take the adapter from the
server behind the engine's back (what a restart between a slot's load and its request leaves: the server answers
404), send a burst that mixes seeds, greedy requests, the adapter and other traffic, and send a live request
while bulk ones wait at the server.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import signal
import threading
import time
import urllib.request

import psutil
import pytest

from local.cpu_server import LOCAL_SERVER
from local.engine_driver import drive_to_end
from local.toy_adapters import build_adapter
from pipeline.config.settings import JobSettings
from pipeline.contract.messages import InferenceRequest
from pipeline.engines import vllm_engine as vllm_engine_module
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.serving.lineage import folder_digest, seed_for
from pipeline.serving.vllm_server import server_metrics
from tests.conftest import SERVED_NAME, process_tree, wait_until

pytestmark = pytest.mark.engine

ADAPTER = "reviewer"
# Questions the model answers by wide margins, so that no batch's numeric noise tips a greedy token.
QUESTION = "What is two plus two?"
POEM = "Write one line of a poem about the sea."


@pytest.fixture(scope="module")
def root(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("root")
    build_adapter(checkpoint, folder / ADAPTER, seed=3)
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint, root):
    """The engine a worker builds from the template's parameters, with a root of adapters, one slot for it."""
    project = "projects/my-project"
    settings = JobSettings.from_mapping({
        "input_subscription": f"{project}/subscriptions/unused", "output_chunks_topic": f"{project}/topics/unused",
        "dead_letter_topic": f"{project}/topics/unused", "model": str(checkpoint), "dtype": LOCAL_SERVER.dtype,
        "served_model_name": SERVED_NAME, "vllm_args": " ".join((*LOCAL_SERVER.vllm_args, "--max-num-seqs", "2")),
        "server_start_timeout_s": "900", "lora_adapter_root": f"{root}/", "max_loras": "1", "max_lora_rank": "8",
        "chunk_tokens": "4", "bulk_subscription": f"{project}/subscriptions/bulk", "max_in_flight": "16",
        # The lane at its fixed share: under a loaded suite, live latencies past the objectives would halve its
        # cap and refuse the live-first test's bulk requests (tests/test_lane_governor.py tests the governor).
        "live_first_token_slo_ms": "0", "live_inter_token_slo_ms": "0"}).engine
    assert settings.server is not None and settings.server.adapter_root is not None and settings.priority_scheduling
    # Restarts found within seconds: the server's health is asked every second.
    server = dataclasses.replace(settings.server, stall_timeout_s=10.0, health_interval_s=1.0)
    # Chunks through poll(), as the pipeline takes them without a chunk topic: nothing here reaches Pub/Sub.
    built = vllm_engine(dataclasses.replace(settings, server=server, request_timeout_s=300, chunk_topic=None,
                                            chunks_to_pipeline=True))
    yield built
    tree = process_tree(built.backend._server)
    built.close()
    assert wait_until(lambda: not any(psutil.pid_exists(pid) for pid in tree), 10), "the close left processes behind"


def ask(engine, request_id: str, prompt: str = QUESTION, **fields) -> dict:
    request = InferenceRequest(id=request_id, prompt=prompt, max_tokens=fields.pop("max_tokens", 12),
                               received_at=time.time(), **fields)
    (completion,) = drive_to_end(engine, [request], timeout_s=300).completions()
    return completion


def test_streams_keep_delivering_while_an_adapters_digest_is_computed(engine, root, monkeypatch):
    """The digest of every file of an adapter (gigabytes for a large one) is read off the engine's event loop:
    held here until a whole answer of the model has streamed meanwhile. On the loop, that answer would wait."""
    hashing, release = threading.Event(), threading.Event()
    real = vllm_engine_module.adapter_lineage

    def held(location, path):
        found = real(location, path)
        hashing.set()
        release.wait(120)
        return found

    monkeypatch.setattr(vllm_engine_module, "adapter_lineage", held)
    tuned: list[dict] = []
    thread = threading.Thread(target=lambda: tuned.append(ask(engine, "tuned-while-hashed", adapter=ADAPTER)))
    thread.start()
    try:
        assert hashing.wait(300), "the adapter was loaded into the server and its digest begun"
        meanwhile = drive_to_end(engine, [InferenceRequest(id="meanwhile", prompt=POEM, max_tokens=24,
                                                           temperature=0, received_at=time.time())], timeout_s=60)
    finally:
        release.set()
        thread.join(timeout=300)
    chunks = [record for kind, record in meanwhile.outputs["meanwhile"] if kind == "chunk"]
    assert len(chunks) >= 2 and meanwhile.completions()[0]["usage"]["completion_tokens"] > 0, meanwhile.outputs
    (completion,) = tuned
    assert completion["lineage"]["adapter"]["config"] == folder_digest(root / ADAPTER)
    # Its cached prefix blocks are salted by that digest: a copy of other weights under the same name and path
    # (a root adapter copied again after it changed) never reuses them.
    _, body = engine.backend.payload(InferenceRequest(id="next", prompt=QUESTION, adapter=ADAPTER))
    assert body["cache_salt"] == folder_digest(root / ADAPTER) and body["model"] == ADAPTER
    assert "cache_salt" not in engine.backend.payload(InferenceRequest(id="plain", prompt=QUESTION))[1]


def test_a_stalled_server_restarted_and_one_that_lost_the_adapter_load_it_again_and_the_lineage_stays_right(
        engine, root, caplog, monkeypatch):
    """The server stalls (alive, answering nothing): the engine's manager kills it and starts a new one, which holds
    no root adapter; the next request for it loads it again and answers as before, and what the new server's engine
    says it loaded is read again into the lineage (the first reading fails here, and the next request reads it
    again). Then the server is made to forget the adapter without a restart: its 404 reloads it, and the answer is
    still the adapter's. Greedy, each alone: the same answer every time."""
    caplog.set_level(logging.INFO, logger=vllm_engine_module.__name__)
    first, plain = ask(engine, "tuned-0", adapter=ADAPTER, temperature=0), ask(engine, "plain-0", temperature=0)
    assert first["text"] != plain["text"], "the adapter changes the answer"
    digest = folder_digest(root / ADAPTER)
    assert first["lineage"]["adapter"]["config"] == digest and plain["lineage"]["adapter"] is None
    server = engine.backend._server
    read_before, loaded, restarts, old_pid = engine.lineage, server.loaded, server.stats.restarts, server.pid
    assert loaded["dtype"] == LOCAL_SERVER.dtype and loaded["max_seq_len"] == str(server.spec.max_model_len), loaded

    since = len(caplog.records)
    real_read, failed = engine.backend._read_lineage, []

    def read_failing_once(settings, strict=False):
        if strict and not failed:
            failed.append(True)
            raise ConnectionError("the restarted server's /v1/models did not answer")
        return real_read(settings, strict)

    monkeypatch.setattr(engine.backend, "_read_lineage", read_failing_once)
    monkeypatch.setattr(vllm_engine_module, "LINEAGE_RETRY_S", 0.0)
    os.kill(old_pid, signal.SIGSTOP)  # alive but unresponsive
    try:
        assert wait_until(lambda: server.stats.restarts == restarts + 1, 60), "the manager restarts it"
    finally:
        if psutil.pid_exists(old_pid):
            os.kill(old_pid, signal.SIGCONT)
    server.wait_until_healthy(600)
    assert server.pid != old_pid and wait_until(lambda: not psutil.pid_exists(old_pid), 30)
    assert wait_until(lambda: server.loaded is not loaded and server.loaded == loaded, 30), \
        "the new server's engine said again what it loaded"
    again = ask(engine, "tuned-1", adapter=ADAPTER, temperature=0)
    assert again["text"] == first["text"] and again["lineage"]["adapter"]["config"] == digest
    assert failed and engine.lineage is read_before, "the reading failed: the answers kept the lineage read before"
    ask(engine, "plain-after", temperature=0)
    assert engine.lineage is not read_before, "the next answer read the restarted server's lineage again"
    assert ask(engine, "plain-1", temperature=0)["text"] == plain["text"], "greedy, alone: the same answer"
    lineage = json.loads(json.dumps(engine.lineage.record(InferenceRequest(id="x", prompt="x", adapter=ADAPTER))))
    expected = {**first["lineage"], "sampling": lineage["sampling"]}
    assert lineage == expected, "the new server loaded what the old one had"

    with urllib.request.urlopen(urllib.request.Request(  # the server forgets it; the engine still counts it loaded
            f"{server.base_url}/v1/unload_lora_adapter", data=json.dumps({"lora_name": ADAPTER}).encode(),
            headers={"Content-Type": "application/json"}), timeout=30) as answer:
        assert answer.status == 200
    lost = ask(engine, "tuned-2", adapter=ADAPTER, temperature=0)
    assert lost["text"] == first["text"] and lost["lineage"]["adapter"]["config"] == digest
    said = [record.getMessage() for record in caplog.records[since:]]
    assert any(f"the server no longer had adapter {ADAPTER}" in line for line in said), said
    assert sum(line.startswith(f"Loaded adapter {ADAPTER} ") for line in said) == 2, \
        "loaded again after the restart and after the 404"

    engine.backend._adapter_slots.forget_one(ADAPTER)  # as an unload that failed leaves it: the server still has it
    held = ask(engine, "tuned-3", adapter=ADAPTER, temperature=0)
    assert held["text"] == first["text"] and held["lineage"]["adapter"]["config"] == digest
    said = [record.getMessage() for record in caplog.records[since:]]
    assert any(line.startswith(f"The server still held adapter {ADAPTER}") for line in said), said
    assert sum(line.startswith(f"Loaded adapter {ADAPTER} ") for line in said) == 3, \
        "unloaded and loaded again from the copy its lineage records"


def test_in_a_concurrent_burst_a_recorded_seed_gives_its_text_again_and_another_seed_another(engine):
    """A burst of ten at once, two running at a time: requests of the model and of the adapter, sampled and
    greedy. The seed one request drew from its id (its lineage records it) gives another request the same text in
    the same burst, though the two ran beside other requests, and again in a later burst of other requests; the
    next seed gives a different text. Greedy
    answers are not compared here: a greedy token tips on the numeric noise of the company it is computed in
    (two greedy copies of one question in such a burst were seen to part at their third token), which is why
    docs/contract.md#lineage promises a greedy answer again only alone or in the same company (the test above
    asks each alone); a seeded draw tips only where the noise straddles the drawn point."""
    now = time.time()

    def request(request_id: str, prompt: str = POEM, **fields) -> InferenceRequest:
        return InferenceRequest(id=request_id, prompt=prompt, max_tokens=12, received_at=now, **fields)

    drawn = request("drawn", temperature=1.0)  # no seed: one drawn from its id
    seed = seed_for(drawn)
    burst = [drawn, request("same-seed", temperature=1.0, seed=seed),
             request("next-seed", temperature=1.0, seed=seed + 1),
             request("greedy-a", QUESTION, temperature=0), request("greedy-b", QUESTION, temperature=0),
             request("tuned", QUESTION, temperature=0, adapter=ADAPTER),
             request("tuned-sampled", temperature=0.8, adapter=ADAPTER),
             *[request(f"traffic-{n}", f"Count from {n} to {n + 5}.", temperature=0.7) for n in range(3)]]
    answers = {c["id"]: c for c in drive_to_end(engine, burst, poll_s=0.02, timeout_s=300).completions()}
    assert set(answers) == {r.id for r in burst}
    assert answers["drawn"]["lineage"]["sampling"]["seed"] == seed
    assert answers["same-seed"]["text"] == answers["drawn"]["text"], "the recorded seed gives its text again"
    assert answers["next-seed"]["text"] != answers["drawn"]["text"], "another seed samples another text"
    assert answers["tuned"]["lineage"]["adapter"]["name"] == ADAPTER
    assert answers["greedy-a"]["lineage"]["adapter"] is None
    # Later, in other company (more requests, in another order, none of the first burst's): the seed the
    # completion recorded regenerates its text. No adapter requests in it: on vLLM's CPU build a request for the
    # model batched beside adapter requests can get an adapter's weights (vllm-project/vllm#48421, which the extra
    # slot of pipeline.serving.vllm_server works around); run after this module's reloads of the adapter, such a
    # burst gave the model's request another text from its first token (seen 2026-12-07; the CUDA build's kernels
    # skip those requests).
    recorded = answers["drawn"]["lineage"]["sampling"]["seed"]
    later = [*[request(f"later-{n}", f"Name {n + 2} colors.", temperature=0.9) for n in range(4)],
             request("regenerated", temperature=1.0, seed=recorded),
             *[request(f"later-{n}", f"Count from {n} to {n + 7}.", temperature=0.5) for n in range(4, 6)]]
    again = {c["id"]: c for c in drive_to_end(engine, later, poll_s=0.02, timeout_s=300).completions()}
    assert again["regenerated"]["text"] == answers["drawn"]["text"], "the recorded seed regenerates the text later"
    assert again["regenerated"]["lineage"]["sampling"]["seed"] == recorded


def test_a_live_request_sent_while_bulk_ones_wait_at_the_server_has_its_first_chunk_before_any_of_them(engine):
    """Two long bulk requests fill the server's two sequences and four more queue at vLLM; a live request sent then,
    and a bulk one after it, queue behind them. vLLM does not preempt a running request for a waiting one of higher
    priority (its scheduler admits waiting requests only into free sequences), so one long stream is cancelled:
    of the six waiting, priority scheduling (the template sets it for a bulk lane: live 0, bulk 1) gives the one
    free sequence to the live request, whose first chunk comes before that of every bulk request that had none when
    it was sent. First come, first served, it would wait for the four.

    Freeing exactly one sequence matters: two streams that end on the same step (CI met it with equal bulk
    requests) free two, and a bulk request then starts beside the live one, legitimately. First chunks are
    ordered by the poll that brought them, so a tie within one poll never reads as either first."""
    base_url = engine.backend.base_url
    now = time.time()

    def bulk(request_id: str, tokens: int = 48) -> InferenceRequest:
        return InferenceRequest(id=request_id, prompt=POEM, max_tokens=tokens, min_tokens=tokens, temperature=0,
                                lane="bulk", received_at=now)

    ids: dict[str, str] = {}
    first: dict[str, int] = {}  # request id -> the poll that brought its first chunk
    taken: dict[str, int] = {}
    done: set[str] = set()
    polls = itertools.count()

    def send(requests: list[InferenceRequest]) -> None:
        keys = engine.submit_batch([r.to_json() for r in requests], [1] * len(requests))
        assert None not in keys, "the engine takes them all (its bulk share is 12)"
        for key, request in zip(keys, requests, strict=True):
            ids[key], taken[key] = request.id, 0

    def poll() -> None:
        n = next(polls)
        for key, items in engine.poll({k: taken[k] for k in taken if ids[k] not in done}).items():
            taken[key] += len(items)
            for kind, _ in items:
                first.setdefault(ids[key], n)
                if kind in ("completion", "dead_letter"):
                    done.add(ids[key])

    def waiting_at_server() -> float:
        poll()
        return server_metrics(base_url, ("vllm:num_requests_waiting",))["vllm:num_requests_waiting"]

    def started(*request_ids: str) -> bool:
        poll()
        return set(request_ids) <= set(first)

    def cancel(request_id: str) -> None:
        engine.cancel([key for key, known in ids.items() if known == request_id])
        done.add(request_id)

    send([bulk("long-0", tokens=1500), bulk("long-1", tokens=1500)])  # cancelled long before they end
    assert wait_until(lambda: started("long-0", "long-1"), 120), "both long ones run"
    queued = [f"bulk-{n}" for n in range(4)]
    send([bulk(request_id) for request_id in queued])
    assert wait_until(lambda: waiting_at_server() >= 4, 120), "four bulk requests queue at the server"
    send([InferenceRequest(id="live", prompt=QUESTION, max_tokens=8, temperature=0, received_at=time.time())])
    send([bulk("bulk-after")])
    assert wait_until(lambda: waiting_at_server() >= 6, 120), "the live one and the one after it queue too"
    assert not set(first) & {*queued, "live", "bulk-after"}, "none of them could start: both sequences are held"
    cancel("long-0")
    assert wait_until(lambda: started("live"), 120), "the live request takes the sequence freed"
    assert not set(first) & {*queued, "bulk-after"}, f"a bulk request started with the live one: {sorted(first)}"
    cancel("long-1")
    deadline = time.monotonic() + 300
    while len(done) < len(ids) and time.monotonic() < deadline:
        poll()
        time.sleep(0.02)
    engine.poll({key: n for key, n in taken.items() if not ids[key].startswith("long-")})  # releases the finished
    assert done == set(ids.values()), f"every request answered: {sorted(set(ids.values()) - done)}"
    later = {request_id: first[request_id] - first["live"] for request_id in (*queued, "bulk-after")}
    assert min(later.values()) > 0, f"polls after the live one's first chunk: {later}"
