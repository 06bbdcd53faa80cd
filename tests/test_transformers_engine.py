"""The static-batching engine (engine=transformers) with the real local model, in-process."""

from __future__ import annotations

import dataclasses
import time

import pytest

from local.engine_driver import drive_to_end
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.keying import bucket_index
from pipeline.contract.messages import InferenceRequest
from pipeline.contract.stream_progress import CHUNK, COMPLETION, DEAD_LETTER
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.transformers_engine import REFUSED, transformers_engine
from pipeline.flow.batching import BatchingConfig
from pipeline.intake.prompt_length import TokenizerMeter
from pipeline.serving.vllm_server import ServerSpec
from tests.conftest import wait_until

pytestmark = pytest.mark.engine


def static_settings(checkpoint, **fields) -> EngineSettings:
    return EngineSettings(server=ServerSpec(model=str(checkpoint), dtype="float32", served_model_name="smollm2"),
                          engine="transformers", chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100),
                          max_in_flight=8, **fields)


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = transformers_engine(static_settings(checkpoint))
    yield engine
    engine.close()


def request(request_id: str, prompt: str, **params) -> InferenceRequest:
    return InferenceRequest(id=request_id, prompt=prompt, received_at=time.time(), **params)


def run_batch(engine: Engine, requests: list[InferenceRequest], timeout_s: float = 300):
    """Submits the requests as one batch and drives them to their outcomes: id -> [(kind, record), ...]."""
    return drive_to_end(engine, requests, batches=[len(requests)], timeout_s=timeout_s, poll_s=0.02).outputs


def test_each_request_keeps_its_own_parameters_within_one_batch(engine, checkpoint):
    requests = [
        request("limit-5", "Write a long story about a brave knight and a dragon.", max_tokens=5),
        request("stop-paris", "What is the capital of France?", temperature=0, stop=("Paris",), max_tokens=30),
        request("greedy-a", "Describe a sunset over the sea.", temperature=0, max_tokens=24),
        request("greedy-b", "Describe a sunset over the sea.", temperature=0, max_tokens=24),
        request("nucleus", "Describe a sunset over the sea.", top_p=1e-9, max_tokens=24),  # the top token alone
        request("top-p", "Name an animal.", top_p=0.5, max_tokens=10, metadata={"team": "qa"},
                presence_penalty=1.0, repetition_penalty=1.5),  # vLLM's alone: served without them
    ]
    outputs = run_batch(engine, requests)
    done = {rid: next(data for kind, data in items if kind == COMPLETION) for rid, items in outputs.items()}
    assert done["limit-5"]["usage"]["completion_tokens"] == 5 and done["limit-5"]["finish_reason"] == "length"
    assert done["stop-paris"]["finish_reason"] == "stop" and "Paris" not in done["stop-paris"]["text"]
    assert "capital" in done["stop-paris"]["text"].lower()
    assert done["greedy-a"]["text"] == done["greedy-b"]["text"] == done["nucleus"]["text"] != ""
    assert done["greedy-a"]["usage"]["completion_tokens"] <= 24
    assert done["top-p"]["metadata"] == {"team": "qa"} and done["top-p"]["usage"]["completion_tokens"] <= 10
    for rid, items in outputs.items():
        chunks = [data for kind, data in items if kind == CHUNK]
        assert [c["seq"] for c in chunks] == list(range(len(chunks))), rid
        assert chunks[-1]["final"] and not any(c["final"] for c in chunks[:-1]), rid
        assert "".join(c["text"] for c in chunks) == done[rid]["text"], rid
        assert done[rid]["usage"]["prompt_tokens"] > 0
    import transformers
    lineage = done["top-p"]["lineage"]
    assert (lineage["engine"], lineage["settings"]["dtype"]) == (f"transformers {transformers.__version__}", "float32")
    assert lineage["sampling"] == {"max_tokens": 10, "top_p": 0.5}, "no seed, no penalties: it applies none"
    assert lineage["model"]["source"] == str(checkpoint) and lineage["model"]["config"].startswith("sha256:")


def test_min_tokens_equal_to_max_tokens_makes_an_answer_that_would_stop_early_run_its_full_length(engine):
    prompt = "What is the capital of France?"
    outputs = run_batch(engine, [request("natural", prompt, temperature=0, max_tokens=24),
                                 request("fixed", prompt, temperature=0, max_tokens=24, min_tokens=24),
                                 request("no-early-stop", prompt, temperature=0, max_tokens=24, min_tokens=12,
                                         stop=("o",))])
    done = {rid: next(data for kind, data in items if kind == COMPLETION) for rid, items in outputs.items()}
    assert done["natural"]["finish_reason"] == "stop" and done["natural"]["usage"]["completion_tokens"] < 24
    assert (done["fixed"]["finish_reason"], done["fixed"]["usage"]["completion_tokens"]) == ("length", 24)
    assert done["fixed"]["text"].startswith(done["natural"]["text"])  # greedy: the same answer, then more
    # A stop string counts only after min_tokens, as in vLLM: the "o" of "of" does not end the answer; the
    # first "o" after its 12 tokens does.
    cut = done["no-early-stop"]
    assert cut["finish_reason"] == "stop" and 12 <= cut["usage"]["completion_tokens"] < 24
    assert done["fixed"]["text"].startswith(cut["text"]) and len(cut["text"]) > len(done["natural"]["text"])


