"""Shared fixtures: the real local model, Pub/Sub emulator and vLLM server, started once."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from local.cpu_server import LOCAL_SERVER, apply_server_environment
from local.embedded_model import ensure_local_checkpoint
from local.emulators import BigQueryEmulator, Emulator, PubSubEmulator
from pipeline.config.settings import JobSettings
from pipeline.serving.vllm_server import ServerSpec, VLLMServer
from tests.gcloud_recorder import Recorder

SERVED_NAME = "smollm2"
REPO = Path(__file__).resolve().parent.parent
# The deploy tests' commit, and the spec of an earlier make template for it (CUDA 12, .env.example's).
DEPLOY_TAG = "0123456789ab"
DEPLOY_TEMPLATE_PATH = f"gs://bkt-test/templates/streaming-llm-{DEPLOY_TAG}-cu12.json"


@pytest.fixture(scope="session", autouse=True)
def local_server_environment() -> None:
    """Every local vLLM a test starts, directly or through a local pipeline, gets the local CPU settings' environment."""
    apply_server_environment()


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return ensure_local_checkpoint()


def local_server_spec(checkpoint: Path, **overrides) -> ServerSpec:
    """The spec the pipeline itself builds for the local model, via the real option path."""
    settings = JobSettings.from_mapping({
        "input_subscription": "projects/my-project/subscriptions/unused", "output_chunks_topic": "projects/my-project/topics/unused",
        "dead_letter_topic": "projects/my-project/topics/unused", "model": str(checkpoint), "dtype": LOCAL_SERVER.dtype,
        "served_model_name": SERVED_NAME, "vllm_args": " ".join(LOCAL_SERVER.vllm_args), "server_start_timeout_s": 900})
    spec = settings.engine.server
    return ServerSpec(**{**spec.__dict__, **overrides})


@pytest.fixture(scope="session")
def vllm_server(checkpoint):
    server = VLLMServer(local_server_spec(checkpoint, stall_timeout_s=10.0, health_interval_s=1.0)).start()
    yield server
    server.stop()


# Where vLLM's CPU build cannot run (local/machine_fit.py), make test installs the transformers engine without it.
NO_VLLM = importlib.util.find_spec("vllm") is None
NO_VLLM_REASON = ("this environment has no vLLM (installed for the transformers engine: python -m local.machine_fit "
                  "says why); the tests that serve with vLLM are skipped")


