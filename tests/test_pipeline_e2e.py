"""The whole template end to end: Pub/Sub emulator → pipeline (DirectRunner) → engine → Pub/Sub.

One pipeline run per engine and batching serves every test in this module; it
is started as a user starts it (``python -m template.main``): with
``engine=vllm`` the model manager starts the real local vLLM server, with
``engine=transformers`` each batch is generated together in-process. Both
engines keep one contract: the same records for the same messages.

The vLLM run then takes what a production stream does to a job (the last tests, in file order, after the
others have read the first traffic's records): hostile messages, redeliveries and reused ids mixed into valid
traffic, and a ``kill -9`` of its model server mid-stream. Every input ends with exactly one outcome, each
completion's chunk stream is whole, and the pipeline still serves after.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import psutil
import pytest

from local import core_placement
from local.cpu_server import LOCAL_SERVER
from local.emulators import emulator_bigquery_client
from local.harness import REPO_ROOT, LocalRun, OutputCollector, server_pids_in_log
from tests.conftest import wait_until
from tests.hostile_inputs import carries_too_long_id, hostile_corpus

pytestmark = pytest.mark.engine

LONG_TOPICS = ["the history of Rome", "how airplanes fly", "the life of bees", "volcanoes", "the ocean",
               "medieval castles", "the moon landing", "rainforests"]
SHORT_QUESTIONS = ["What is 2 + 2?", "Name a color.", "What is the capital of Italy?", "Say hello.",
                   "What day comes after Monday?", "Name a fruit.", "What is water made of?", "Say yes."]

VALID = (
    [{"id": f"long-{i}", "prompt": f"Write a detailed essay about {topic}.", "max_tokens": 64}
     for i, topic in enumerate(LONG_TOPICS)]
    + [{"id": f"short-{i}", "prompt": question, "max_tokens": 24} for i, question in enumerate(SHORT_QUESTIONS)]
    + [
        {"id": "chat-1", "messages": [{"role": "system", "content": "Answer in one word."},
                                      {"role": "user", "content": "What color is the sky?"}], "max_tokens": 10},
        {"id": "limit-5", "prompt": "Write a long story about a brave knight and a dragon.", "max_tokens": 5},
        {"id": "stop-paris", "prompt": "What is the capital of France?", "temperature": 0, "stop": ["Paris"],
         "max_tokens": 30},
        {"id": "greedy-a", "prompt": "Describe a sunset over the sea.", "temperature": 0, "max_tokens": 40},
        {"id": "greedy-b", "prompt": "Describe a sunset over the sea.", "temperature": 0, "max_tokens": 40},
        {"id": "top-p", "prompt": "Name an animal.", "top_p": 0.5, "max_tokens": 10, "metadata": {"team": "qa"}},
    ]
)
PLAIN_TEXT = ("plain-1", "Tell me a fun fact about cats.")
MALFORMED = {
    "bad-json": (b'{"prompt": "unterminated', "not valid JSON"),
    "no-prompt": (b'{"id": "no-prompt", "max_tokens": 10}', "exactly one of 'prompt'"),
    "neg-max": (b'{"id": "neg-max", "prompt": "hi", "max_tokens": -3}', "'max_tokens' must be a positive integer"),
    "wrong-type": (b'{"id": "wrong-type", "prompt": ["not", "text"]}', "'prompt' must be a non-empty string"),
    "bad-temp": (b'{"id": "bad-temp", "prompt": "hi", "temperature": "warm"}', "'temperature' must be a number"),
    "not-utf8": (b"\xff\xfe\xfd", "not UTF-8"),
    # A job without lora_adapters (engine=transformers never has any) refuses a request that names one.
    "no-adapters": (b'{"id": "no-adapters", "prompt": "hi", "adapter": "support"}',
                    "adapter 'support' is not served by this job: it serves none"),
    "too-long": (('{"id": "too-long", "prompt": "' + "lorem ipsum " * 1500 + '"}').encode(),
                 "exceed the model's context of 2048 tokens"),
}
# The long request streams for half a minute alone on a 2-core CPU (min_tokens: no end before it), and a short one
# sent while it streams must finish first.
HOL_LONG = {"id": "hol-long", "prompt": "Count from 1 to 1000, writing every number in digits, separated by commas.",
            "temperature": 0, "max_tokens": 240, "min_tokens": 240}
HOL_SHORT = {"id": "hol-short", "prompt": "Say hi.", "max_tokens": 8}
# The bulk lane (docs/operations.md#the-bulk-lane): a backlog larger than the worker takes from that lane (its
# max_in_flight + worker_queue less live_reserve), then a few live requests while it drains. Its answers are short:
# what it proves is counted in requests, not tokens.
BULK_TOKENS = 8
BULK = [{"id": f"bulk-{i}", "prompt": f"Write about {LONG_TOPICS[i % len(LONG_TOPICS)]}, part {i}.",
         "max_tokens": BULK_TOKENS, "min_tokens": BULK_TOKENS} for i in range(80)]
LIVE_BESIDE_BULK = [{"id": f"live-{i}", "prompt": question, "max_tokens": 8}
                    for i, question in enumerate(SHORT_QUESTIONS[:4])]


ENGINE_ARGS = {"vllm": LOCAL_SERVER.template_args(),
               "transformers": ["--engine=transformers", "--dtype=float32"]}
# How the batching step keys and fills batches. With the transformers engine a batch is the one local worker's unit
# of work: one key per bucket (num_shards's guidance), and batches of up to eight, so that fewer, fuller batches
# run one after another.
BATCHING = {"vllm": ["--num_shards=4"], "transformers": ["--num_shards=1", "--batch_size_target=8"]}


# Both engines on length buckets: each has a path of its own there (vLLM's priority scheduling; the
# transformers engine's answer buckets). Arrival order runs in every other end-to-end test with vLLM, and with
# the transformers engine in tests/test_bench.py's harness run.
@pytest.fixture(scope="module", params=[("vllm", "length-buckets"), ("transformers", "length-buckets")],
                ids="-".join)
def run(request, checkpoint, emulator, bigquery):
    engine, batching = request.param
    bucketing = ["--length_bucketing=true", "--bucket_boundaries=16,64,256"] if batching == "length-buckets" else []
    suffix = f"{engine}_{batching}".replace("-", "_")
    tables = [f"--output_completions_table=local-project:llm.completions_{suffix}",
              f"--output_chunks_table=local-project:llm.chunks_{suffix}",
              f"--dead_letter_table=local-project:llm.dead_letters_{suffix}"]
    local_run = LocalRun([f"--model={checkpoint}", "--served_model_name=smollm2", *ENGINE_ARGS[engine],
                          *BATCHING[engine], "--max_in_flight=48", "--chunk_tokens=4", "--chunk_interval_ms=100",
                          "--default_max_tokens=64",
                          *(["--worker_queue=16"] if engine == "vllm" else []), *bucketing, *tables],
                         log_path=REPO_ROOT / ".cache" / "test-e2e" / f"{suffix}.log", emulator=emulator,
                         bulk_lane=engine == "vllm")
    local_run.start()
    collector = local_run.collector()
    head_of_line = [HOL_LONG, HOL_SHORT] if engine == "vllm" else []
    try:
        if head_of_line:  # first: the short request goes in while the long one streams
            local_run.publish([HOL_LONG])
            assert wait_until(lambda: any(c.data["id"] == "hol-long" for c in collector.chunks), 600), \
                "no chunk from the model within 10 minutes:\n" + local_run.log_tail()
            local_run.publish([HOL_SHORT])
            # The other load comes once the short one has ended, so its arrival times measure the pipeline, not the
            # single-threaded DirectRunner's backlog of two dozen other streams; the long one streams on beside it.
            assert not collector.wait_for([HOL_SHORT["id"]], 300), local_run.log_tail()
        local_run.publish(VALID)
        local_run.publish([PLAIN_TEXT[1]], attributes={"id": PLAIN_TEXT[0]})
        for key, (payload, _) in MALFORMED.items():
            local_run.publish([payload], attributes={"id": key})
        expected = {*(r["id"] for r in head_of_line), PLAIN_TEXT[0], *(r["id"] for r in VALID), *MALFORMED}
        missing = collector.wait_for(expected, 600)
        assert not missing, f"no outcome for {missing}:\n{local_run.log_tail()}"
        if local_run.bulk_lane:  # live requests published once the bulk lane fills the worker
            local_run.publish(BULK, kind="bulk")
            assert wait_until(lambda: any(c.data["id"].startswith("bulk-") for c in collector.completions), 300), \
                local_run.log_tail()
            local_run.publish(LIVE_BESIDE_BULK)
            expected |= {r["id"] for r in BULK + LIVE_BESIDE_BULK}
            missing = collector.wait_for(expected, 600)
            assert not missing, f"no outcome for {missing}:\n{local_run.log_tail()}"
        unfinished = collector.wait_for_streams({c.data["stream"] for c in collector.completions}, 60)
        assert not unfinished, f"streams without all their chunks: {unfinished}\n{local_run.log_tail()}"
        yield local_run, collector, expected, suffix, engine
    finally:
        collector.stop()
        local_run.stop()


def completions_by_id(collector):
    return {c.data["id"]: c.data for c in collector.completions}


def chunk_streams(collector) -> dict[str, list[dict]]:
    """Each stream's chunks in order. At-least-once: a redelivered chunk is the same chunk again."""
    streams: dict[str, dict[int, dict]] = defaultdict(dict)
    for chunk in collector.chunks:
        seqs = streams[chunk.data["stream"]]
        if chunk.data["seq"] in seqs:
            assert seqs[chunk.data["seq"]]["text"] == chunk.data["text"], "one seq, two texts"
        seqs[chunk.data["seq"]] = chunk.data
    return {key: [seqs[s] for s in sorted(seqs)] for key, seqs in streams.items()}


