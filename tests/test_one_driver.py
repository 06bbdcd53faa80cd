"""The generate DoFn and the worker simulator carry out a key's effects with one driver
(:func:`pipeline.generation.key_driver.drive`), so that what the simulator proves under its schedules is the effect
code that ships (#80). Runs on any machine: the DoFn's work items reach the transformers engine in this process, as
``engine=transformers`` does, through the runner stand-in (:mod:`local.runner_semantics`); the same check against
the managed vLLM is ``tests/test_runner_semantics.py``'s."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest

from local.runner_semantics import Driver, Worker, generate_fn, in_process
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.request_parsing import parse_request
from pipeline.engines.engine_settings import EngineSettings
from pipeline.engines.transformers_engine import transformers_engine
from pipeline.generation import generate, key_driver
from pipeline.serving.vllm_server import ServerSpec
from tests import worker_sim


@pytest.fixture(scope="module")
def worker(checkpoint):
    settings = EngineSettings(server=ServerSpec(model=str(checkpoint), dtype="float32", served_model_name="smollm2"),
                              engine="transformers", max_in_flight=4, request_timeout_s=120,
                              chunk_policy=ChunkPolicy(chunk_tokens=2, interval_ms=50))
    engine = transformers_engine(settings)
    yield Worker("worker-a", generate_fn(in_process(engine, "one-driver"), 50.0), engine)
    engine.close()


def test_the_dofn_and_the_simulator_import_the_one_driver():
    assert generate.drive is key_driver.drive and worker_sim.drive is key_driver.drive


@pytest.mark.engine
def test_a_change_to_the_driver_is_seen_by_the_dofn_on_transformers_and_by_the_simulator(worker, monkeypatch):
    """The driver changed twice (its steps and its submissions counted by who ran them): the DoFn's work items and
    the simulator's both show both changes, so neither carries out effects with a copy of the loop."""
    steps: dict[str, int] = defaultdict(int)
    submitted: dict[str, int] = defaultdict(int)
    runner = ["dofn"]
    real_step, real_submit = key_driver.step, key_driver.submit_in_order

    def counted_step(rules, state, event):
        steps[runner[0]] += 1
        return real_step(rules, state, event)

    def counted_submit(submissions, submit):
        submitted[runner[0]] += len(submissions)
        return real_submit(submissions, submit)

    monkeypatch.setattr(key_driver, "step", counted_step)
    monkeypatch.setattr(key_driver, "submit_in_order", counted_submit)
    driver = Driver([worker])
    request = parse_request(json.dumps({"id": "one-driver", "prompt": "Name a color.", "max_tokens": 4,
                                        "temperature": 0}).encode())
    driver.deliver(0, [request])
    deadline = time.monotonic() + 120
    while not (driver.committed.completions or driver.committed.dead_letters) and time.monotonic() < deadline:
        driver.fire(0)
    assert [c["id"] for c in driver.committed.completions] == ["one-driver"], driver.committed.dead_letters
    runner[0] = "simulator"
    report = worker_sim.run(0, faults=False)
    worker_sim.check(report)
    assert steps["dofn"] >= 3 and submitted["dofn"] >= 1, (steps, submitted)  # arrival, its answer, a poll
    assert steps["simulator"] >= report.work_items and submitted["simulator"] >= 1, (steps, submitted)