def test_a_batch_shares_its_time_among_its_rows_until_each_ends(engine):
    """Rows share the batch's time while they run; a row that ended stops paying, and the shares of a batch add up
    to the time the model computed it (the engine's own busy clock)."""
    requests = [request(f"n{n}", "Count from one to fifty in words.", temperature=0, max_tokens=n, min_tokens=n)
                for n in (4, 12, 24)]
    before = engine.stats()["busy_ms"]
    outputs = run_batch(engine, requests)
    busy = (engine.stats()["busy_ms"] - before) / 1000
    shares = {rid: next(data for kind, data in items if kind == COMPLETION)["accelerator_seconds"]
              for rid, items in outputs.items()}
    assert sum(shares.values()) == pytest.approx(busy, rel=0.01)
    assert 0 < shares["n4"] < shares["n12"] < shares["n24"]  # the longer answer ran longer, most of it alone
    assert shares["n24"] > busy / 3


@pytest.fixture
def engine_of_its_own(checkpoint):
    """An engine whose bulk share no live latency has halved (the lane's governor off): the module's, after
    the other tests' live requests on a loaded machine, may take fewer bulk streams than this test queues."""
    engine = transformers_engine(static_settings(checkpoint, live_first_token_slo_ms=0, live_inter_token_slo_ms=0))
    yield engine
    engine.close()


def test_a_live_batch_queued_behind_bulk_ones_is_generated_before_them(engine_of_its_own):
    """A bulk batch runs; another bulk batch, then a live one, wait for it. The live batch goes next: its answer's
    first chunk comes before the waiting bulk batch's (in arrival order it would come after)."""
    engine = engine_of_its_own
    count = "Count from 1 to 100, separated by commas."
    # Long enough to be still running when the others are queued, on a loaded machine too (asserted below).
    running = [request(f"bulk-running-{n}", count, temperature=0, max_tokens=160, min_tokens=160, lane="bulk")
               for n in range(2)]
    keys = engine.submit_batch([r.to_json() for r in running], [1] * len(running))
    assert None not in keys
    assert wait_until(lambda: any(engine.poll(dict.fromkeys(keys, 0)).values()), 120), "the bulk batch runs"
    waiting = [request(f"bulk-waiting-{n}", count, temperature=0, max_tokens=8, lane="bulk") for n in range(2)]
    live = request("live", "Say hi.", temperature=0, max_tokens=4)
    so_far = engine.poll(dict.fromkeys(keys, 0))
    assert not any(kind == COMPLETION for items in so_far.values() for kind, _ in items), "it still runs"
    running_outputs: dict[str, list] = {}

    def keep_running_polled() -> None:  # its streams' leases run on while the drive polls only its own
        running_outputs.update(engine.poll(dict.fromkeys(keys, 0)))

    drive = drive_to_end(engine, [*waiting, live], batches=[2, 1], poll_s=0.02, timeout_s=300,
                         each_poll=keep_running_polled)
    assert drive.first_at["live"] < min(drive.first_at[r.id] for r in waiting), drive.first_at
    assert {c["lane"] for c in drive.completions()} == {"bulk", "live"}
    assert all(any(kind == COMPLETION for kind, _ in running_outputs[key]) for key in keys), "the first batch ended"
    engine.poll({key: len(items) for key, items in running_outputs.items()})  # released


def test_text_streams_per_decoding_step_not_when_the_batch_ends(engine):
    outputs = run_batch(engine, [request("short", "Say hi.", temperature=0, max_tokens=4),
                                 request("long", "Count from 1 to 100, separated by commas.", temperature=0,
                                         max_tokens=48)])
    short_final = next(c for kind, c in outputs["short"] if kind == CHUNK and c["final"])
    long_chunks = [c for kind, c in outputs["long"] if kind == CHUNK]
    assert len(long_chunks) >= 4, "a 48-token answer with chunk_tokens=4 comes in several chunks"
    assert long_chunks[0]["emitted_at"] < long_chunks[-1]["emitted_at"]
    # The short row's text was out while the batch still ran for the long one (its row padded meanwhile).
    assert short_final["emitted_at"] < long_chunks[-1]["emitted_at"]