def assert_whole_stream(request_id: str, completion: dict, chunks: list[dict]) -> None:
    """The completion's stream: gapless, one final chunk at its end, its texts adding up to the completion's."""
    assert chunks and [c["seq"] for c in chunks] == list(range(len(chunks))), request_id
    assert chunks[-1]["final"] and not any(c["final"] for c in chunks[:-1]), request_id
    assert "".join(c["text"] for c in chunks) == completion["text"], request_id


def test_every_message_ends_as_exactly_one_completion_or_dead_letter(run):
    _, collector, expected, _, _ = run
    completion_ids = [c.data["id"] for c in collector.completions]
    letter_ids = [d.data["id"] for d in collector.dead_letters]
    assert len(completion_ids) >= 20, "the scenario must serve at least 20 valid prompts"
    assert sorted(completion_ids + letter_ids) == sorted(expected)
    assert set(letter_ids) == set(MALFORMED)


def test_chunks_are_gapless_and_add_up_to_the_final_text(run):
    _, collector, _, _, _ = run
    streams = chunk_streams(collector)
    for request_id, completion in completions_by_id(collector).items():
        mine = streams.get(completion["stream"], [])
        assert_whole_stream(request_id, completion, mine)
        usage = completion["usage"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] == mine[-1]["tokens"], request_id
        assert completion["total_ms"] >= (completion["time_to_first_token_ms"] or 0) >= 0


