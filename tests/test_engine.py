"""The worker's streaming engine against the real local vLLM server."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from local.engine_driver import drive_to_end
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import ATTEMPT, CHUNK, COMPLETION, DEAD_LETTER
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.serving.server_platform import ServerStartError
from pipeline.serving.vllm_server import RUNNING_METRIC, ServerSpec, free_port, server_metrics
from tests.conftest import SERVED_NAME, wait_until
from tests.test_accelerator_time import union_seconds

pytestmark = pytest.mark.engine


def engine_for(url: str, **overrides) -> Engine:
    settings = dict(server=None, server_url=url, served_model_name=SERVED_NAME,
                    chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100), request_timeout_s=120)
    settings.update(overrides)
    return vllm_engine(EngineSettings(**settings))


def run_to_end(engine: Engine, requests: list[InferenceRequest], timeout_s: float = 180):
    """Every request's outputs, driven as the generate step drives the engine, never past max_in_flight."""
    def within_bound() -> None:
        assert engine.in_flight() <= engine.settings.max_in_flight

    return drive_to_end(engine, requests, timeout_s=timeout_s, each_poll=within_bound).outputs


def test_streams_chunks_that_add_up_to_the_completion(vllm_server):
    engine = engine_for(vllm_server.base_url)
    try:
        requests = [InferenceRequest(id=f"r{i}", prompt=p, max_tokens=n, temperature=0, received_at=time.time())
                    for i, (p, n) in enumerate([("What is the capital of France?", 20),
                                                ("Write a poem about autumn leaves.", 48),
                                                ("List five fruits.", 30)])]
        outputs = run_to_end(engine, requests)
        for request in requests:
            chunks = [data for kind, data in outputs[request.id] if kind == CHUNK]
            (completion,) = [data for kind, data in outputs[request.id] if kind == COMPLETION]
            assert [c["seq"] for c in chunks] == list(range(len(chunks)))
            assert chunks[-1]["final"] and not any(c["final"] for c in chunks[:-1])
            assert "".join(c["text"] for c in chunks) == completion["text"]
            assert completion["usage"]["completion_tokens"] == chunks[-1]["tokens"] > 0
            assert completion["usage"]["prompt_tokens"] > 0 and completion["model"] == SERVED_NAME
            assert completion["finish_reason"] == chunks[-1]["finish_reason"] in ("stop", "length")
        assert "Paris" in [d for k, d in outputs["r0"] if k == COMPLETION][0]["text"]
    finally:
        engine.close()


def test_min_tokens_equal_to_max_tokens_makes_an_answer_that_would_stop_early_run_its_full_length(vllm_server):
    engine = engine_for(vllm_server.base_url)
    try:
        prompt = "What is the capital of France?"
        requests = [InferenceRequest(id=rid, prompt=prompt, temperature=0, max_tokens=24, received_at=time.time(),
                                     **extra) for rid, extra in (("natural", {}), ("fixed", {"min_tokens": 24}))]
        outputs = run_to_end(engine, requests)
        done = {rid: next(data for kind, data in items if kind == COMPLETION) for rid, items in outputs.items()}
        assert done["natural"]["finish_reason"] == "stop" and done["natural"]["usage"]["completion_tokens"] < 24
        assert (done["fixed"]["finish_reason"], done["fixed"]["usage"]["completion_tokens"]) == ("length", 24)
    finally:
        engine.close()


def test_the_engine_asks_vllm_for_one_event_per_chunk_not_one_per_token(vllm_server):
    """stream_interval = chunk_tokens: even a 1 ms interval cannot cut a chunk between the server's events."""
    engine = engine_for(vllm_server.base_url, chunk_policy=ChunkPolicy(chunk_tokens=8, interval_ms=1))
    try:
        request = InferenceRequest(id="coarse", prompt="Count from 1 to 100 in digits.", max_tokens=64, min_tokens=64,
                                   temperature=0, received_at=time.time())
        outputs = run_to_end(engine, [request])
    finally:
        engine.close()
    chunks = [data for kind, data in outputs["coarse"] if kind == CHUNK]
    (completion,) = [data for kind, data in outputs["coarse"] if kind == COMPLETION]
    assert "".join(c["text"] for c in chunks) == completion["text"] and completion["usage"]["completion_tokens"] == 64
    assert [c["seq"] for c in chunks] == list(range(len(chunks))) and chunks[-1]["final"]
    # The first token at once, then events of 8 tokens, the last with what is left: a chunk per event.
    counts = [c["tokens"] for c in chunks]
    gaps = [b - a for a, b in zip(counts, counts[1:]) if b > a]
    assert counts[0] == 1 and set(gaps[:-1]) == {8} and 0 < gaps[-1] <= 8, counts


