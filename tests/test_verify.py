"""``make verify`` against a job, offline: Pub/Sub is the real emulator, and Dataflow, Cloud Monitoring and Cloud
Logging are a loopback stand-in answering as their references document (``tests/observability_stand_in.py``),
refusals included.

The job that answers the prompts is played by :class:`PlayedJob`: a thread that reads the input subscription on the
emulator and answers each request with chunks and a completion made by the pipeline's own code (the request parsed by
``parse_request``, its chunks cut by ``ChunkAssembler``, its completion a ``Completion`` with ``ServingLineage``'s
lineage, each serialised by its ``to_json``), published as the pipeline publishes them (chunks with the request id as
their ordering key). Running the real pipeline on the local vLLM would cost minutes per case, and what it publishes is
what the end-to-end tests check (``test_pipeline_e2e``); what is tested here is what verify makes of a job's answers,
logs and metrics. The worker's driver line is the pipeline's own format string, read from its source.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from local.emulators import PROJECT, PubSubEmulator
from ops import verify
from pipeline.contract.chunking import ChunkAssembler, ChunkPolicy
from pipeline.contract.messages import Completion, DeadLetter, InferenceRequest
from pipeline.contract.request_parsing import parse_request
from pipeline.serving.lineage import ServingLineage, WeightsLineage
from tests.observability_stand_in import ObservabilityStandIn

REPO = Path(__file__).resolve().parent.parent
REGION = "us-central1"
RUNS = itertools.count()
WORKER_IMAGE = "us-central1-docker.pkg.dev/local-project/dataflow/streaming-llm-worker:0123456789ab-cu12"
LINEAGE = ServingLineage(model=WeightsLineage("Qwen/Qwen2.5-1.5B-Instruct", "989aa7980e4cf806f80c7fef2b1adb7bc71aa306",
                                              "sha256:0123456789abcdef"),
                         engine="vllm 0.32.0", image=WORKER_IMAGE, settings={"dtype": "float16", "max_model_len": 4096})


def driver_line(driver: str, cuda: str, verdict: str) -> str:
    """The line a worker logs before its model server starts, from the pipeline's own format string."""
    source = (REPO / "pipeline" / "serving" / "vllm_server.py").read_text(encoding="utf-8")
    found = re.search(r'"(GPU driver %s, torch built for CUDA %s: %s; %s)"', source)
    assert found, "the worker's driver line changed: make ops/verify.py's DRIVER_LINE read the new one"
    return found.group(1) % (driver, cuda, verdict, "1 GPU(s) visible")


class PlayedJob:
    """Plays the Dataflow job (see the module's docstring): answers each request it reads, up to ``serve`` of them;
    after that it stops reading, as a full worker pulls nothing, and the rest stays in the subscription. It pulls
    (synchronous pull) no more than it will answer, and acknowledges each request once answered."""

    def __init__(self, subscription: str, topics: dict[str, str], serve: int | None = None) -> None:
        from google.cloud import pubsub_v1

        self.subscription, self.topics, self.serve = subscription, topics, serve
        self.served = 0
        self.stopping = threading.Event()
        self.publisher = pubsub_v1.PublisherClient(
            publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True))
        self.subscriber = pubsub_v1.SubscriberClient()
        self.thread = threading.Thread(target=self.run, name="played-job", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.is_set() and (self.serve is None or self.served < self.serve):
            room = 10 if self.serve is None else min(10, self.serve - self.served)
            try:
                response = self.subscriber.pull(subscription=self.subscription, max_messages=room, timeout=2)
            except Exception:  # noqa: BLE001 - an empty pull that timed out: ask again
                continue
            for received in response.received_messages:
                message = received.message
                parsed = parse_request(message.data, dict(message.attributes), message.message_id)
                if isinstance(parsed, DeadLetter):
                    self.publisher.publish(self.topics["DEAD_LETTER_TOPIC"], parsed.to_json().encode()).result(30)
                else:
                    self.answer(parsed)
                self.subscriber.acknowledge(subscription=self.subscription, ack_ids=[received.ack_id])
                self.served += 1

    def answer(self, request: InferenceRequest) -> None:
        assembler = ChunkAssembler(request.id, 1, ChunkPolicy(chunk_tokens=2), started_at=request.received_at)
        chunks = []
        for count, word in enumerate(["Bon", "jour", ",", " Paris", "."], start=1):
            chunks += assembler.add(word, count, time.time())
        chunks.append(assembler.finish("stop", 5, time.time()))
        for chunk in chunks:
            self.publisher.publish(self.topics["CHUNKS_TOPIC"], chunk.to_json().encode("utf-8"),
                                   ordering_key=chunk.id).result(timeout=30)
        now = time.time()
        completion = Completion(
            id=request.id, attempt=1, stream=assembler.stream, model="Qwen/Qwen2.5-1.5B-Instruct",
            prompt=request.prompt, messages=request.messages, text=assembler.text, finish_reason="stop",
            prompt_tokens=12, completion_tokens=assembler.tokens,
            time_to_first_token_ms=assembler.time_to_first_token_ms,
            total_ms=round((now - request.received_at) * 1000, 3), received_at=request.received_at, finished_at=now,
            metadata=request.metadata, queue_ms=1.0, decode_ms=10.0, accelerator_seconds=0.01,
            lineage=LINEAGE.record(request), lane=request.lane_name())
        self.publisher.publish(self.topics["COMPLETIONS_TOPIC"], completion.to_json().encode("utf-8")).result(
            timeout=30)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)
        self.subscriber.close()