def test_malformed_messages_are_dead_letters_with_their_reason(run):
    _, collector, _, _, _ = run
    letters = {d.data["id"]: d.data for d in collector.dead_letters}
    for key, (_, reason) in MALFORMED.items():
        assert reason in letters[key]["reason"], (key, letters[key]["reason"])
        assert letters[key]["stage"] in ("parse", "validate"), key
    assert letters["not-utf8"]["payload_encoding"] == "base64"


def test_per_request_parameters_are_honoured(run):
    _, collector, _, _, _ = run
    completions = completions_by_id(collector)
    limited = completions["limit-5"]
    assert limited["usage"]["completion_tokens"] == 5 and limited["finish_reason"] == "length"
    stopped = completions["stop-paris"]
    assert stopped["finish_reason"] == "stop" and "Paris" not in stopped["text"]
    assert "capital" in stopped["text"].lower()  # the answer up to the stop sequence
    assert completions["greedy-a"]["text"] == completions["greedy-b"]["text"] != ""
    assert completions["top-p"]["metadata"] == {"team": "qa"}
    assert completions["chat-1"]["messages"][0]["role"] == "system"
    assert completions[PLAIN_TEXT[0]]["prompt"] == PLAIN_TEXT[1]


def test_a_short_request_is_not_blocked_by_a_long_one(run):
    _, collector, _, _, engine = run
    if engine != "vllm":
        pytest.skip("static batching runs one batch at a time: a batch waits for the one before it (README)")
    long_chunks = [c for c in collector.chunks if c.data["id"] == "hol-long"]
    short_chunks = [c for c in collector.chunks if c.data["id"] == "hol-short"]
    long_end = max(c.at for c in long_chunks if c.data["final"])
    assert min(c.at for c in short_chunks) < long_end
    assert max(c.at for c in short_chunks if c.data["final"]) < long_end