@pytest.fixture(scope="module")
def strict_server(checkpoint, tmp_path_factory):
    """``transformers serve``: a real OpenAI-compatible server that refuses fields it does not know (HTTP 422)."""
    port = free_port()
    log = tmp_path_factory.mktemp("strict-server") / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "transformers.cli.transformers", "serve", str(checkpoint),
                                    "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return True
        except OSError:
            return process.poll() is not None  # ended: stop waiting, the assertion below says so
    wait_until(healthy, 120, interval_s=0.5)
    assert process.poll() is None, log.read_text()[-3000:]
    yield url, str(checkpoint), log
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_a_server_that_refuses_stream_interval_is_streamed_per_token_after_one_warning(strict_server, caplog):
    """No dead letter: the refused request is sent again without the field, and so is every later one."""
    url, model, log = strict_server
    engine = engine_for(url, served_model_name=model)  # chunk_tokens 4: stream_interval sent at first
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline.engines.vllm_engine"):
            requests = [InferenceRequest(id=f"s{i}", prompt="List three colours.", max_tokens=12, temperature=0,
                                         received_at=time.time()) for i in range(3)]
            outputs = run_to_end(engine, requests[:1])
            outputs.update(run_to_end(engine, requests[1:]))
    finally:
        engine.close()
    for request in requests:
        chunks = [data for kind, data in outputs[request.id] if kind == CHUNK]
        (completion,) = [data for kind, data in outputs[request.id] if kind == COMPLETION]
        assert completion["text"] and "".join(c["text"] for c in chunks) == completion["text"]
        assert completion["usage"]["completion_tokens"] == 12 and chunks[-1]["final"]
    warnings = [r.getMessage() for r in caplog.records if "stream_interval" in r.getMessage()]
    assert len(warnings) == 1 and "every token" in warnings[0], warnings
    assert log.read_text().count("422 Unprocessable") == 1  # the first request refused, no later one sent the field


def test_a_request_the_server_rejects_becomes_a_dead_letter_with_the_servers_reason(vllm_server):
    engine = engine_for(vllm_server.base_url)
    try:
        too_long = InferenceRequest(id="huge", prompt="word " * 5000, max_tokens=10, received_at=time.time())
        outputs = run_to_end(engine, [too_long])
        (kind, letter), = outputs["huge"]
        assert kind == DEAD_LETTER and letter["stage"] == "inference"
        assert "rejected" in letter["reason"] and "2048" in letter["reason"]
        assert json.loads(letter["payload"])["id"] == "huge"
        assert 0 <= letter["accelerator_seconds"] < 1  # it reached the server, which refused it at once
    finally:
        engine.close()