def test_a_long_prompt_pads_a_batch_of_short_ones_and_length_buckets_stop_it(engine, checkpoint):
    """The batcher's two batchings of the same requests: arrival order (one batch) and length buckets."""
    short = [request(f"short-{i}", f"Name a color, number {i}.", temperature=0, max_tokens=6) for i in range(3)]
    long = request("long", "Summarise this report. " + "The quarterly numbers rose in every region. " * 40,
                   temperature=0, max_tokens=6)
    meter = TokenizerMeter(str(checkpoint), "chat")  # what MeasurePromptLength gives the batcher
    measured = [dataclasses.replace(r, prompt_tokens=meter(r)) for r in short + [long]]
    boundaries = (64, 256, 1024)
    by_bucket: dict[int, list[InferenceRequest]] = {}
    for r in measured:
        by_bucket.setdefault(bucket_index(boundaries, r.prompt_tokens), []).append(r)
    assert len(by_bucket) == 2, "the long prompt falls in a bucket of its own"

    before = engine.stats()
    run_batch(engine, measured)  # arrival order: one batch
    arrival = _since(before, engine.stats())
    before = engine.stats()
    for batch in by_bucket.values():
        run_batch(engine, batch)
    buckets = _since(before, engine.stats())

    assert arrival["prompt_padding"] / arrival["prompt_positions"] > 0.5  # three short rows padded to the long one
    assert buckets["prompt_padding"] / buckets["prompt_positions"] < 0.1
    assert buckets["prompt_positions"] < arrival["prompt_positions"] / 2


def test_a_long_answer_pads_a_batch_of_short_ones_and_answer_buckets_stop_it(engine):
    """Same prompt length, different max_tokens: the batcher with and without answer buckets."""
    story = "Write a long story about a lighthouse keeper and a storm."
    requests = [request(f"label-{i}", story, temperature=0, max_tokens=4) for i in range(3)]
    requests.append(request("essay", story, temperature=0, max_tokens=40))
    config = BatchingConfig(batch_size_target=4, boundaries=(64, 256), answer_boundaries=(16, 64))
    by_bucket: dict[str, list[InferenceRequest]] = {}
    for r in requests:
        by_bucket.setdefault(config.bucket_name(20, r.max_tokens), []).append(r)
    assert len(by_bucket) == 2, "the 40-token answer falls in an answer bucket of its own"

    before = engine.stats()
    run_batch(engine, requests)  # one batch: three 4-token rows computed on for the 40-token one
    arrival = _since(before, engine.stats())
    before = engine.stats()
    for batch in by_bucket.values():
        run_batch(engine, batch)
    buckets = _since(before, engine.stats())

    assert arrival["decode_padding"] / arrival["decode_positions"] > 0.5
    assert buckets["decode_padding"] / buckets["decode_positions"] < 0.1
    assert buckets["decode_positions"] < arrival["decode_positions"] / 2


def _since(before: dict, after: dict) -> dict:
    return {name: after[name] - before[name] for name in ("batch_requests", "prompt_positions", "prompt_padding",
                                                           "decode_positions", "decode_padding")}


def test_a_full_engine_takes_a_batch_whole_or_not_at_all(engine):
    first = [request(f"full-{i}", "Count from 1 to 50.", temperature=0, max_tokens=24) for i in range(6)]
    keys = engine.submit_batch([r.to_json() for r in first], [1] * 6)
    assert None not in keys and engine.in_flight() == 6
    more = [request(f"more-{i}", "Say yes.", max_tokens=2) for i in range(3)]
    assert engine.submit_batch([r.to_json() for r in more], [1] * 3) == [None, None, None]  # 6 + 3 > 8
    assert engine.submit_batch([first[0].to_json()], [1]) == keys[:1]  # a retried bundle: the same stream
    outputs = run_batch(engine, first)  # submitted again, as a retried bundle would: the same streams, driven
    assert all(any(kind == COMPLETION for kind, _ in items) for items in outputs.values())
    assert engine.in_flight() == 0
    assert None not in engine.submit_batch([r.to_json() for r in more], [1] * 3)


def test_what_the_engine_cannot_serve_becomes_a_dead_letter_and_the_batch_goes_on(engine):
    late = InferenceRequest(id="late", prompt="Say hi.", max_tokens=4, deadline_ms=500, received_at=time.time() - 5)
    outputs = run_batch(engine, [request("json", "Give me a JSON object.", max_tokens=8,
                                         response_format={"type": "json_object"}),
                                 late, request("plain", "Say hi.", max_tokens=4)])
    (letter,) = [data for kind, data in outputs["json"] if kind == DEAD_LETTER]
    assert "cannot apply response_format" in letter["reason"] and "engine=vllm" in letter["reason"] and \
        letter["stage"] == "inference"
    assert REFUSED == ("response_format", "adapter"), "the table's refused_elsewhere fields"
    (letter,) = [data for kind, data in outputs["late"] if kind == DEAD_LETTER]
    assert "deadline_ms=500 passed" in letter["reason"]
    assert any(kind == COMPLETION for kind, _ in outputs["plain"])