def table_rows(table: str) -> list[dict]:
    query = f"SELECT * FROM `local-project.llm.{table}`"
    return [dict(row) for row in emulator_bigquery_client("local-project").query(query).result()]


def test_both_lanes_end_every_request_once_and_record_their_lane(run):
    """A bulk backlog larger than the lane may hold, and live requests published while it drains: each request of
    both lanes ends with one completion that records its lane. (Whether live is served first locally is what make
    bench-lanes measures: benchmarks.md#lanes.)"""
    _, collector, _, _, engine = run
    if engine != "vllm":
        pytest.skip("the lane is exercised with vLLM, whose priority scheduling it uses")
    completions = completions_by_id(collector)
    bulk, live = [r["id"] for r in BULK], [r["id"] for r in LIVE_BESIDE_BULK]
    assert sorted(c.data["id"] for c in collector.completions if c.data["id"] in set(bulk + live)) == \
        sorted(bulk + live), "one completion each"
    assert {completions[i]["lane"] for i in bulk} == {"bulk"}
    assert {completions[i]["lane"] for i in live + [r["id"] for r in VALID]} == {"live"}
    assert all(completions[i]["usage"]["completion_tokens"] == BULK_TOKENS for i in bulk)


def test_bigquery_holds_the_same_completions_chunks_and_dead_letters(run):
    _, collector, _, suffix, _ = run
    published = completions_by_id(collector)
    assert wait_until(lambda: len(table_rows(f"completions_{suffix}")) >= len(published), 60)
    rows = table_rows(f"completions_{suffix}")
    assert sorted(r["request_id"] for r in rows) == sorted(published), "one row per request"
    for row in rows:
        record = published[row["request_id"]]
        assert (row["completion_text"], row["finish_reason"], row["attempt"], row["model"]) == \
            (record["text"], record["finish_reason"], record["attempt"], record["model"])
        assert (row["prompt_tokens"], row["completion_tokens"]) == \
            (record["usage"]["prompt_tokens"], record["usage"]["completion_tokens"])
        assert row["metadata"] == record["metadata"]
        assert row["lane"] == record["lane"]
    chunk_keys = {(c.data["id"], c.data["stream"], c.data["seq"]) for c in collector.chunks}
    assert wait_until(lambda: len(table_rows(f"chunks_{suffix}")) >= len(chunk_keys), 60)
    assert {(r["request_id"], r["stream"], r["seq"]) for r in table_rows(f"chunks_{suffix}")} == chunk_keys
    letters = table_rows(f"dead_letters_{suffix}")
    assert {r["request_id"] for r in letters} == set(MALFORMED)
    assert all(r["reason"] and r["stage"] in ("parse", "validate") and r["lane"] == "live" for r in letters)