def test_each_answer_carries_its_share_of_the_servers_busy_time_and_the_shares_add_up(vllm_server):
    """accelerator_seconds apportions each moment across the requests running then: a lone request gets its own
    time at the server; over an overlapping burst the shares add up to the time the server had any request,
    measured apart from the engine's ledger as the union of the completions' own [sent, finished] intervals."""
    engine = engine_for(vllm_server.base_url, max_in_flight=8)
    fixed = dict(prompt="Count from one to fifty in words.", temperature=0)
    try:
        alone = run_to_end(engine, [InferenceRequest(id="alone", max_tokens=24, min_tokens=24, received_at=time.time(),
                                                     **fixed)])
        burst = [InferenceRequest(id=f"b{i}", max_tokens=n, min_tokens=n, received_at=time.time(), **fixed)
                 for i, n in enumerate((8, 16, 24, 32, 40, 48))]
        outputs = run_to_end(engine, burst)
    finally:
        engine.close()
    (one,) = [data for kind, data in alone["alone"] if kind == COMPLETION]
    sent = one["received_at"] + one["queue_ms"] / 1000
    assert one["accelerator_seconds"] == pytest.approx(one["finished_at"] - sent, rel=0.05)
    assert one["time_to_first_token_ms"] + one["decode_ms"] == pytest.approx(one["total_ms"], abs=1)
    records = [data for request in burst for kind, data in outputs[request.id] if kind == COMPLETION]
    assert len(records) == len(burst)
    spans = [(r["received_at"] + r["queue_ms"] / 1000, r["finished_at"]) for r in records]
    shares = [r["accelerator_seconds"] for r in records]
    assert sum(shares) == pytest.approx(union_seconds(spans), rel=0.05)
    assert sum(shares) < 0.8 * sum(end - start for start, end in spans)  # they did overlap, and shared
    assert all(0 < share <= end - start + 0.01 for share, (start, end) in zip(shares, spans))


def test_an_unreachable_server_ends_in_a_dead_letter_after_the_timeout():
    engine = engine_for(f"http://127.0.0.1:{free_port()}", request_timeout_s=2)
    try:
        started = time.monotonic()
        outputs = run_to_end(engine, [InferenceRequest(id="x", prompt="hi", received_at=time.time())], timeout_s=30)
        (kind, letter), = outputs["x"]
        assert kind == DEAD_LETTER and "no answer within request_timeout_s=2" in letter["reason"]
        assert time.monotonic() - started < 15
        assert letter["accelerator_seconds"] is None  # it never reached a server
    finally:
        engine.close()


def test_an_engine_whose_server_never_answers_leaves_no_thread_behind(tmp_path, monkeypatch):
    """A runtime rebuilt after its host died may fail again and again (a GPU that does not come back): each
    failed build must leave nothing running, neither the server's supervisor nor the registry's janitor."""
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", f"127.0.0.1:{free_port()}")  # a publisher needs no credentials
    before = {thread.ident for thread in threading.enumerate()}
    failing = [EngineSettings(server=ServerSpec(model=str(tmp_path / "nowhere"), start_timeout_s=30), server_url=None,
                              chunk_topic="projects/local-project/topics/never"),
               EngineSettings(server=None, server_url=f"http://127.0.0.1:{free_port()}", served_model_name=None)]
    for _ in range(3):
        for settings_ in failing:
            with pytest.raises((ServerStartError, OSError)):
                vllm_engine(settings_)
    assert wait_until(lambda: {t.ident for t in threading.enumerate() if t.is_alive()} <= before, 10), \
        [t.name for t in threading.enumerate() if t.ident not in before]


def test_the_workers_load_never_waits_on_the_model_server(vllm_server):
    """A step reads the worker's load inside a key's work item (the generate step's poll timer), and the key's next
    timer waits for that work item: read from vLLM's /metrics there, a busy or stalled server would keep the key
    from polling its streams while its process polls others', and their leases would run out (a flake of the VM
    stand-in's host-kill test, traced). With the server stopped for a few seconds (shorter than its stall
    timeout) the engine still answers at once, and reads the gauges again once the server answers."""
    engine = engine_for(vllm_server.base_url)
    try:
        assert wait_until(lambda: engine.stats()["server_running"] is not None, 10)
        os.kill(vllm_server.pid, signal.SIGSTOP)
        took = []
        try:
            for _ in range(6):
                began = time.monotonic()
                engine.stats()
                took.append(time.monotonic() - began)
                time.sleep(0.5)
            stopped = engine.stats()["server_running"]
        finally:
            os.kill(vllm_server.pid, signal.SIGCONT)
        assert max(took) < 0.5, took
        assert stopped is None, "a server that does not answer has no figures"
        assert wait_until(lambda: engine.stats()["server_running"] is not None, 15)
    finally:
        engine.close()