def job_world(emulator: PubSubEmulator) -> dict[str, str]:
    """A job's topics and subscriptions as make setup makes them: the input with its subscription, the outputs
    each with an application's copy (``-sub``)."""
    from google.cloud import pubsub_v1

    run = next(RUNS)
    names = {"INPUT_TOPIC": f"vf{run}-prompts", "CHUNKS_TOPIC": f"vf{run}-chunks",
             "COMPLETIONS_TOPIC": f"vf{run}-completions", "DEAD_LETTER_TOPIC": f"vf{run}-dead-letters"}
    emulator.create_topic(names["INPUT_TOPIC"], subscription=f"vf{run}-prompts-sub")
    for name in ("CHUNKS_TOPIC", "COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC"):
        emulator.create_topic(names[name], subscription=f"{names[name]}-sub")
    paths = {name: emulator.topic(topic) for name, topic in names.items()}
    paths["INPUT_SUBSCRIPTION"] = emulator.subscription(f"vf{run}-prompts-sub")
    pubsub_v1.SubscriberClient().close()
    return paths


@pytest.fixture
def stand_in():
    running = ObservabilityStandIn(PROJECT)
    yield running
    running.close()


def settings_env(world: dict[str, str], stand_in: ObservabilityStandIn, job_name: str) -> dict[str, str]:
    """What make verify exports to ops.verify (the deploy settings), pointed at the stand-in and the emulator."""
    return {**{key: value for key, value in os.environ.items() if key.startswith(("PUBSUB_", "GOOGLE_CLOUD"))},
            "PROJECT": PROJECT, "REGION": REGION, "JOB_NAME": job_name, "MAX_WORKERS": "4", **world, **stand_in.env()}


def constant(value: float) -> Any:
    return lambda seconds: value


def a_running_job(stand_in: ObservabilityStandIn, world: dict[str, str], *, driver: tuple[str, str, str],
                  workers: Any, targets: Any, undelivered: Any, uncounted: float = 0,
                  trouble: dict[str, float] | None = None) -> dict[str, Any]:
    """A job in the stand-in with its logs and metrics, beside another job's, which verify must not read."""
    run = next(RUNS)
    name, job_id, other = f"streaming-llm-vf{run}", f"2026-11-25_00_00_{run:02d}-111", f"2026-11-24_00_00_{run:02d}-222"
    stand_in.add_job(other, name, REGION, state="JOB_STATE_UPDATED", age_s=7200)  # the same name, before an update
    stand_in.add_job(f"2026-11-25_00_00_{run:02d}-333", "someone-else", REGION)
    job = stand_in.add_job(job_id, name, REGION)
    harness, job_log = "dataflow.googleapis.com/harness", "dataflow.googleapis.com/job-message"
    stand_in.log(harness, job_id, name, REGION, message="Starting vLLM: vllm serve ...")
    stand_in.log(harness, job_id, name, REGION, message=driver_line(*driver))
    stand_in.log(job_log, job_id, name, REGION, text="Autoscaling: Raised the number of workers to 1", severity="INFO")
    stand_in.log(job_log, job_id, name, REGION, text="Worker pool stopped.", severity="WARNING")
    stand_in.log(job_log, other, name, REGION, text="Error message from worker: the old job's", severity="ERROR")
    stand_in.log(harness, other, name, REGION, message=driver_line("525.60.13", "13.0", "does not fit"))
    counter = "dataflow.googleapis.com/job/user_counter"
    counters: tuple[tuple[str, dict[str, Any]], ...] = (
        (job_id, {"read_messages": 120, "read_deferred": lambda s: 7 + 10 * s, "admitted_uncounted": uncounted,
                  **{name: constant(value) for name, value in (trouble or {}).items()}}),
        (other, {"read_messages": 999}))
    for job_of, values in counters:
        for metric_name, value in values.items():
            stand_in.gauge(counter, "dataflow_job", {"job_id": job_of, "metric_name": metric_name,
                                                     "ptransform": "ReadPrompts/Read"},
                           {"job_name": name, "project_id": PROJECT, "region": REGION},
                           value if callable(value) else constant(value), value_type="DOUBLE")
    for metric, value in (("active_worker_instances", workers), ("target_worker_instances", targets),
                          ("current_num_vcpus", lambda s: 8 * workers(s))):
        stand_in.gauge(f"dataflow.googleapis.com/job/{metric}", "dataflow_job", {"job_id": job_id},
                       {"job_name": name, "project_id": PROJECT, "region": REGION}, value)
    stand_in.gauge("pubsub.googleapis.com/subscription/num_undelivered_messages", "pubsub_subscription", {},
                   {"subscription_id": world["INPUT_SUBSCRIPTION"].rsplit("/", 1)[1], "project_id": PROJECT},
                   undelivered)
    return job


