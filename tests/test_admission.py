"""Admission: what a worker holds is bounded, because its reads take places before they pull.

The worker's side of it runs here: the places a read takes (pipeline/worker/read_places.py), the real admission
DoFn that admits each request in its read's place, the real generate DoFn under the runner stand-in
(``local/runner_semantics.py``), a real engine and the real vLLM. The reader itself runs under Beam's portable
runner in ``tests/test_subscription_reader.py``; the local path (the local runner's read takes places the same
way) end to end in ``tests/test_resilience_e2e.py``.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from local.runner_semantics import Driver, InProcessRuntime, Worker, generate_fn, in_process
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import LANE_BULK, InferenceRequest
from pipeline.engines.engine import Engine
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.flow.admission import AdmitFn
from pipeline.worker import read_places
from pipeline.worker.runtime import WorkerRuntime
from pipeline.worker.runtime_settings import AdmissionSettings
from tests.conftest import SERVED_NAME, wait_until

pytestmark = pytest.mark.engine


def settings_for(base_url: str) -> EngineSettings:
    return EngineSettings(server=None, server_url=base_url, served_model_name=SERVED_NAME, max_in_flight=2,
                          request_timeout_s=120, chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100))


def request(i: int, max_tokens: int = 24, min_tokens: int | None = None) -> InferenceRequest:
    return InferenceRequest(id=f"adm-{i}", prompt=f"Count from {i} upwards, in words.", max_tokens=max_tokens,
                            min_tokens=min_tokens, temperature=0.0, received_at=time.time())


def full_worker(base_url: str) -> tuple[InProcessRuntime, Engine, Driver, AdmitFn]:
    """A worker of 3 places (2 in flight, 1 waiting): its runtime (engine and admission ledger), the generate step
    under the runner stand-in, and its admission step as Dataflow runs it (waiting inside its bundle)."""
    engine = vllm_engine(settings_for(base_url))
    source = in_process(engine, "admission-test", AdmissionSettings(worker_queue=1, transit_s=0.5))
    generate = generate_fn(source, 50.0, dedupe_window_s=600)
    return source, engine, Driver([Worker("worker", generate, engine)]), admit_fn(source)


def admit_fn(source: InProcessRuntime) -> AdmitFn:
    admit = AdmitFn(source)
    admit.setup()
    return admit


def test_the_hold_counts_streams_waiting_reports_and_requests_on_their_way(vllm_server):
    # Its engine and admission ledger: 2 in flight and 2 waiting.
    engine = WorkerRuntime(vllm_engine(settings_for(vllm_server.base_url)),
                           AdmissionSettings(worker_queue=2, transit_s=0.5))
    try:
        admitted = [f"adm-{i}" for i in range(10)]
        assert engine.admit(admitted) == 4, "max_in_flight + worker_queue"
        time.sleep(1.0)
        assert engine.load()["on_the_way"] == 4, "an open bundle's requests count until it finishes"
        assert engine.admit(["other"]) == 0, "full: no room, whoever asks"
        engine.dispatched(admitted[:4])
        assert engine.admit(["another"]) == 0, "on their way: they arrive or lapse"
        assert engine.admit(["adm-1"]) == 1, "a retried bundle's request is held already"
        engine.dispatched(["adm-1"])
        engine.report_waiting("other-key", 0, arrived=["adm-0"])
        assert engine.load()["on_the_way"] == 3, "one arrived at this worker's generate step"
        assert wait_until(lambda: engine.load()["on_the_way"] == 1, 5), (
            "dispatched with the one that arrived, the others went elsewhere once the transit passed")
        time.sleep(1.0)
        assert engine.load()["on_the_way"] == 1, "dispatched after it, adm-1 counts while the keys here are behind"
        engine.report_waiting("other-key", 0, arrived=["adm-1"])
        assert engine.load()["on_the_way"] == 0

        # A fixed answer length long enough for vLLM's gauge (read once a second) to see both running.
        long = [request(i, 512, min_tokens=512).to_json() for i in (1, 2)]
        keys = engine.submit_batch(long, [1, 1])
        engine.report_waiting("shard-0", 1)
        load = engine.load()
        assert (load["held"], load["in_flight"], load["waiting"], load["on_the_way"]) == (3, 2, 1, 0)
        assert engine.admit([f"more-{i}" for i in range(5)]) == 1
        assert wait_until(lambda: engine.load()["server_running"] == 2, 30), "vLLM's own gauge of what it runs"

        engine.report_waiting("shard-0", 0)
        engine.report_waiting("shard-1", 2)
        assert engine.load()["waiting"] == 2, "reports count per key (their lapse: tests/test_hold.py)"
        engine.cancel(keys)
        assert engine.load()["in_flight"] == 0
    finally:
        engine.close()


def test_a_full_worker_reads_nothing_and_what_it_reads_as_room_frees_all_ends(vllm_server):
    """The Dataflow path on one worker: a read takes places before it pulls, the admission step admits each
    request in its read's place and never waits, and the generate step works the backlog down. A full worker's
    read gets no place; as streams end, reads get exactly the room freed, and the worker never holds more than
    its bound, counting what is on its way."""
    source, engine, driver, admit = full_worker(vllm_server.base_url)
    backlog = [request(i) for i in range(10, 22)]
    try:
        driver.deliver("shard-0", [request(i) for i in range(3)])  # full: 2 in flight, 1 waiting
        assert read_places.reserve(source.runtime, 5) == [], "a full worker's read takes no place: it pulls nothing"
        deadline, shard = time.monotonic() + 300, 1
        while backlog and time.monotonic() < deadline:
            if driver.fire("shard-0") is None:
                time.sleep(0.05)
            places = read_places.reserve(source.runtime, 5)
            pulled, backlog = backlog[:len(places)], backlog[len(places):]
            read_places.settle(source.runtime, source.tag, places, len(pulled))
            admit.start_bundle()
            started = time.monotonic()
            passed = [out.id for element in pulled for out in admit.process(element)]
            admit.finish_bundle()
            source.runtime.dispatched(places)
            assert time.monotonic() - started < 1.0, "the admission step never waits"
            assert passed == [r.id for r in pulled]
            load = source.runtime.load()
            assert load["held"] + load["on_the_way"] <= source.settings.max_held, load
            if pulled:  # the bundle committed: its requests reach the generate step (a key of their own)
                driver.deliver(f"shard-{shard}", pulled)
                shard += 1
        assert not backlog, "room freed as streams ended, and reads took it"
        while driver.busy_keys() and time.monotonic() < deadline:
            for key in list(driver.busy_keys()):
                driver.fire(key)
        assert sorted(c["id"] for c in driver.committed.completions) == sorted(
            [f"adm-{i}" for i in range(3)] + [f"adm-{i}" for i in range(10, 22)])
        assert wait_until(lambda: source.runtime.load()["held"] + source.runtime.load()["on_the_way"] == 0, 5)
    finally:
        engine.close()


def test_a_request_whose_place_no_longer_counts_passes_on_uncounted_without_waiting(vllm_server):
    """A request whose read's place is gone (a runtime rebuilt since, a place that lapsed) on a full worker is
    not held back: holding it would take a thread. It passes at once, uncounted, and a request that takes a
    live place is counted in it."""
    source, engine, _, admit = full_worker(vllm_server.base_url)
    bound = source.settings.max_held
    try:
        source.runtime.report_waiting("other-key", bound)  # another key of this worker holds it full
        admit.start_bundle()
        started = time.monotonic()
        assert [r.id for r in admit.process(request(30))] == ["adm-30"]
        assert time.monotonic() - started < 1.0
        assert source.runtime.load()["on_the_way"] == 0, "no room and no place: not counted"
        source.runtime.report_waiting("other-key", bound - 1)  # one of them was sent and finished: room for one
        places = read_places.reserve(source.runtime, 5)
        read_places.settle(source.runtime, source.tag, places, 1)
        assert len(places) == 1 and source.runtime.load()["on_the_way"] == 1
        assert [r.id for r in admit.process(request(31))] == ["adm-31"]
        assert source.runtime.load()["on_the_way"] == 1, "counted once, in its read's place"
        admit.finish_bundle()
    finally:
        engine.close()


def test_a_bulk_request_without_a_place_takes_none_of_the_room_kept_for_live_ones(vllm_server):
    """The bulk lane's reads take places only below bulk_held, and so does its request when it is admitted without
    one (its place lapsed): it passes uncounted, where a live request at the same load is counted in the room
    live_reserve keeps."""
    source, engine, _, admit = full_worker(vllm_server.base_url)
    settings_ = source.settings
    assert settings_.bulk_held < settings_.max_held, "the premise: live_reserve keeps room"
    try:
        source.runtime.report_waiting("other-key", settings_.bulk_held)  # the bulk lane's share is used
        admit.start_bundle()
        bulk = dataclasses.replace(request(40), lane=LANE_BULK)
        assert [r.id for r in admit.process(bulk)] == ["adm-40"]
        assert source.runtime.load()["on_the_way"] == 0, "a bulk request takes no live room"
        assert [r.id for r in admit.process(request(41))] == ["adm-41"]
        assert source.runtime.load()["on_the_way"] == 1, "a live one does"
        admit.finish_bundle()
    finally:
        engine.close()