def test_in_flight_requests_are_bounded(vllm_server):
    engine = engine_for(vllm_server.base_url, max_in_flight=2)
    running: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            running.append(server_metrics(vllm_server.base_url)[RUNNING_METRIC])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        requests = [InferenceRequest(id=f"b{i}", prompt="Tell me a story.", max_tokens=40, received_at=time.time())
                    for i in range(6)]
        assert all(engine.submit_batch([r.to_json() for r in requests[:2]], [1, 1]))
        assert engine.submit_batch([requests[2].to_json()], [1]) == [None], "a full engine refuses instead of queueing"
        outputs = run_to_end(engine, requests)
        assert all(any(k == COMPLETION for k, _ in items) for items in outputs.values())
    finally:
        stop.set()
        sampler.join()
        engine.close()
    assert running and max(running) == 2


def test_a_bulk_lane_that_fills_its_streams_leaves_the_live_reserve_to_live_requests(vllm_server):
    """max_in_flight 4, live_reserve 0.5: bulk requests start beside at most two streams, live ones up to four."""
    engine = engine_for(vllm_server.base_url, max_in_flight=4, bulk_lane=True, live_reserve=0.5)
    try:
        bulk = [InferenceRequest(id=f"bulk{i}", prompt="Tell me a story.", max_tokens=40, received_at=time.time(),
                                 lane="bulk") for i in range(4)]
        live = [InferenceRequest(id=f"live{i}", prompt="Say hi.", max_tokens=4, received_at=time.time())
                for i in range(3)]
        taken = engine.submit_batch([r.to_json() for r in bulk], [1] * 4)
        assert [key is not None for key in taken] == [True, True, False, False]
        taken = engine.submit_batch([r.to_json() for r in live], [1] * 3)
        assert [key is not None for key in taken] == [True, True, False], "live takes the two the bulk lane left"
        outputs = run_to_end(engine, bulk + live)
        completions = {record["id"]: record for items in outputs.values() for kind, record in items
                       if kind == COMPLETION}
        assert {completions[r.id]["lane"] for r in bulk} == {"bulk"}
        assert {completions[r.id]["lane"] for r in live} == {"live"}
    finally:
        engine.close()


def test_a_halving_sheds_running_bulk_streams_at_the_server_and_each_starts_over_and_ends_once(vllm_server):
    """Six bulk streams run; a live request's first token passes a 1 ms objective, so the lane halves to three and
    the engine sheds the three youngest at once: vLLM aborts them (it runs at most three bulk beside the live one
    while they wait), and each starts over when the lane has room again (live idle: its whole share). Every bulk
    request still ends with one completion, the same greedy text as the others, and a shed stream whose chunks
    had gone out starts a new stream of chunks that alone spells its answer."""
    engine = engine_for(vllm_server.base_url, max_in_flight=8, bulk_lane=True, live_reserve=0.25,
                        live_first_token_slo_ms=1.0, live_inter_token_slo_ms=0.0)
    samples: list[tuple[float, int]] = []  # (server running, shed streams waiting to start over)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with engine._lock:
                waiting = len(engine._registry.shed_streams)
            samples.append((server_metrics(vllm_server.base_url)[RUNNING_METRIC], waiting))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        bulk = [InferenceRequest(id=f"bulk{i}", prompt="Tell me a story.", max_tokens=48, min_tokens=48,
                                 temperature=0.0, received_at=time.time(), lane="bulk") for i in range(6)]
        assert all(engine.submit_batch([r.to_json() for r in bulk], [1] * 6))
        assert wait_until(lambda: server_metrics(vllm_server.base_url)[RUNNING_METRIC] == 6, 120)
        sampler.start()
        live = InferenceRequest(id="live", prompt="Say hi.", max_tokens=4, received_at=time.time())
        drive = drive_to_end(engine, [*bulk, live], timeout_s=300)  # the bulk ones join their running streams
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join()
        engine.close()
    assert not drive.dead_letters()
    assert engine.stats()["bulk_streams_shed"] >= 3
    assert any(running <= 4 for running, waiting in samples if waiting == 3), \
        "vLLM aborted the shed streams: at most three bulk beside the live one ran while they waited"
    completions = {record["id"]: record for record in drive.completions()}
    assert sorted(completions) == sorted([*(r.id for r in bulk), "live"])
    texts = {completions[r.id]["text"] for r in bulk}
    assert len(texts) == 1 and all(completions[r.id]["usage"]["completion_tokens"] == 48 for r in bulk), \
        "started over, each shed stream answered what the others did"
    restarted = 0
    for request in bulk:
        outputs = drive.outputs[request.id]
        marks = [n for n, (kind, _) in enumerate(outputs) if kind == ATTEMPT]
        after = outputs[marks[-1] + 1:] if marks else outputs
        chunks = [record for kind, record in after if kind == CHUNK]
        assert "".join(c["text"] for c in sorted(chunks, key=lambda c: c["seq"])) == completions[request.id]["text"]
        assert len({c["stream"] for c in chunks}) == 1 and [c["seq"] for c in chunks] == list(range(len(chunks)))
        restarted += bool(marks)
    assert 1 <= restarted <= 3, "a shed stream whose chunks went out starts a new attempt; the others do not"