def run_verify(world: dict[str, str], stand_in: ObservabilityStandIn, job_name: str, tmp_path: Path,
               *flags: str) -> tuple[int, dict[str, Any], str]:
    report = tmp_path / "report.json"
    code = verify.main(["--json", str(report), "--timeout-s", "30", "--settle-s", "2", *flags],
                       settings_env(world, stand_in, job_name))
    return code, json.loads(report.read_text()), str(report)


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {check["name"]: check["status"] for check in report["checks"]}


def check(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in report["checks"] if c["name"] == name)


def no_verify_subscriptions_left() -> bool:
    from google.cloud import pubsub_v1

    subscriber = pubsub_v1.SubscriberClient()
    try:
        names = [s.name for s in subscriber.list_subscriptions(project=f"projects/{PROJECT}")]
        return not [name for name in names if "-verify-" in name]
    finally:
        subscriber.close()


def test_a_job_that_answers_and_scales_passes_every_check(emulator, stand_in, tmp_path):
    """Through the target itself: make exports the settings and passes BACKLOG and VERIFY_ARGS (it runs this
    checkout's virtualenv in place of .venv-deploy, which a deploy target makes on its first run)."""
    world = job_world(emulator)
    backlog = 12
    job = a_running_job(stand_in, world, driver=("580.95.05", "13.0", "fits"),
                        workers=lambda s: 1 if s < 1.5 else 2, targets=lambda s: 2,
                        undelivered=lambda s: max(0, backlog - int(4 * s)))
    path = tmp_path / "report.json"
    stamp = tmp_path / "deploy.installed"
    stamp.touch()
    played = PlayedJob(world["INPUT_SUBSCRIPTION"], world)
    try:
        ran = subprocess.run(
            ["make", "--no-print-directory", "verify", "ENV_FILE=/dev/null", f"DEPLOY_PY={sys.executable}",
             f"DEPLOY_STAMP={stamp}", f"PROJECT={PROJECT}", f"REGION={REGION}", f"JOB_NAME={job['name']}",
             *(f"{name}={value}" for name, value in world.items()), f"BACKLOG={backlog}",
             f"VERIFY_ARGS=--json {path} --timeout-s 30 --settle-s 2 --follow-seconds 3 --sample-seconds 1"],
            cwd=REPO, env={**os.environ, **stand_in.env()}, capture_output=True, text=True, timeout=300)
    finally:
        played.close()
    code, out, report = ran.returncode, ran.stdout, json.loads(path.read_text())
    assert code == 0, out + ran.stderr
    assert statuses(report) == {name: "PASS" for name in ("job", "first_chunk", "answers", "streams", "lineage",
                                                          "gpu_driver", "work_items", "flow_control", "autoscaling")}
    assert report["job"]["id"] == job["id"], "the active job of that name, not the one it replaced"
    assert "580.95.05" in check(report, "gpu_driver")["detail"] and "525.60.13" not in out, "only this job's logs"
    assert "read_messages 120" in check(report, "flow_control")["detail"], "only this job's counters"
    assert "rose from 1 to 2" in check(report, "autoscaling")["detail"]
    assert "Qwen/Qwen2.5-1.5B-Instruct" in check(report, "lineage")["detail"] and WORKER_IMAGE in out
    assert len(report["answers"]) == len(verify.KNOWN_PROMPTS)
    assert all(row["stream_whole"] and row["first_chunk_s"] is not None for row in report["answers"])
    assert len(report["samples"]) >= 3 and f"Report written to {path}" in out
    for line in ("PASS     job", "PASS     autoscaling"):
        assert line in out
    # It read on subscriptions of its own, and deleted them: an application's copy of each completion remains.
    assert no_verify_subscriptions_left()
    application = world["COMPLETIONS_TOPIC"].replace("/topics/", "/subscriptions/") + "-sub"
    app = [json.loads(data) for data in PubSubEmulator.take(application)]
    assert {row["id"] for row in report["answers"]} <= {record["id"] for record in app}
    # What it asked: Logging and Monitoring scoped to the job's id; Dataflow's listing paged through.
    filters = [body["filter"] for api, _, body in stand_in.requests if api == "logging"]
    assert filters and all(f'resource.labels.job_id="{job["id"]}"' in text for text in filters)
    assert sum(1 for api, path_, _ in stand_in.requests if api == "dataflow" and "pageToken=" in path_) >= 1


