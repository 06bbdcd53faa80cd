"""Admission: what a worker holds is bounded, and on Dataflow the read stage waits for room.

The Dataflow path (the admission step waits inside its bundle) runs here around
the real admission DoFn, the real generate DoFn under the runner stand-in
(``local/runner_semantics.py``), a real engine and the real vLLM. The local path
(the read takes only what admission grants) is tested end to end in
``tests/test_resilience_e2e.py``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from local.runner_semantics import Driver, InProcessRuntime, Worker, generate_fn, in_process
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import VLLMEngine
from pipeline.flow.admission import AdmitFn, WorkerFull
from pipeline.worker.runtime import WorkerRuntime
from tests.conftest import SERVED_NAME, wait_until

pytestmark = pytest.mark.engine


def settings_for(base_url: str, **overrides) -> EngineSettings:
    values = dict(server=None, server_url=base_url, served_model_name=SERVED_NAME, max_in_flight=2,
                  worker_queue=2, request_timeout_s=120, admission_transit_s=0.5,
                  chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100))
    return EngineSettings(**{**values, **overrides})


def request(i: int, max_tokens: int = 24, min_tokens: int | None = None) -> InferenceRequest:
    return InferenceRequest(id=f"adm-{i}", prompt=f"Count from {i} upwards, in words.", max_tokens=max_tokens,
                            min_tokens=min_tokens, temperature=0.0, received_at=time.time())


def full_worker(base_url: str, **overrides) -> tuple[InProcessRuntime, VLLMEngine, Driver, AdmitFn]:
    """A worker of 3 places (2 in flight, 1 waiting): its runtime (engine and admission ledger), the generate step
    under the runner stand-in, and its admission step as Dataflow runs it (waiting inside its bundle)."""
    settings = settings_for(base_url, **{"max_in_flight": 2, "worker_queue": 1, **overrides})
    engine = VLLMEngine(settings)
    source = in_process(engine, "admission-test")
    generate = generate_fn(source, 50.0, dedupe_window_s=600)
    return source, engine, Driver([Worker("worker", generate, engine)]), admit_fn(source)


def admit_fn(source: InProcessRuntime) -> AdmitFn:
    admit = AdmitFn(source)
    admit.setup()
    return admit


def test_the_hold_counts_streams_waiting_reports_and_requests_on_their_way(vllm_server):
    engine = WorkerRuntime(VLLMEngine(settings_for(vllm_server.base_url)))  # its engine and admission ledger
    try:
        admitted = [f"adm-{i}" for i in range(10)]
        assert engine.admit(admitted) == 4, "max_in_flight + worker_queue"
        time.sleep(1.0)
        assert engine.load()["on_the_way"] == 4, "an open bundle's requests count until it finishes"
        assert engine.admit(["other"]) == 1, "held by open bundles alone, which only their finishing frees"
        engine.dispatched(admitted[:4] + ["other"])
        assert engine.admit(["another"]) == 0, "on their way: they arrive or lapse"
        assert engine.admit(["adm-1"]) == 1, "a retried bundle's request is held already"
        engine.dispatched(["adm-1"])
        engine.report_waiting("other-key", 0, arrived=["adm-0"])
        assert engine.load()["on_the_way"] == 4, "one arrived at this worker's generate step"
        assert wait_until(lambda: engine.load()["on_the_way"] == 0, 5), "dispatched, they count while in transit"

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


def test_a_full_worker_holds_the_read_bundle_until_the_generate_step_frees_room(vllm_server):
    """The Dataflow path: the admission step waits inside its bundle while the generate step, with its
    waiting requests reported, works its backlog down; then the held element goes on."""
    source, engine, driver, admit = full_worker(vllm_server.base_url)
    try:
        driver.deliver("shard-0", [request(i) for i in range(5)])  # 2 in flight, 3 waiting in state
        load = source.runtime.load()
        assert (load["in_flight"], load["waiting"]) == (2, 3), load
        assert source.runtime.admit(["adm-98"]) == 0

        passed: list[InferenceRequest] = []
        admit.start_bundle()
        held = threading.Thread(target=lambda: passed.extend(admit.process(request(99))), daemon=True)
        held.start()
        time.sleep(1.0)
        assert held.is_alive() and not passed, "a full worker must hold the bundle (its messages unacked)"

        deadline = time.monotonic() + 120
        while held.is_alive() and time.monotonic() < deadline:
            driver.fire("shard-0")
        assert not held.is_alive() and [r.id for r in passed] == ["adm-99"]
        assert source.runtime.load()["held"] <= source.settings.max_held
        while driver.busy_keys() and time.monotonic() < deadline:
            driver.fire("shard-0")
        assert sorted(c["id"] for c in driver.committed.completions) == [f"adm-{i}" for i in range(5)]
        assert wait_until(lambda: source.runtime.load()["held"] == 0, 5)
    finally:
        engine.close()



def test_a_blocked_bundle_of_many_requests_lets_one_through_per_place_freed(vllm_server):
    """An admitted request counts until the generate step has it, also while its bundle is still open: a
    bundle of many requests on a full worker passes one per place freed, never the rest at once. Once only
    open bundles hold the worker (nothing else can free a place), it goes on rather than wait forever."""
    source, engine, driver, admit = full_worker(vllm_server.base_url)
    bundle = [request(i) for i in range(10, 18)]
    passed: list[tuple[str, dict]] = []

    def run_bundle() -> None:
        admit.start_bundle()
        for element in bundle:
            for out in admit.process(element):
                passed.append((out.id, source.runtime.load()))
        admit.finish_bundle()

    try:
        driver.deliver("shard-0", [request(i) for i in range(3)])  # full: 2 in flight, 1 waiting
        thread = threading.Thread(target=run_bundle, daemon=True)
        thread.start()
        deadline = time.monotonic() + 300
        while thread.is_alive() and time.monotonic() < deadline:
            if driver.fire("shard-0") is None:
                time.sleep(0.05)
        assert not thread.is_alive(), f"the bundle never finished: {len(passed)} of {len(bundle)} passed"
        assert [request_id for request_id, _ in passed] == [r.id for r in bundle]
        for request_id, load in passed:
            # Past the bound only when nothing but this bundle held the worker.
            assert load["held"] + load["on_the_way"] <= source.settings.max_held or load["held"] == 0, (request_id, load)
        assert max(load["on_the_way"] for _, load in passed) == len(bundle), "each counted until it arrives"
        driver.deliver("shard-1", bundle)  # the bundle committed: its requests reach the generate step
        assert source.runtime.load()["on_the_way"] == 0, "arrived by id"
        while driver.busy_keys() and time.monotonic() < deadline:
            driver.fire("shard-0")
            driver.fire("shard-1")
        assert sorted(c["id"] for c in driver.committed.completions) == sorted(
            [f"adm-{i}" for i in range(3)] + [r.id for r in bundle])
        assert wait_until(lambda: source.runtime.load()["held"] == 0, 5)
    finally:
        engine.close()


def test_the_timers_keep_threads_while_every_read_bundle_of_a_full_worker_waits_or_is_refused(vllm_server):
    """Dataflow runs number_of_worker_harness_threads work items at once on a worker, read bundles and timer
    firings alike. A pool of 4 threads stands for them: with admission_waiters=2 (half), two read bundles wait
    for room, and a third and fourth are refused (WorkerFull: the work item fails, its thread is free, its messages
    stay in the subscription and the runner retries it later) rather than pass over the bound or wait too. So the
    generate step's poll timers still get a thread while both waiting bundles hold theirs. Without the waiting
    places all four bundles would wait and no timer would run until one of them passed."""
    source, engine, driver, _ = full_worker(vllm_server.base_url, admission_waiters=2, admission_transit_s=5.0)
    harness = ThreadPoolExecutor(max_workers=4, thread_name_prefix="harness")
    refused: list[int] = []
    passed: dict[int, list[str]] = {}
    stopped = threading.Event()

    def read_bundle(i: int) -> None:
        """One work item reading request i; refused, it ends, and the runner runs it again half a second later."""
        admit = admit_fn(source)  # one DoFn instance per bundle, as a runner may
        admit.start_bundle()
        try:
            out = [r.id for r in admit.process(request(i))]
            admit.finish_bundle()
            passed[i] = out
        except WorkerFull:
            refused.append(i)
            if not stopped.is_set():
                threading.Timer(0.5, lambda: stopped.is_set() or harness.submit(read_bundle, i)).start()

    # Another key of this worker reports requests waiting (renewed, as a key that polls does), so the worker stays
    # full however fast vLLM ends the streams below, until the test lets it go.
    busy_elsewhere = threading.Event()
    busy_elsewhere.set()

    def other_key() -> None:
        while busy_elsewhere.is_set() and not stopped.is_set():
            source.runtime.report_waiting("other-key", source.settings.max_held)
            time.sleep(1.0)
        source.runtime.report_waiting("other-key", 0)

    reporter = threading.Thread(target=other_key, daemon=True)
    try:
        driver.deliver("shard-0", [request(i, 64) for i in range(3)])  # 2 in flight, 1 waiting
        reporter.start()
        assert wait_until(lambda: source.runtime.load()["waiting"] > source.settings.max_held, 5)
        for i in range(20, 22):
            harness.submit(read_bundle, i)
        assert wait_until(lambda: len(source.runtime.admission._hold._places) == 2, 30), "two bundles wait"
        for i in range(22, 24):
            harness.submit(read_bundle, i)
        assert wait_until(lambda: set(refused) == {22, 23}, 30), "a third and fourth bundle are refused"
        assert source.runtime.load()["on_the_way"] == 0, "a refused bundle leaves nothing in the hold"

        # The property: timers run while both places are held and the refused bundles keep coming back.
        fired = 0
        for _ in range(4):
            harness.submit(driver.fire, "shard-0").result(timeout=30)
            fired += 1
            assert len(source.runtime.admission._hold._places) == 2 and not passed, "still waiting, still full"
        assert fired == 4

        busy_elsewhere.clear()  # the worker's own keys now free the room the bundles wait for
        reporter.join(5)
        deadline = time.monotonic() + 300
        while len(passed) < 4 and time.monotonic() < deadline:
            if harness.submit(driver.fire, "shard-0").result(timeout=30) is None:
                time.sleep(0.05)
            load = source.runtime.load()
            assert load["held"] + load["on_the_way"] <= source.settings.max_held + 1, load
        assert sorted(i for out in passed.values() for i in out) == [f"adm-{i}" for i in range(20, 24)]
        while driver.busy_keys() and time.monotonic() < deadline:
            driver.fire("shard-0")
        assert sorted(c["id"] for c in driver.committed.completions) == [f"adm-{i}" for i in range(3)]
    finally:
        stopped.set()
        harness.shutdown(wait=False, cancel_futures=True)
        engine.close()