TICKET_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["category", "urgency", "summary"],
                 "properties": {"category": {"enum": ["billing", "bug", "other"]},
                                "urgency": {"type": "integer", "minimum": 1, "maximum": 5},
                                "summary": {"type": "string", "maxLength": 60}}}
TICKETS = ["I was charged twice for my subscription this month.", "The app crashes when I open settings.",
           "Can you tell me your opening hours?"]


def test_structured_requests_come_back_as_json_that_fits_their_schema(vllm_server):
    from jsonschema import validate

    from pipeline.contract.structured_output import schema_response_format

    engine = engine_for(vllm_server.base_url)
    ticket_format = schema_response_format(TICKET_SCHEMA, "ticket")
    try:
        requests = [InferenceRequest(id=f"t{i}", prompt=f"Classify this support ticket: {ticket}", max_tokens=200,
                                     temperature=0, seed=1, response_format=ticket_format, received_at=time.time())
                    for i, ticket in enumerate(TICKETS)]
        requests += [
            InferenceRequest(id="cut", prompt=f"Classify this support ticket: {TICKETS[0]}", max_tokens=3,
                             temperature=0, response_format=ticket_format, received_at=time.time()),
            InferenceRequest(id="object", prompt="Give the name and age of a made-up person as JSON.",
                             max_tokens=80, temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                             response_format={"type": "json_object"}, received_at=time.time()),
            InferenceRequest(id="plain", prompt="Say hello.", max_tokens=8, received_at=time.time()),
        ]
        outputs = run_to_end(engine, requests)
    finally:
        engine.close()
    completions = {rid: data for rid, items in outputs.items() for kind, data in items if kind == COMPLETION}
    for i in range(len(TICKETS)):
        completion = completions[f"t{i}"]
        assert completion["output_error"] is None, completion
        validate(completion["output_json"], TICKET_SCHEMA)
        assert json.loads(completion["text"]) == completion["output_json"]
    assert completions["cut"]["output_json"] is None and completions["cut"]["finish_reason"] == "length"
    assert "cut at max_tokens" in completions["cut"]["output_error"]
    assert isinstance(completions["object"]["output_json"], dict) and completions["object"]["output_error"] is None
    assert completions["plain"]["output_json"] is None and completions["plain"]["output_error"] is None