def test_a_job_whose_autoscaler_never_adds_a_worker_fails_the_autoscaling_line(emulator, stand_in, tmp_path, capsys):
    world = job_world(emulator)
    backlog = 25
    job = a_running_job(stand_in, world, driver=("580.95.05", "13.0", "fits"), workers=lambda s: 1,
                        targets=lambda s: 1, undelivered=lambda s: backlog)
    played = PlayedJob(world["INPUT_SUBSCRIPTION"], world, serve=len(verify.KNOWN_PROMPTS))
    try:
        code, report, _ = run_verify(world, stand_in, job["name"], tmp_path, "--backlog", str(backlog),
                                     "--follow-seconds", "3", "--sample-seconds", "1")
    finally:
        played.close()
    out = capsys.readouterr().out
    assert code == 1, out
    found = statuses(report)
    assert found.pop("autoscaling") == "FAIL" and set(found.values()) == {"PASS"}, found
    line = check(report, "autoscaling")
    assert "stayed at 1 worker(s)" in line["detail"] and f"backlog of {backlog}" in line["detail"]
    assert "NUM_WORKERS" in line["advice"] and job["id"] in line["advice"] and "min_num_workers" in line["advice"]
    assert "FAIL     autoscaling" in out and "-> size the job by hand" in out
    assert all(sample["workers"] == 1 for sample in report["samples"])
    # The backlog it published waits in the subscription, untouched by the job that stopped reading.
    left = [json.loads(data)["id"] for data in PubSubEmulator.take(world["INPUT_SUBSCRIPTION"])]
    assert len(left) == backlog and all("-backlog-" in request_id for request_id in left)


def flow_control_of(emulator, stand_in: ObservabilityStandIn, **counters: Any) -> verify.Check:
    """The flow_control check of a running job of one idle worker with these counters (``a_running_job``'s)."""
    world = job_world(emulator)
    job = a_running_job(stand_in, world, driver=("580.95.05", "13.0", "fits"), workers=constant(1),
                        targets=constant(1), undelivered=constant(0), **counters)
    rest = verify.Rest(settings_env(world, stand_in, job["name"]))
    try:
        return verify.flow_control_check(rest, verify.find_job(rest, PROJECT, REGION, job["name"], None))
    finally:
        rest.close()


@pytest.mark.parametrize("uncounted, status", [(0, "PASS"), (5, "PASS"), (60, "FAIL")])
def test_flow_control_fails_when_what_is_read_passes_on_without_a_place(emulator, stand_in, uncounted, status):
    """A runtime the admission step cannot ask passes everything on uncounted: nothing bounds what a worker takes.
    A rebuild's few (here 5 of 120) are flow control working."""
    found = flow_control_of(emulator, stand_in, uncounted=uncounted)
    assert found.status == status, found
    if status == "FAIL":
        assert "50% of what was read" in found.detail and "runtime" in found.advice


@pytest.mark.parametrize("trouble, said", [({"pull_refused": 3}, "cannot pull"), ({"pubsub_unreachable": 1},
                                                                                  "cannot pull"),
                                            ({"ack_failed": 2}, "acknowledgements failed")])
