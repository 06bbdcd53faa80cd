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

import pytest

from local.runner_semantics import Driver, Worker
from pipeline import engine as engine_module
from pipeline.admission import _AdmitFn
from pipeline.chunking import ChunkPolicy
from pipeline.engine import EngineSettings
from pipeline.generate import _StreamingGenerateFn
from pipeline.messages import InferenceRequest
from pipeline.vllm_engine import StreamingEngine
from tests.conftest import SERVED_NAME, wait_until

pytestmark = pytest.mark.engine


def settings_for(base_url: str, **overrides) -> EngineSettings:
    values = dict(server=None, server_url=base_url, served_model_name=SERVED_NAME, max_in_flight=2,
                  worker_queue=2, request_timeout_s=120, admission_transit_s=0.5,
                  chunk_policy=ChunkPolicy(chunk_tokens=4, interval_ms=100))
    return EngineSettings(**{**values, **overrides})


def request(i: int, max_tokens: int = 24) -> InferenceRequest:
    return InferenceRequest(id=f"adm-{i}", prompt=f"Count from {i} upwards, in words.", max_tokens=max_tokens,
                            temperature=0.0, received_at=time.time())


def test_the_hold_counts_streams_waiting_reports_and_requests_on_their_way(vllm_server, monkeypatch):
    engine = StreamingEngine(settings_for(vllm_server.base_url))
    try:
        assert engine.admit(10) == 4, "max_in_flight + worker_queue"
        assert engine.admit(1) == 0
        assert engine.load()["on_the_way"] == 4
        assert wait_until(lambda: engine.load()["on_the_way"] == 0, 5), "admissions count only while on their way"

        keys = engine.submit_batch([request(1, 64).to_json(), request(2, 64).to_json()], [1, 1])
        engine.report_waiting("shard-0", 1)
        load = engine.load()
        assert (load["held"], load["in_flight"], load["waiting"], load["on_the_way"]) == (3, 2, 1, 0)
        assert engine.admit(5) == 1
        assert wait_until(lambda: engine.load()["server_running"] == 2, 30), "vLLM's own gauge of what it runs"

        engine.report_waiting("shard-0", 0)
        monkeypatch.setattr(engine_module, "WAITING_REPORT_LAPSE_S", 0.2)
        engine.report_waiting("shard-1", 2)
        time.sleep(0.3)
        assert engine.load()["waiting"] == 0, "an unrenewed report lapses (its key moved, or its worker stalled)"
        engine.cancel(keys)
        assert engine.load()["in_flight"] == 0
    finally:
        engine.close()


def test_a_full_worker_holds_the_read_bundle_until_the_generate_step_frees_room(vllm_server):
    """The Dataflow path: the admission step waits inside its bundle while the generate step, with its
    waiting requests reported, works its backlog down; then the held element goes on."""
    settings = settings_for(vllm_server.base_url, max_in_flight=2, worker_queue=1)
    engine = StreamingEngine(settings)
    generate = _StreamingGenerateFn(settings, "admission-test", 50.0, dedupe_window_s=600)
    generate._engine = engine
    driver = Driver([Worker("worker", generate, engine)])
    admit = _AdmitFn(settings, "admission-test", wait=True)
    admit._engine = engine
    try:
        driver.deliver("shard-0", [request(i) for i in range(5)])  # 2 in flight, 3 waiting in state
        load = engine.load()
        assert (load["in_flight"], load["waiting"]) == (2, 3), load
        assert engine.admit(1) == 0

        passed: list[InferenceRequest] = []
        held = threading.Thread(target=lambda: passed.extend(admit.process(request(99))), daemon=True)
        held.start()
        time.sleep(1.0)
        assert held.is_alive() and not passed, "a full worker must hold the bundle (its messages unacked)"

        deadline = time.monotonic() + 120
        while held.is_alive() and time.monotonic() < deadline:
            driver.fire("shard-0")
        assert not held.is_alive() and [r.id for r in passed] == ["adm-99"]
        assert engine.load()["held"] <= settings.max_held
        while driver.busy_keys() and time.monotonic() < deadline:
            driver.fire("shard-0")
        assert sorted(c["id"] for c in driver.committed.completions) == [f"adm-{i}" for i in range(5)]
        assert wait_until(lambda: engine.load()["held"] == 0, 5)
    finally:
        engine.close()