# What a production stream does to the job (the vLLM run, after the tests above) --------------------------

COUNTING = [{"id": f"count-{i}", "prompt": f"Count from 1 to 500 in digits, separated by commas. Start at {i}.",
             "temperature": 0, "max_tokens": 160} for i in range(4)]
QUICK = [{"id": f"quick-{i}", "prompt": q, "max_tokens": 16} for i, q in enumerate(
    ["What is 2 + 2?", "Name a color.", "Say hello.", "Name a fruit.", "What is ice?", "Say yes."])]
# Plain text that starts like JSON, served as text; and a JSON-looking payload marked as text.
TEXT_LIKE_JSON = {"inst-text": "[INST] Name a planet. [/INST]", "brace-text": "{name} is a placeholder. Say ok."}
MARKED_TEXT = ("marked-text", '{"prompt": "this is all prompt text"} Say ok.')
REUSED = [{"id": "quick-0", "prompt": "A different question that reuses an id: name a tree.", "max_tokens": 8},
          {"id": "count-1", "prompt": "Another request reusing a counting id.", "max_tokens": 8}]
AFTER = [{"id": f"after-{i}", "prompt": "Name an animal.", "max_tokens": 8} for i in range(3)]
HOSTILE = hostile_corpus(seed=2026, size=60)
# A payload id too long for an ordering key overrides the attribute id: its dead letter has no id.
NAMELESS = {f"hostile-{i}" for i, (payload, _) in enumerate(HOSTILE) if carries_too_long_id(payload)}
HOSTILE_IDS = [f"hostile-{i}" for i in range(len(HOSTILE))]
# Every id the hostile traffic uses (the nameless ones' dead letters carry none).
HOSTILE_TRAFFIC = ({r["id"] for r in COUNTING + QUICK + AFTER} | set(TEXT_LIKE_JSON) | {MARKED_TEXT[0]}
                   | set(HOSTILE_IDS))


@dataclass(frozen=True)
class HostileRun:
    """The vLLM run after the hostile traffic: its vLLM was killed mid-stream (that server's pid and the cores its
    engine was bound to) and restarted by the model manager."""

    run: LocalRun
    collector: OutputCollector
    killed_pid: int
    killed_cores: frozenset[int]


@pytest.fixture(scope="module")
def hostile_run(run):
    local_run, collector, _, _, engine = run
    if engine != "vllm":
        pytest.skip("the model server the job owns is killed: the vLLM run's")
    local_run.publish(COUNTING + QUICK)
    local_run.publish(COUNTING[:2] + QUICK[:2])  # redeliveries / publisher retries of the same requests
    local_run.publish(REUSED)
    for request_id, text in TEXT_LIKE_JSON.items():
        local_run.publish([text], attributes={"id": request_id})
    local_run.publish([MARKED_TEXT[1]], attributes={"id": MARKED_TEXT[0], "content_type": "text/plain"})
    for index, (payload, _) in enumerate(HOSTILE):
        local_run.publish([payload], attributes={"id": f"hostile-{index}"})
    # kill -9 the model server while the counting requests stream.
    assert wait_until(lambda: any(c.data["id"].startswith("count-") and c.data["seq"] >= 2
                                  for c in collector.chunks), 300), local_run.log_tail()
    server_pid = server_pids_in_log(local_run.log_path.read_text())[-1]
    model_cores = core_placement.bound_cores(server_pid)
    os.kill(server_pid, signal.SIGKILL)
    time.sleep(2)
    local_run.publish(COUNTING[2:3])  # a redelivery while the server is down
    after = {r["id"] for r in AFTER}
    wanted = HOSTILE_TRAFFIC - NAMELESS - after
    missing = collector.wait_for(wanted, 900)
    assert not missing, f"no outcome for {missing}:\n{local_run.log_tail()}"
    local_run.publish(AFTER)  # still serving after all of it
    missing = collector.wait_for(wanted | after, 300)
    assert not missing, f"no outcome for {missing}:\n{local_run.log_tail()}"
    unfinished = collector.wait_for_streams({c.data["stream"] for c in collector.completions}, 60)
    assert not unfinished, f"streams without all their chunks: {unfinished}\n{local_run.log_tail()}"
    return HostileRun(local_run, collector, server_pid, model_cores)