def test_flow_control_fails_when_pubsub_refuses_the_reader_or_its_acknowledgements(emulator, stand_in, trouble,
                                                                                    said):
    """The feed's counters of Pub/Sub refusing its pulls, being out of reach, or failing acknowledgements for good
    fail the check with the cause to look for, where they would otherwise look like a quiet subscription."""
    found = flow_control_of(emulator, stand_in, trouble=trouble)
    assert found.status == "FAIL" and said in found.detail, found
    assert "log" in found.advice


@pytest.mark.parametrize("num_workers, status", [(4, "UNKNOWN"), (1, "FAIL")])
def test_a_job_counted_only_in_vcpus_at_its_ceiling_is_not_failed_for_not_rising(num_workers, status):
    """Without the worker gauge the check counts vCPUs, whose number says nothing of MAX_WORKERS; a job launched
    with NUM_WORKERS at MAX_WORKERS cannot rise, so its flat line is no verdict."""
    job = verify.Job(PROJECT, REGION, "2026-11-25_00_00_00-1", "j", "JOB_STATE_RUNNING", "", "")
    samples = [verify.Sample(at, 25.0, None, None, None, 32.0) for at in (0.0, 60.0, 120.0)]
    found = verify.autoscaling_check(samples, 25, 120.0, 4, job, num_workers)
    assert found.status == status, found
    assert ("NUM_WORKERS=4, at MAX_WORKERS=4" in found.detail) == (status == "UNKNOWN")


def test_a_refusal_from_monitoring_or_logging_is_unknown_naming_the_role(emulator, stand_in, tmp_path, capsys):
    world = job_world(emulator)
    job = a_running_job(stand_in, world, driver=("580.95.05", "13.0", "fits"), workers=lambda s: 1,
                        targets=lambda s: 1, undelivered=lambda s: 0)
    stand_in.denied |= {"monitoring", "logging"}
    played = PlayedJob(world["INPUT_SUBSCRIPTION"], world)
    try:
        code, report, _ = run_verify(world, stand_in, job["name"], tmp_path)
    finally:
        played.close()
    captured = capsys.readouterr()
    assert code == 0, captured.out  # nothing failed; three questions stay open
    assert "Traceback" not in captured.out + captured.err
    for name, role in (("gpu_driver", "roles/logging.viewer"), ("work_items", "roles/logging.viewer"),
                       ("flow_control", "roles/monitoring.viewer")):
        line = check(report, name)
        assert line["status"] == "UNKNOWN" and "403 PERMISSION_DENIED" in line["detail"], line
        assert role in line["advice"] and PROJECT in line["advice"]
    assert check(report, "answers")["status"] == "PASS"
    assert check(report, "autoscaling")["status"] == "UNKNOWN" and "BACKLOG=" in check(report, "autoscaling")["advice"]


def test_without_dataflow_access_or_without_a_job_it_says_what_to_do(emulator, stand_in, tmp_path):
    world = job_world(emulator)
    code, report, _ = run_verify(world, stand_in, "streaming-llm-none", tmp_path)
    assert code == 1 and check(report, "job")["status"] == "FAIL"
    assert "no active job named streaming-llm-none" in check(report, "job")["detail"]
    assert {check(report, name)["status"] for name in ("answers", "gpu_driver", "flow_control")} == {"UNKNOWN"}
    stand_in.denied.add("dataflow")
    code, report, _ = run_verify(world, stand_in, "streaming-llm-none", tmp_path)
    line = check(report, "job")
    assert code == 0 and line["status"] == "UNKNOWN" and "roles/dataflow.viewer" in line["advice"]
    assert "--job-id" in check(report, "gpu_driver")["advice"]


def test_a_worker_whose_driver_does_not_fit_fails_naming_driver_cuda_and_the_fix(emulator, stand_in, tmp_path,
                                                                                  capsys):
    """The driver Container-Optimized OS labels latest may be older than CUDA 13 needs: vLLM never starts, so the job
    answers nothing either (no played job here), and the report says why."""
    world = job_world(emulator)
    job = a_running_job(stand_in, world, driver=("570.133.20", "13.0", "does not fit"), workers=lambda s: 1,
                        targets=lambda s: 1, undelivered=lambda s: 3)
    report_path = tmp_path / "report.json"
    code = verify.main(["--json", str(report_path), "--timeout-s", "3", "--settle-s", "0"],
                       settings_env(world, stand_in, job["name"]))
    report = json.loads(report_path.read_text())
    assert code == 1
    line = check(report, "gpu_driver")
    assert line["status"] == "FAIL" and "570.133.20" in line["detail"] and "CUDA 13.0" in line["detail"]
    assert "make image CUDA=12" in line["advice"] and "580" in line["advice"] and "docs/operations.md#gpu-driver" in \
        line["advice"]
    answers = check(report, "answers")
    assert answers["status"] == "FAIL" and "model server to start" in answers["advice"]
    assert "FAIL     gpu_driver" in capsys.readouterr().out