def test_every_field_the_table_sends_reaches_vllm_and_a_repetition_penalty_changes_a_greedy_answer(vllm_server):
    """Greedy answers to a prompt that invites repetition, with and without vLLM's repetition_penalty (a field
    added to the table alone): the penalised one differs, so vLLM got it; both lineages record what was applied."""
    engine = engine_for(vllm_server.base_url)
    prompt = "Write the word apple twenty times, separated by spaces."
    try:
        outputs = run_to_end(engine, [
            InferenceRequest(id="free", prompt=prompt, max_tokens=24, min_tokens=24, temperature=0,
                             received_at=time.time()),
            InferenceRequest(id="penalised", prompt=prompt, max_tokens=24, min_tokens=24, temperature=0,
                             repetition_penalty=1.8, received_at=time.time()),
            InferenceRequest(id="both", prompt=prompt, max_tokens=24, min_tokens=24, temperature=0,
                             presence_penalty=0.5, frequency_penalty=0.5, received_at=time.time())])
    finally:
        engine.close()
    done = {rid: data for rid, items in outputs.items() for kind, data in items if kind == COMPLETION}
    # vLLM takes fields it does not know without a word (its protocol allows extra fields): only a changed answer
    # shows the field was applied.
    assert done["free"]["text"] != done["penalised"]["text"], done["free"]["text"]
    assert done["penalised"]["lineage"]["sampling"] == {
        "max_tokens": 24, "min_tokens": 24, "temperature": 0, "repetition_penalty": 1.8}
    assert done["both"]["lineage"]["sampling"] == {
        "max_tokens": 24, "min_tokens": 24, "temperature": 0, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    assert "repetition_penalty" not in done["free"]["lineage"]["sampling"]


def test_chunks_cut_by_the_chunk_clock_and_by_the_stream_share_one_gapless_sequence(vllm_server):
    """The chunk clock cuts waiting text on its thread while the stream cuts its own on the engine's loop, and
    polls come as fast as they can."""
    import sys

    engine = engine_for(vllm_server.base_url, chunk_policy=ChunkPolicy(chunk_tokens=3, interval_ms=1))
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so that unguarded steps interleave
    try:
        requests = [InferenceRequest(id=f"race-{i}", prompt="Count from 1 to 200 in digits.", max_tokens=160,
                                     temperature=0, received_at=time.time()) for i in range(3)]
        outputs = drive_to_end(engine, requests, poll_s=0).outputs  # poll as fast as possible
        chunks = {rid: [record for kind, record in items if kind == CHUNK] for rid, items in outputs.items()}
    finally:
        sys.setswitchinterval(switch_interval)
        engine.close()
    for request_id, mine in chunks.items():
        assert [c["seq"] for c in mine] == list(range(len(mine))), request_id
        assert mine[-1]["final"] and not any(c["final"] for c in mine[:-1]), request_id


def test_with_a_chunk_topic_the_engine_publishes_every_chunk_before_it_hands_back_the_completion(vllm_server, emulator):
    from tests.test_chunk_publisher import _Received

    name = f"engine-chunks-{int(time.time() * 1000) % 10**9}"
    topic = emulator.create_topic(name, subscription=f"{name}-sub", ordering=True)
    received = _Received(emulator.subscription(f"{name}-sub"))
    engine = engine_for(vllm_server.base_url, chunk_topic=topic, chunks_to_pipeline=False)
    try:
        requests = [InferenceRequest(id=f"direct-{i}", prompt=p, max_tokens=n, temperature=0, received_at=time.time())
                    for i, (p, n) in enumerate([("What is the capital of France?", 20),
                                                ("Write a poem about autumn leaves.", 48)])]
        outputs = run_to_end(engine, requests)
        for request in requests:
            assert not [kind for kind, _ in outputs[request.id] if kind == CHUNK]  # none through the pipeline
            (completion,) = [data for kind, data in outputs[request.id] if kind == COMPLETION]
            assert wait_until(lambda: any(c["final"] for c in received.of(request.id)), 30)
            chunks = [c for c in received.of(request.id) if c["stream"] == completion["stream"]]
            assert [c["seq"] for c in chunks] == list(range(len(chunks)))
            assert "".join(c["text"] for c in chunks) == completion["text"]
            assert chunks[-1]["tokens"] == completion["usage"]["completion_tokens"] > 0
        stats = engine.stats()
        assert stats["chunks_unconfirmed"] == 0  # each completion waited for its chunks' confirmation
        assert stats["chunks_published"] == sum(len(received.of(r.id)) for r in requests)
    finally:
        engine.close()
        received.stop()


def test_settings_refuse_chunks_that_go_nowhere():
    with pytest.raises(ValueError, match="chunks must go somewhere"):
        EngineSettings(server=None, server_url="http://localhost:1", chunks_to_pipeline=False)