def test_every_hostile_input_ends_with_exactly_one_outcome(hostile_run):
    collector = hostile_run.collector
    completions = Counter(c.data["id"] for c in collector.completions if c.data["id"] in HOSTILE_TRAFFIC)
    letters = Counter(d.data.get("id") for d in collector.dead_letters
                      if d.data.get("id") in HOSTILE_TRAFFIC or d.data.get("id") is None)
    assert all(n == 1 for n in completions.values()), completions
    expected = HOSTILE_TRAFFIC - NAMELESS
    assert expected <= set(completions) | set(letters)
    # Each hostile message once; the two reused ids once more each, as dead letters; nothing else.
    assert all(completions[i] + letters[i] == 1 for i in HOSTILE_IDS if i not in NAMELESS)
    assert letters[None] == len(NAMELESS) and all(letters[i] == 0 for i in NAMELESS)
    assert sum(completions.values()) + sum(letters.values()) == len(expected) + len(NAMELESS) + len(REUSED)


def test_duplicates_are_served_once_and_a_reused_id_is_refused_by_name(hostile_run):
    collector = hostile_run.collector
    completions = completions_by_id(collector)
    for request in COUNTING + QUICK:
        assert request["id"] in completions, request["id"]
        assert completions[request["id"]]["prompt"] == request["prompt"], "never another request's answer"
    reuse_letters = [d.data for d in collector.dead_letters if d.data.get("id") in {r["id"] for r in REUSED}]
    assert sorted(d["id"] for d in reuse_letters) == sorted(r["id"] for r in REUSED)
    assert all("another request with this id" in d["reason"] for d in reuse_letters)
    assert {json.loads(d["payload"])["prompt"] for d in reuse_letters} == {r["prompt"] for r in REUSED}


def test_text_that_looks_like_json_is_served_as_text(hostile_run):
    collector = hostile_run.collector
    completions = completions_by_id(collector)
    for request_id, text in [*TEXT_LIKE_JSON.items(), MARKED_TEXT]:
        assert completions[request_id]["prompt"] == text


def test_after_a_kill_9_every_completion_has_a_whole_chunk_stream(hostile_run):
    collector, server_pid = hostile_run.collector, hostile_run.killed_pid
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
    assert "Restarting vLLM server" in hostile_run.run.log_path.read_text()
    streams = chunk_streams(collector)
    completions = completions_by_id(collector)
    assert any(c["attempt"] > 1 for c in completions.values()), "the kill should have cut a stream mid-way"
    for request_id, completion in completions.items():
        assert_whole_stream(request_id, completion, streams.get(completion["stream"], []))


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


def test_the_model_server_is_gone_when_the_pipeline_stops(run):
    local_run, _, _, _, engine = run
    pids = server_pids_in_log(local_run.log_path.read_text())
    if engine != "vllm":
        assert not pids, "the transformers engine starts no server"
        assert local_run.stop() == 0
        return
    assert pids, "the pipeline did not log the server it started"
    assert all(psutil.pid_exists(pid) for pid in pids[-1:]), "server should run while the pipeline runs"
    children = [child.pid for child in psutil.Process(pids[-1]).children(recursive=True)]
    assert local_run.stop() == 0
    assert wait_until(lambda: not any(psutil.pid_exists(pid) for pid in pids + children), 15)