def test_a_stream_with_a_gap_or_another_text_is_not_whole():
    def chunk(seq: int, text: str, final: bool = False) -> dict[str, Any]:
        return {"id": "r", "stream": "s", "seq": seq, "text": text, "final": final}

    completion = {"id": "r", "stream": "s", "text": "Hello!"}

    def problem(*chunks: dict[str, Any]) -> str:
        return str(verify.stream_problem(completion, chunks))

    assert verify.stream_problem(completion, [chunk(0, "Hel"), chunk(1, "lo!", True), chunk(0, "Hel")]) is None
    assert "lacks seq 1" in problem(chunk(0, "Hel"), chunk(2, "!", True))
    assert "no final chunk" in problem(chunk(0, "Hel"), chunk(1, "lo!"))
    assert "add up to" in problem(chunk(0, "Hey"), chunk(1, "!", True))
    assert "no chunk of its stream" in problem({**chunk(0, "Hello!", True), "stream": "old"})


def test_what_verify_reads_is_what_the_pipeline_writes():
    """The driver line it parses is the worker's, what it publishes the pipeline takes as requests, and each counter
    it asks Monitoring for is one the pipeline counts."""
    for verdict in ("fits", "does not fit"):
        found = verify.DRIVER_LINE.search(driver_line("580.95.05", "13.0", verdict))
        assert found and found.group("verdict") == verdict and found.group("driver") == "580.95.05"
    absent = verify.DRIVER_LINE.search(driver_line("not found", "13.0", "fits"))
    assert absent and absent.group("driver") == "not found"
    for request_id, data in [*verify.known_requests("r1"), *verify.backlog_requests("r1", 2)]:
        parsed = parse_request(data)
        assert isinstance(parsed, InferenceRequest) and parsed.id == request_id, parsed
    source = "\n".join(path.read_text(encoding="utf-8") for path in (REPO / "pipeline").rglob("*.py"))
    for name in verify.FLOW_COUNTERS:
        assert re.search(rf'Metrics\.counter\([^)]*"{name}"\)', source), name


def test_the_stand_in_refuses_as_the_apis_do(stand_in):
    """Never a 200 to everything: a filter the API would refuse, an unknown job and a denied API answer their
    documented errors."""
    base = stand_in.api.url
    bad = requests.get(f"{base}/v3/projects/{PROJECT}/timeSeries", params={"filter": "metric.type=oops",
                                                                         "interval.endTime": "2026-01-01T00:00:00Z"})
    assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"
    missing = requests.get(f"{base}/v3/projects/{PROJECT}/timeSeries", params={"filter": 'metric.type="x"'})
    assert missing.status_code == 400
    job = requests.get(f"{base}/v1b3/projects/{PROJECT}/locations/{REGION}/jobs/2026-01-01_00_00_00-1")
    assert job.status_code == 404 and job.json()["error"]["status"] == "NOT_FOUND"
    logs = requests.post(f"{base}/v2/entries:list", json={"filter": "severity>=ERROR"})
    assert logs.status_code == 400, "resourceNames is required"
    unparsed = requests.post(f"{base}/v2/entries:list", json={"resourceNames": [f"projects/{PROJECT}"],
                                                              "filter": 'textPayload:"a" AND ('})
    assert unparsed.status_code == 400
    stand_in.denied.add("logging")
    denied = requests.post(f"{base}/v2/entries:list", json={"resourceNames": [f"projects/{PROJECT}"]})
    assert denied.status_code == 403 and denied.json() == {"error": {
        "code": 403, "message": "The caller does not have permission", "status": "PERMISSION_DENIED"}}


def test_make_verify_needs_the_jobs_name_and_passes_the_backlog_on():
    base = ["make", "--no-print-directory", "ENV_FILE=/dev/null", f"PROJECT={PROJECT}"]
    missing = subprocess.run([*base, "verify"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "Set JOB_NAME" in missing.stderr
    dry = subprocess.run([*base, "-n", "verify", "JOB_NAME=streaming-llm-x", "BACKLOG=3000",
                          "VERIFY_ARGS=--follow-seconds 900"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "-m ops.verify --backlog '3000' --follow-seconds 900" in dry.stdout