def needs_vllm(item: pytest.Item) -> bool:
    """Whether a test needs vLLM: it takes the suite's vLLM server, imports vLLM (marked ``imports_vllm``), or is of
    the model (marked ``engine``) and does not name the transformers engine in its id (that engine's own tests, and
    its runs of the end-to-end ones)."""
    if "vllm_server" in getattr(item, "fixturenames", ()) or item.get_closest_marker("imports_vllm"):
        return True
    return item.get_closest_marker("engine") is not None and "transformers" not in item.nodeid


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The known-answer test runs first: a model with a broken numeric path fails in minutes, not after 15. Without
    vLLM, the tests that need it are skipped, for one stated reason."""
    items.sort(key=lambda item: item.get_closest_marker("known_answer") is None)
    if NO_VLLM:
        for item in items:
            if needs_vllm(item):
                item.add_marker(pytest.mark.skip(reason=NO_VLLM_REASON))


@functools.cache
def uses_the_model(module: str) -> bool:
    """Whether a test module has tests marked ``engine`` (read from its source: the scheduler sees node ids only)."""
    return "mark.engine" in (Path(__file__).parent.parent / module).read_text()


# What the model-free process of ``make test`` runs at: CFS gives a nice-10 thread about a tenth of a core that a
# nice-0 one of the same session also wants.
MODEL_FREE_NICENESS = 10


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``make test``'s two processes, the model-free one, and all it starts, yields the CPU to the model's
    pipelines (same session); a server in a session of its own (vLLM, an emulator) shares by session, as Linux's
    autogroup schedules, so the model's time bounds leave room for this process (docs/testing.md)."""
    if (os.environ.get("PYTEST_XDIST_WORKER") and not uses_the_model(item.nodeid.split("::")[0])
            and os.getpriority(os.PRIO_PROCESS, 0) < MODEL_FREE_NICENESS):
        # This thread, and every process and thread it starts from now on.
        os.setpriority(os.PRIO_PROCESS, 0, MODEL_FREE_NICENESS)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``make test`` runs in two processes (pytest-xdist): the modules that start the model in one of them, one
    after another as they always ran (they share one vLLM and must not compete for its cores), and every other
    module on whichever process is free, a module at a time. The model's modules are one scope of xdist's scope
    scheduler, the largest, so it goes first to one process; the others are a scope each, shared out as the
    processes empty (its ``loadgroup`` marks do not reach pytest 9's node ids). One process taking every other
    module left the first idle once the model's were done: on a machine without vLLM, for most of the run."""
    from xdist.scheduler import LoadScopeScheduling

    class ModelAndRest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "model" if uses_the_model(module) else module

    return ModelAndRest(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Stops the suite when the known-answer test fails: every test of the model would fail for the same cause."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("known_answer"):
        item.session.shouldstop = ("the local model answered a known question wrongly (see the first failure); "
                                   "the other tests were not run")


@contextmanager
def activated(emulator: Emulator):
    """Points this process's Google clients at ``emulator``, restoring the environment after."""
    saved = {key: os.environ.get(key) for key in emulator.env()}
    emulator.activate()
    try:
        yield emulator
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def secret_manager(monkeypatch):
    """Secret Manager's stand-in holding the token, and this process as a fresh worker's: nothing read yet."""
    from pipeline.serving import model_access
    from tests.secret_manager_stand_in import SECRET, TOKEN, SecretManagerStandIn

    monkeypatch.delenv(model_access.HF_TOKEN_ENV, raising=False)
    monkeypatch.setattr(model_access, "_installed", {})
    stand_in = SecretManagerStandIn({SECRET: TOKEN + "\n"})
    yield stand_in
    stand_in.close()
    os.environ.pop(model_access.HF_TOKEN_ENV, None)  # read in by the test (monkeypatch restores a value it had)


@pytest.fixture(scope="session")
def bigquery():
    """The BigQuery emulator with a dataset named ``llm``."""
    with BigQueryEmulator() as running, activated(running):
        from local.emulators import emulator_bigquery_client
        emulator_bigquery_client(running.project).create_dataset("llm")
        yield running


@pytest.fixture(scope="session")
def emulator():
    with PubSubEmulator() as running:
        running.activate()
        yield running


def chat(base_url: str, content: str, **params) -> dict:
    body = json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": content}], **params}).encode()
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def thread_cores() -> dict[int, frozenset[int]]:
    """The cores each thread of this process may run on."""
    return {int(t): frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


@contextmanager
def thread_cores_restored():
    """Gives each thread of this process its cores back afterwards: a test that moves them must not move the rest."""
    before = thread_cores()
    try:
        yield
    finally:
        for thread, cores in before.items():
            try:
                os.sched_setaffinity(thread, cores)
            except OSError:  # the thread ended meanwhile
                pass


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def process_tree(server: VLLMServer) -> list[int]:
    """The running ``server``'s process and every process under it."""
    return [server.pid, *(child.pid for child in psutil.Process(server.pid).children(recursive=True))]


@contextmanager
def started(server: VLLMServer):
    """Starts ``server`` for one test and stops it after; its stop must leave none of its processes behind (vLLM
    runs its engine in child processes), and a second stop must do nothing. Every test that starts a server of its
    own checks this, so no test starts one only to stop it."""
    tree: list[int] = []
    try:
        server.start()
        tree = process_tree(server)
        assert len(tree) >= 2, "vLLM runs its engine in a child process"
        yield server
    finally:
        server.stop()
    assert wait_until(lambda: not any(psutil.pid_exists(pid) for pid in tree), 10), "the stop left processes behind"
    server.stop()  # idempotent


@pytest.fixture
def recorder(tmp_path):
    """The recorder, with the spec of an earlier make template for this TAG in its bucket (make run looks for it)."""
    recording = Recorder(str(tmp_path / "gcloud-config"))
    recording.objects[DEPLOY_TEMPLATE_PATH.removeprefix("gs://")] = b"{}"
    yield recording
    recording.close()


@pytest.fixture
def env_file(tmp_path) -> Path:
    """`.env.example`, filled in as its comments ask."""
    text = (REPO / ".env.example").read_text().replace("my-project", "proj-123456").replace(
        "my-bucket", "bkt-test")
    path = tmp_path / "deploy.env"
    path.write_text(text)
    return path
