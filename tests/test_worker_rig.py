"""One worker's read, batching and generation sharing a few harness threads, under the runner's rules.

Dataflow runs a worker's work items, read bundles and timer firings of every stage alike, on
``number_of_worker_harness_threads`` threads, one work item per key at a time. Here a pool of four threads
stands for them, around reads that take places before they pull (a read with no room for all it was given
resumes later, its thread free), the real admission DoFn, the real batcher DoFn and the real generate DoFn
under the runner stand-in (``local/runner_semantics.py``), one real engine and the real vLLM. Hypothesis draws the backlog's read bundles, which generate polls fail to commit (retried), and when
every timer of the worker fires late; whatever it draws, every request ends as exactly one completion, the
worker never runs more than max_in_flight, nothing is generated twice and nothing is left running.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
from apache_beam import pvalue
from apache_beam.transforms.window import GlobalWindow
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local.runner_semantics import Driver, InProcessRuntime, Worker, generate_fn
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.messages import InferenceRequest
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.vllm_engine import vllm_engine
from pipeline.flow.admission import AdmitFn, GenerateKeys
from pipeline.flow.batching import BatchingConfig, _BatchFn, _keyed
from pipeline.flow.subscription_reader import FULL_DELAY_S
from pipeline.serving.vllm_server import server_metrics
from pipeline.worker import read_places
from pipeline.worker.runtime import WorkerRuntime
from pipeline.worker.runtime_settings import AdmissionSettings, CallSettings
from tests.conftest import SERVED_NAME, wait_until
from tests.state_stand_in import Cell, Timer

pytestmark = pytest.mark.engine

THREADS = 4
LEASE_S = 4.0  # a loaded 2-core machine may leave a live stream unpolled for 2 s (docs/testing.md)
BATCHING = BatchingConfig(max_batch_delay_ms=100, batch_size_target=2, num_shards=2)
RUNS = iter(range(10**6))


class Batcher:
    """The real batcher DoFn with its state and timers per key, as a runner keeps them (no failures here)."""

    def __init__(self) -> None:
        self.fn = _BatchFn(BATCHING)
        self.state: dict[str, tuple[Cell, Cell, Timer, Timer]] = {}

    def cells(self, key: str) -> tuple[Cell, Cell, Timer, Timer]:
        return self.state.setdefault(key, (Cell(), Cell(), Timer(), Timer()))

    def arrive(self, key: str, request: InferenceRequest) -> list:
        buffer, counters, flush, window_end = self.cells(key)
        return list(self.fn.process((key, request), window=GlobalWindow(), buffer=buffer, counters=counters,
                                    flush=flush, window_end=window_end))

    def due(self, now: float) -> list[str]:
        return [key for key, (_, _, flush, _) in self.state.items() if flush.at is not None and flush.at <= now]

    def fire(self, key: str) -> list:
        buffer, counters, flush, _ = self.cells(key)
        flush.at = None
        return list(self.fn.on_flush(key=key, buffer=buffer, counters=counters))


@pytest.fixture(scope="module")
def worker(vllm_server):
    settings_ = EngineSettings(server=None, server_url=vllm_server.base_url, served_model_name=SERVED_NAME,
                               max_in_flight=2, request_timeout_s=120, stream_lease_s=LEASE_S,
                               chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100))
    runtime = WorkerRuntime(vllm_engine(settings_), AdmissionSettings(worker_queue=2, transit_s=1.0),
                            CallSettings(harness_threads=THREADS))
    yield InProcessRuntime(runtime, "rig"), runtime.engine
    runtime.close()


# Two schedules against the real vLLM: what real DoFns on a shared thread pool add. The bound under every way threads
# are handed out, over thousands of schedules, is tests/test_vm_sim.py's.
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(1, 9), min_size=1, max_size=4), failing=st.floats(0.0, 0.3),
       late=st.booleans())
def test_a_backlog_through_read_batching_and_generation_on_four_threads(worker, vllm_server, cuts, failing, late):
    source, engine = worker
    run = next(RUNS)
    requests = [InferenceRequest(id=f"rig{run}-{i}", prompt=f"Count from {i} to {i + 20}.", max_tokens=24,
                                 min_tokens=24, temperature=0.0, prompt_tokens=12, received_at=time.time())
                for i in range(10)]
    bounds = sorted({0, len(requests), *(c for c in cuts if c < len(requests))})
    bundles = [requests[a:b] for a, b in zip(bounds, bounds[1:])]  # the backlog as Dataflow reads it
    generate = generate_fn(source, 50.0, dedupe_window_s=600)
    driver, batcher = Driver([Worker("rig", generate, engine)]), Batcher()
    harness = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="harness")
    busy: set[object] = set()  # keys with a work item running: one at a time per key
    pending: list[tuple[object, Callable[[], None]]] = []  # work items whose key was busy: the pump retries them
    lock = threading.Lock()
    dead_letters: list = []
    holds: list[dict] = []  # the worker's load, sampled
    deferred: list[int] = []  # sizes of the reads that found no room and were resumed later
    reads_left = [len(bundles)]  # reads not yet wholly taken
    read_errors: list[BaseException] = []
    chance = random.Random(run)
    before = server_metrics(vllm_server.base_url, ("vllm:generation_tokens_total",))["vllm:generation_tokens_total"]

    def later(key: object, work: Callable[[], None]) -> None:
        with lock:
            pending.append((key, work))

    def start(key: object, work: Callable[[], None]) -> bool:
        """Runs the work item on a harness thread unless its key has one running."""
        with lock:
            if key in busy:
                return False
            busy.add(key)

        def run_it() -> None:
            try:
                work()
            finally:
                with lock:
                    busy.discard(key)
        harness.submit(run_it)
        return True

    def downstream(outputs: list) -> None:  # a committed work item's outputs reach the next stage
        for output in outputs:
            if isinstance(output, pvalue.TaggedOutput):
                dead_letters.append(output.value)
            else:
                shard, batch = output
                later(("generate", shard), lambda shard=shard, batch=batch: driver.deliver(shard, batch))

    def read_round(bundle: list[InferenceRequest]) -> None:
        """A reader's round fused with the admission step: places first, then at most that many of the pull; the
        rest stays in the subscription, and the runner resumes the reader FULL_DELAY_S later, its thread free."""
        try:
            places = read_places.reserve(source.runtime, len(bundle))
            pulled, rest = bundle[:len(places)], bundle[len(places):]
            read_places.settle(source.runtime, source.tag, places, len(pulled))
            admit = AdmitFn(source, GenerateKeys(BATCHING))
            admit.setup()
            admit.start_bundle()
            passed = [out for request in pulled for out in admit.process(request)]
            admit.finish_bundle()
            source.runtime.dispatched(places)
        except BaseException as exc:  # a read that raised fails the test below
            read_errors.append(exc)
            raise
        for request in passed:  # the bundle committed: on to the batcher, each on its bucket key
            ((key, _),) = _keyed(BATCHING, request)
            later(("batch", key), lambda key=key, request=request: downstream(batcher.arrive(key, request)))
        if rest:
            deferred.append(len(rest))
            threading.Timer(FULL_DELAY_S, lambda: harness.submit(read_round, rest)).start()
        else:
            with lock:
                reads_left[0] -= 1

    try:
        for bundle in bundles:
            harness.submit(read_round, bundle)
        deadline = time.monotonic() + 300
        was_late = not late
        while time.monotonic() < deadline:
            done = {c["id"] for c in driver.committed.completions} | {d["id"] for d in dead_letters}
            if not reads_left[0] and len(done) == len(requests) and not pending:
                break
            if not was_late and driver.committed.completions:  # once answers flow, every timer fires late
                time.sleep(1.5 * LEASE_S)
                was_late = True
            with lock:
                waiting, pending[:] = list(pending), []
            for key, work in waiting:
                if not start(key, work):
                    later(key, work)
            now = time.time()
            for key in batcher.due(now):
                start(("batch", key), lambda key=key: downstream(batcher.fire(key)))
            for key, due_at in driver.busy_keys().items():
                if due_at <= now:
                    commit = chance.random() >= failing
                    start(("generate", key), lambda key=key, commit=commit: driver.fire(key, commit=commit))
            holds.append(source.runtime.load())
            time.sleep(0.02)
        assert not read_errors, read_errors
    finally:
        harness.shutdown(wait=True)
    completions = driver.committed.completions
    assert sorted(c["id"] for c in completions) == sorted(r.id for r in requests), (len(completions), dead_letters)
    assert not dead_letters, dead_letters
    assert all(c["attempt"] == 1 for c in completions), "a failed poll or a late timer never sends a request again"
    assert all(load["in_flight"] <= source.settings.engine.max_in_flight for load in holds)
    peak = max(load["held"] + load["on_the_way"] for load in holds)
    # Reads take places first; the slack is the streams finished and not yet collected. With every timer 1.5 leases
    # late the batcher holds what was read past admission_transit_s, and it counts on its way while the keys here
    # are behind it (pipeline/worker/hold.py).
    assert peak <= source.settings.max_held + source.settings.engine.max_in_flight, peak
    assert wait_until(lambda: engine.in_flight() == 0, 10)
    generated = server_metrics(vllm_server.base_url, ("vllm:generation_tokens_total",))[
        "vllm:generation_tokens_total"] - before
    delivered = sum(c["usage"]["completion_tokens"] for c in completions)
    assert generated / delivered <= 1.05, (generated, delivered)
    print(f"rig run {run}: read bundles {[len(b) for b in bundles]}, peak hold {peak} of {source.settings.max_held}, "
          f"{len(deferred)} reads found too little room and resumed later")
