"""The whole template end to end: Pub/Sub emulator → pipeline (DirectRunner) → engine → Pub/Sub.

One pipeline run per engine and batching serves every test in this module; it
is started as a user starts it (``python -m template.main``): with
``engine=vllm`` the model manager starts the real local vLLM server, with
``engine=transformers`` each batch is generated together in-process. Both
engines keep one contract: the same records for the same messages.
"""

from __future__ import annotations

from collections import defaultdict

import psutil
import pytest

from local.cpu_server import LOCAL_SERVER
from local.emulators import emulator_bigquery_client
from local.harness import REPO_ROOT, LocalRun, server_pids_in_log
from tests.conftest import wait_until

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


def test_every_message_ends_as_exactly_one_completion_or_dead_letter(run):
    _, collector, expected, _, _ = run
    completion_ids = [c.data["id"] for c in collector.completions]
    letter_ids = [d.data["id"] for d in collector.dead_letters]
    assert len(completion_ids) >= 20, "the scenario must serve at least 20 valid prompts"
    assert sorted(completion_ids + letter_ids) == sorted(expected)
    assert set(letter_ids) == set(MALFORMED)


def test_chunks_are_gapless_and_add_up_to_the_final_text(run):
    _, collector, _, _, _ = run
    chunks = defaultdict(dict)
    for chunk in collector.chunks:  # at-least-once: a redelivered chunk is the same chunk again
        key = chunk.data["stream"]
        if chunk.data["seq"] in chunks[key]:
            assert chunks[key][chunk.data["seq"]]["text"] == chunk.data["text"], "one seq, two texts"
        chunks[key][chunk.data["seq"]] = chunk.data
    for request_id, completion in completions_by_id(collector).items():
        mine = sorted(chunks[completion["stream"]].values(), key=lambda c: c["seq"])
        assert [c["seq"] for c in mine] == list(range(len(mine))), request_id
        assert mine[-1]["final"] and not any(c["final"] for c in mine[:-1]), request_id
        assert "".join(c["text"] for c in mine) == completion["text"], request_id
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
