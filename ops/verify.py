"""``make verify``: ask a running job what no offline test can know, and say for each answer what to do.

The offline tests stand in for Dataflow, Cloud Monitoring and Cloud Logging; some facts only a real job shows: which
NVIDIA driver its workers got against the CUDA its image is built for, whether its work items fail, whether its
readers' flow control behaves as designed, and whether Dataflow's autoscaler sees the backlog this template leaves in
Pub/Sub (docs/operations.md#autoscaling-with-the-jobs-reader). This command asks them, of the job named ``JOB_NAME``
in ``REGION``, and prints one line per check, ``PASS``, ``FAIL`` or ``UNKNOWN``, each with what to do; the same
report is written as JSON (``--json``). It exits 1 when a check failed.

What each check reads, and from where:

- ``job``: Dataflow's ``projects.locations.jobs.list`` (the active job of that name) and ``projects.locations.jobs.get``
  (its ``currentState``): https://cloud.google.com/dataflow/docs/reference/rest/v1b3/projects.locations.jobs/list and
  https://cloud.google.com/dataflow/docs/reference/rest/v1b3/projects.locations.jobs/get.
- ``first_chunk``, ``answers``, ``streams``, ``lineage``: Pub/Sub, through its official client. It publishes
  :data:`KNOWN_PROMPTS` to ``INPUT_TOPIC`` and reads the job's chunks, completions and dead letters on subscriptions
  of its own on the output topics, made before publishing and deleted after (so neither ``make tail`` nor an
  application loses a message to it): the time to each prompt's first chunk, each completion's stream whole (gapless
  from ``seq`` 0 to its final chunk, the texts adding up to the completion's), and its ``lineage`` (docs/contract.md).
- ``gpu_driver`` and ``work_items``: Cloud Logging's ``entries.list``
  (https://cloud.google.com/logging/docs/reference/v2/rest/v2/entries/list; filters in the Logging query language,
  https://cloud.google.com/logging/docs/view/logging-query-language): the line each worker logs before its model
  server starts, ``GPU driver X, torch built for CUDA Y: fits`` (or ``does not fit``;
  :mod:`pipeline.serving.vllm_server`), and errors in the job's log (``dataflow.googleapis.com/job-message``), where
  Dataflow reports a failed work item ("Error message from worker").
- ``flow_control`` and, with ``--backlog N`` (``make verify BACKLOG=N``), ``autoscaling``: Cloud Monitoring's
  ``projects.timeSeries.list`` (https://cloud.google.com/monitoring/api/ref_v3/rest/v3/projects.timeSeries/list) over
  Dataflow's metrics (https://cloud.google.com/monitoring/api/metrics_gcp_d_h#gcp-dataflow): the readers' Beam
  counters as ``job/user_counter`` (``read_messages``, ``read_deferred``, ``admitted_uncounted``), and while a
  backlog of N requests it publishes waits, the job's ``job/active_worker_instances``, ``job/target_worker_instances``
  and ``job/current_num_vcpus`` beside the input subscription's
  ``pubsub.googleapis.com/subscription/num_undelivered_messages``
  (https://cloud.google.com/monitoring/api/metrics_gcp_p_z#gcp-pubsub), sampled for ``--follow-seconds``.

Dataflow, Monitoring and Logging are called through their REST APIs with google-auth's ``AuthorizedSession`` (the
transport Google's REST clients use): google-cloud-monitoring as the project installs it speaks gRPC only, and
google-cloud-logging is not a dependency. Each API's address can be overridden with the variable gcloud reads for it
(``CLOUDSDK_API_ENDPOINT_OVERRIDES_DATAFLOW``, ``..._MONITORING``, ``..._LOGGING``: a base URL), and
``CLOUDSDK_AUTH_DISABLE_CREDENTIALS=true`` sends no credentials, as gcloud does; the offline tests use both, and the
Pub/Sub client honours ``PUBSUB_EMULATOR_HOST``. Otherwise the credentials are Application Default Credentials. An
API that refuses (its documented error, https://cloud.google.com/apis/design/errors) makes its checks ``UNKNOWN``,
naming the role to ask for (docs/operations.md#verify-a-running-job), never a traceback.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.settings import DeployError, Settings

PASS, FAIL, UNKNOWN = "PASS", "FAIL", "UNKNOWN"
DEFAULT_ENDPOINTS = {"dataflow": "https://dataflow.googleapis.com/", "monitoring": "https://monitoring.googleapis.com/",
                     "logging": "https://logging.googleapis.com/"}
# The role each API's checks need, on the project (docs/operations.md#verify-a-running-job).
ROLES = {"dataflow": "Dataflow Viewer (roles/dataflow.viewer)",
         "monitoring": "Monitoring Viewer (roles/monitoring.viewer)",
         "logging": "Logs Viewer (roles/logging.viewer)",
         "pubsub": "Pub/Sub Editor (roles/pubsub.editor), for the subscriptions it makes and deletes, and Pub/Sub "
                   "Publisher (roles/pubsub.publisher) on the input topic"}
API_NAMES = {"dataflow": "Dataflow", "monitoring": "Cloud Monitoring", "logging": "Cloud Logging", "pubsub": "Pub/Sub"}
# Known prompts, answered in a few tokens by any instruction model; greedy, so a second run asks the same.
KNOWN_PROMPTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("capital", {"prompt": "What is the capital of France? Answer with one word.", "max_tokens": 16,
                 "temperature": 0}),
    ("count", {"prompt": "Count from 1 to 10, separated by commas.", "max_tokens": 48, "temperature": 0}),
    ("chat", {"messages": [{"role": "user", "content": "Say hello in French."}], "max_tokens": 24, "temperature": 0}),
)
METADATA = {"source": "make verify"}  # on every request it publishes, so an application can tell them apart
# The worker's line before its model server starts (pipeline/serving/vllm_server.py).
DRIVER_LINE = re.compile(r"GPU driver (?P<driver>not found|[^,\s]+), torch built for CUDA (?P<cuda>[^:\s]+): "
                         r"(?P<verdict>fits|does not fit)(?:; (?P<gpus>[^\n]*))?")
DRIVER_TEXT = "torch built for CUDA"
# The readers' flow-control counters (pipeline/flow/subscription_reader.py, pipeline/flow/admission.py).
FLOW_COUNTERS = ("read_messages", "read_deferred", "admitted_uncounted")
# The reader's feed's counters of Pub/Sub refusing it (pipeline/flow/pubsub_trouble.py) and of acknowledgements that
# failed for good (pipeline/flow/feed_acks.py): any of them fails the check with its cause.
TROUBLE_COUNTERS = ("pull_refused", "pubsub_unreachable", "ack_failed")
# More of what was read passing on uncounted than this share is flow control not holding: a runtime rebuild passes
# on what the readers had pulled before, a small share; a runtime never reachable passes on everything.
UNCOUNTED_SHARE = 0.05
COUNTER_WINDOW_S = 900.0  # a counter's newest point within this long (Dataflow exports them up to 4 minutes late)
GAUGE_WINDOW_S = 300.0
LOG_PAGES = 20  # at most this many pages of log entries per question
JOB_LOG = "dataflow.googleapis.com%2Fjob-message"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str  # PASS, FAIL or UNKNOWN
    detail: str
    advice: str = ""


@dataclass(frozen=True)
class Job:
    project: str
    region: str
    id: str
    name: str
    state: str
    state_time: str
    create_time: str


@dataclass(frozen=True)
class Arrival:
    """A record read from one of the job's output topics, when it came."""

    kind: str  # "chunk", "completion" or "dead letter"
    at: float  # time.monotonic()
    record: Mapping[str, Any]


@dataclass(frozen=True)
class Sample:
    """The backlog's follow, one sample: seconds since the backlog was published, and what Monitoring had."""

    at_s: float
    undelivered: float | None
    read_deferred: float | None
    workers: float | None
    target_workers: float | None
    vcpus: float | None


class ApiError(Exception):
    """An API's documented error: ``{"error": {"code", "status", "message"}}``."""

    def __init__(self, api: str, code: int, status: str, message: str) -> None:
        super().__init__(f"{API_NAMES[api]}: {code} {status}: {message}")
        self.api, self.code, self.status, self.message = api, code, status, message


def refused(name: str, error: ApiError, project: str) -> Check:
    """The check an API's refusal leaves: UNKNOWN, with the role to ask for (or what else to do)."""
    detail = f"{API_NAMES[error.api]} refused: {error.code} {error.status}: {error.message[:300]}"
    if "SERVICE_DISABLED" in error.status or "has not been used" in error.message:  # a 403 too, reason SERVICE_DISABLED
        advice = f"enable the {API_NAMES[error.api]} API in project {project}: gcloud services enable"
    elif error.code == 403 or error.status == "PERMISSION_DENIED":
        advice = (f"ask for {ROLES[error.api]} on project {project} (docs/operations.md#verify-a-running-job), "
                  "then run make verify again")
    elif error.code == 401 or error.status == "UNAUTHENTICATED":
        advice = "log in again: gcloud auth application-default login"
    else:
        advice = "run make verify again; if it persists, the message above says why"
    return Check(name, UNKNOWN, detail, advice)


class Rest:
    """Dataflow's, Monitoring's and Logging's REST APIs through one authorized session."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        import google.auth
        from google.auth.credentials import AnonymousCredentials, Credentials
        from google.auth.transport.requests import AuthorizedSession

        credentials: Credentials
        if (environ.get("CLOUDSDK_AUTH_DISABLE_CREDENTIALS") or "").lower() == "true":
            credentials = AnonymousCredentials()
        else:
            credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        self.session = AuthorizedSession(credentials)
        self.bases = {api: (environ.get(f"CLOUDSDK_API_ENDPOINT_OVERRIDES_{api.upper()}") or default).rstrip("/") + "/"
                      for api, default in DEFAULT_ENDPOINTS.items()}

    def call(self, api: str, method: str, path: str, params: Mapping[str, str] | None = None,
             body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        import requests

        try:
            response = self.session.request(method, self.bases[api] + path, params=params, json=body, timeout=60)
        except requests.RequestException as exc:
            raise ApiError(api, 0, "UNAVAILABLE", f"{self.bases[api]} could not be reached: {exc}") from None
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code >= 400 or not isinstance(answer, dict):
            error = answer.get("error") if isinstance(answer, dict) else None
            if not isinstance(error, dict):
                error = {"message": response.text[:300] or response.reason}
            raise ApiError(api, int(error.get("code") or response.status_code), str(error.get("status") or ""),
                           str(error.get("message") or ""))
        return answer

    def close(self) -> None:
        self.session.close()


def rfc3339(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# Dataflow ---------------------------------------------------------------------------------------------------------

def find_job(rest: Rest, project: str, region: str, name: str, job_id: str | None) -> Job | None:
    """The job ``job_id``, or the newest active job named ``name`` in ``region``; None when there is none."""
    jobs = f"v1b3/projects/{project}/locations/{region}/jobs"
    if not job_id:
        found: list[dict[str, Any]] = []
        token = ""
        while True:
            page = rest.call("dataflow", "GET", jobs, params={"filter": "ACTIVE", **({"pageToken": token} if token
                                                                                   else {})})
            found += [job for job in page.get("jobs") or [] if job.get("name") == name]
            token = page.get("nextPageToken") or ""
            if not token:
                break
        if not found:
            return None
        job_id = str(max(found, key=lambda job: job.get("createTime") or "")["id"])
    job = rest.call("dataflow", "GET", f"{jobs}/{job_id}")
    return Job(project, region, str(job.get("id") or job_id), str(job.get("name") or name),
               str(job.get("currentState") or "JOB_STATE_UNKNOWN"), str(job.get("currentStateTime") or ""),
               str(job.get("createTime") or job.get("startTime") or ""))


def job_check(job: Job | None, name: str, region: str) -> Check:
    if job is None:
        return Check("job", FAIL, f"no active job named {name} in {region}",
                     f"gcloud dataflow jobs list --region {region} --status active lists them; make run launches one")
    detail = f"{job.name} ({job.id}): {job.state}" + (f" since {job.state_time}" if job.state_time else "")
    if job.state == "JOB_STATE_RUNNING":
        return Check("job", PASS, detail)
    if job.state in ("JOB_STATE_PENDING", "JOB_STATE_QUEUED", "JOB_STATE_STOPPED"):
        return Check("job", FAIL, detail, "the job has not started yet: run make verify again in a few minutes")
    return Check("job", FAIL, detail, "the job is stopping or stopped: make run launches a new one")


# Pub/Sub: the known prompts ----------------------------------------------------------------------------------------

def known_requests(run: str) -> list[tuple[str, bytes]]:
    """(id, message) for each known prompt, ids unique to this run."""
    found = []
    for name, fields in KNOWN_PROMPTS:
        request = {"id": f"verify-{run}-{name}", **fields, "metadata": METADATA}
        found.append((str(request["id"]), json.dumps(request).encode("utf-8")))
    return found


def backlog_requests(run: str, count: int) -> list[tuple[str, bytes]]:
    """(id, message) for a backlog of ``count`` requests, each long enough to keep a worker busy."""
    return [(f"verify-{run}-backlog-{n}", json.dumps({
        "id": f"verify-{run}-backlog-{n}", "prompt": f"Write a long story about the number {n}.", "max_tokens": 256,
        "metadata": {**METADATA, "backlog": True}}).encode("utf-8")) for n in range(count)]


class Listener:
    """Reads the job's outputs on subscriptions of its own, made before anything is published and deleted after."""

    def __init__(self, outputs: Sequence[tuple[str, str]], run: str) -> None:
        import google.cloud.pubsub_v1 as pubsub_v1

        self.subscriber = pubsub_v1.SubscriberClient()
        self.arrivals: list[Arrival] = []
        self.changed = threading.Condition()
        self.made: list[str] = []
        self.streams: list[Any] = []
        self._outputs = outputs
        self._run = run

    def start(self) -> None:
        for topic, kind in self._outputs:
            project, _, topic_id = topic.removeprefix("projects/").partition("/topics/")
            name = f"projects/{project}/subscriptions/{topic_id}-verify-{self._run}"
            self.subscriber.create_subscription(request={
                "name": name, "topic": topic, "ack_deadline_seconds": 60, "enable_message_ordering": kind == "chunk",
                "message_retention_duration": {"seconds": 600}, "expiration_policy": {"ttl": {"seconds": 86400}}})
            self.made.append(name)
            self.streams.append(self.subscriber.subscribe(name, callback=self._callback(kind),
                                                          await_callbacks_on_shutdown=True))

    def _callback(self, kind: str) -> Callable[[Any], None]:
        def received(message: Any) -> None:
            try:
                record = json.loads(message.data)
            except ValueError:
                record = None
            message.ack()
            if isinstance(record, dict):
                with self.changed:
                    self.arrivals.append(Arrival(kind, time.monotonic(), record))
                    self.changed.notify_all()
        return received

    def wait(self, done: Callable[[list[Arrival]], bool], deadline: float) -> None:
        with self.changed:
            while not done(self.arrivals) and time.monotonic() < deadline:
                self.changed.wait(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))

    def close(self) -> None:
        for stream in self.streams:
            stream.cancel()
        for stream in self.streams:
            with contextlib.suppress(Exception):  # a stream that ended early has nothing more to give
                stream.result(timeout=30)
        for name in self.made:
            try:
                self.subscriber.delete_subscription(subscription=name)
            except Exception as exc:  # noqa: BLE001 - say so: it expires by itself a day after its last use
                print(f"make verify: could not delete {name} ({exc}); it expires a day after its last use",
                      file=sys.stderr)
        self.subscriber.close()


def by_request(arrivals: Sequence[Arrival], ids: Sequence[str]) -> dict[str, list[Arrival]]:
    wanted = {request_id: [] for request_id in ids}  # type: dict[str, list[Arrival]]
    for arrival in arrivals:
        if arrival.record.get("id") in wanted:
            wanted[str(arrival.record["id"])].append(arrival)
    return wanted


def stream_problem(completion: Mapping[str, Any], chunks: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the chunks of the stream ``completion`` names do not make it whole (None when they do): by the contract,
    de-duplicated by ``seq`` they run gapless from 0 to one marked final, and their texts add up to its text."""
    stream = completion.get("stream")
    seqs: dict[int, Mapping[str, Any]] = {}
    for chunk in chunks:
        if chunk.get("stream") == stream and isinstance(chunk.get("seq"), int):
            seqs.setdefault(int(chunk["seq"]), chunk)
    if not seqs:
        return f"no chunk of its stream {stream}"
    last = max(seqs)
    missing = [seq for seq in range(last + 1) if seq not in seqs]
    if missing:
        return f"stream {stream} lacks seq {', '.join(map(str, missing[:10]))} of 0-{last}"
    if not seqs[last].get("final"):
        return f"stream {stream} has no final chunk (seq 0-{last} came)"
    text = "".join(str(seqs[seq].get("text") or "") for seq in range(last + 1))
    if text != completion.get("text"):
        return (f"stream {stream}'s chunks add up to {text[:60]!r}, not the completion's "
                f"{str(completion.get('text'))[:60]!r}")
    return None


def answered(arrivals: Sequence[Arrival], ids: Sequence[str], with_chunks: bool) -> bool:
    """Whether every request has ended (a completion or a dead letter) and each completion's stream is whole."""
    for found in by_request(arrivals, ids).values():
        ends = [a for a in found if a.kind != "chunk"]
        if not ends:
            return False
        completion = next((a.record for a in ends if a.kind == "completion"), None)
        if completion is not None and with_chunks and stream_problem(
                completion, [a.record for a in found if a.kind == "chunk"]) is not None:
            return False
    return True


def judge_answers(published: Mapping[str, float], arrivals: Sequence[Arrival], with_chunks: bool,
                  waited_s: float) -> tuple[list[Check], list[dict[str, Any]]]:
    """The checks the known prompts' answers make, and what each prompt got (for the JSON report)."""
    found = by_request(arrivals, list(published))
    rows, first_s, ttft_ms, missing_first, ended, dead, unfinished = [], [], [], [], [], [], []
    broken, no_lineage, lineages = [], [], []
    for request_id, sent_at in published.items():
        mine = found[request_id]
        chunks = [a for a in mine if a.kind == "chunk"]
        completion = next((a.record for a in mine if a.kind == "completion"), None)
        letter = next((a.record for a in mine if a.kind == "dead letter"), None)
        first = min((a.at for a in chunks), default=None)
        row: dict[str, Any] = {"id": request_id, "first_chunk_s": None if first is None else round(first - sent_at, 3),
                               "chunks": len(chunks)}
        if first is None:
            missing_first.append(request_id)
        else:
            first_s.append(first - sent_at)
            ttft = chunks[0].record.get("time_to_first_token_ms")
            if isinstance(ttft, (int, float)):
                ttft_ms.append(float(ttft))
        if completion is not None:
            ended.append(request_id)
            row.update(text=completion.get("text"), finish_reason=completion.get("finish_reason"),
                       lineage=completion.get("lineage"))
            if with_chunks:
                problem = stream_problem(completion, [a.record for a in chunks])
                row["stream_whole"] = problem is None
                if problem:
                    broken.append(f"{request_id}: {problem}")
            lineage = completion.get("lineage")
            if not isinstance(lineage, Mapping) or not isinstance(lineage.get("model"), Mapping) \
                    or not lineage["model"].get("source") or not lineage.get("engine"):
                no_lineage.append(request_id)
            else:
                lineages.append(lineage)
        elif letter is not None:
            dead.append(f"{request_id} ({letter.get('stage')}): {str(letter.get('reason'))[:200]}")
            row["dead_letter"] = {"stage": letter.get("stage"), "reason": letter.get("reason")}
        else:
            unfinished.append(request_id)
        rows.append(row)
    total = len(published)
    nothing = not arrivals
    slow_start = (f"nothing came back within {waited_s:.0f} s: a job's first requests wait for its model server to "
                  "start (weights download, then load: minutes). Read the worker logs (vllm: lines, the driver line, "
                  "model download errors) and run make verify again, or wait longer (VERIFY_ARGS='--timeout-s 1200')")
    checks = []
    if not with_chunks:
        checks.append(Check("first_chunk", UNKNOWN, "the job has no chunks topic (CHUNKS_TOPIC is empty)",
                            "set CHUNKS_TOPIC to the job's output_chunks_topic to time its first chunks"))
    elif missing_first:
        checks.append(Check("first_chunk", FAIL, f"no chunk for {', '.join(missing_first)} within {waited_s:.0f} s",
                            slow_start if nothing else "completions came without chunks: is CHUNKS_TOPIC the "
                            "job's output_chunks_topic? Otherwise the job's log says why it did not publish them"))
    else:
        ttft = (f"; the job's own time to first token {min(ttft_ms):.0f}-{max(ttft_ms):.0f} ms" if ttft_ms else "")
        checks.append(Check("first_chunk", PASS, f"{total} of {total} first chunks, after {min(first_s):.2f}-"
                            f"{max(first_s):.2f} s (median {statistics.median(first_s):.2f} s) from publishing{ttft}"))
    if len(ended) == total:
        reasons = sorted({str(row.get("finish_reason")) for row in rows})
        checks.append(Check("answers", PASS, f"{total} of {total} known prompts answered (finish: "
                            f"{', '.join(reasons)})"))
    else:
        parts = ([f"dead letters: {'; '.join(dead)}"] if dead else []) + (
            [f"no answer within {waited_s:.0f} s: {', '.join(unfinished)}"] if unfinished else [])
        advice = slow_start if nothing else (
            "each dead letter's reason says what went wrong (stage inference: the model server; its worker's log says "
            "more)" if dead else "the job is slow or stuck: look at the job page's worker load and the worker logs; "
            "VERIFY_ARGS='--timeout-s 1200' waits longer")
        checks.append(Check("answers", FAIL, f"{len(ended)} of {total} answered; " + "; ".join(parts), advice))
    if not with_chunks:
        checks.append(Check("streams", UNKNOWN, "the job has no chunks topic (CHUNKS_TOPIC is empty)",
                            "set CHUNKS_TOPIC to the job's output_chunks_topic"))
    elif not ended:
        checks.append(Check("streams", UNKNOWN, "no completion came to check its stream against",
                            "see the answers line"))
    elif broken:
        checks.append(Check("streams", FAIL, "; ".join(broken),
                            "a stream that is not whole breaks the contract (docs/contract.md): report it in an issue "
                            "with this report's JSON and the job's id"))
    else:
        checks.append(Check("streams", PASS, f"{len(ended)} completion(s), each with its stream whole: gapless from "
                            "seq 0 to its final chunk, the texts adding up to the completion's"))
    if not ended:
        checks.append(Check("lineage", UNKNOWN, "no completion came to read its lineage", "see the answers line"))
    elif no_lineage:
        checks.append(Check("lineage", FAIL, f"no lineage (model, engine) on {', '.join(no_lineage)}",
                            "the job runs an image older than lineage: make image, make template and make update"))
    else:
        first_lineage = lineages[0]
        model = first_lineage["model"]
        revision = f" at {model.get('revision')}" if model.get("revision") else ""
        checks.append(Check("lineage", PASS, f"model {model.get('source')}{revision}, engine "
                            f"{first_lineage.get('engine')}, image {first_lineage.get('image') or '(none)'}"))
    return checks, rows


def ask_known_prompts(settings: Settings, run: str, timeout_s: float,
                      settle_s: float) -> tuple[list[Check], list[dict[str, Any]]]:
    """Publishes the known prompts, waits for their answers, and judges them."""
    from google.api_core import exceptions

    project = settings.get("PROJECT")
    topic = settings.pubsub_path("INPUT_TOPIC")
    completions = settings.pubsub_path("COMPLETIONS_TOPIC")
    chunks = settings.pubsub_path("CHUNKS_TOPIC")
    if not completions:
        return [Check(name, UNKNOWN, "the job has no completions topic (COMPLETIONS_TOPIC is empty)",
                      "set COMPLETIONS_TOPIC to the job's output_completions_topic")
                for name in ("first_chunk", "answers", "streams", "lineage")], []
    outputs = [(path, kind) for path, kind in ((chunks, "chunk"), (completions, "completion"),
                                                (settings.pubsub_path("DEAD_LETTER_TOPIC"), "dead letter")) if path]
    listener = Listener(outputs, run)
    try:
        import google.cloud.pubsub_v1 as pubsub_v1

        listener.start()
        requests = known_requests(run)
        print(f"==> Publishing {len(requests)} known prompts to {topic}; waiting up to {timeout_s:.0f} s for their "
              "chunks and completions", flush=True)
        publisher = pubsub_v1.PublisherClient()
        published: dict[str, float] = {}
        for request_id, data in requests:
            published[request_id] = time.monotonic()
            publisher.publish(topic, data).result(timeout=60)
        started = time.monotonic()
        ids = list(published)
        listener.wait(lambda arrivals: answered(arrivals, ids, bool(chunks)), started + timeout_s)
        # Chunks travel on another topic than completions: give late ones a moment.
        listener.wait(lambda arrivals: answered(arrivals, ids, bool(chunks)),
                      min(started + timeout_s, time.monotonic() + settle_s))
        with listener.changed:
            arrivals = list(listener.arrivals)
        return judge_answers(published, arrivals, bool(chunks), time.monotonic() - started)
    except exceptions.NotFound as exc:
        return [Check("answers", FAIL, f"Pub/Sub: {exc.message}",
                      f"a topic of the job is missing in project {project}: make setup makes them")], []
    except (exceptions.GoogleAPICallError, concurrent.futures.TimeoutError) as exc:
        return [refused("answers", pubsub_error(exc), project)], []
    finally:
        listener.close()


def pubsub_error(exc: Exception) -> ApiError:
    """A Pub/Sub client's error as the API's (its HTTP code and status), or a publish that was not confirmed."""
    from google.api_core import exceptions

    if isinstance(exc, exceptions.GoogleAPICallError):
        status = getattr(exc.grpc_status_code, "name", "") or type(exc).__name__
        return ApiError("pubsub", int(exc.code or 0), status, str(exc.message))
    return ApiError("pubsub", 0, "DEADLINE_EXCEEDED", f"Pub/Sub did not confirm a publish in time ({exc})")


def publish_backlog(settings: Settings, run: str, count: int) -> None:
    import google.cloud.pubsub_v1 as pubsub_v1

    topic = settings.pubsub_path("INPUT_TOPIC")
    print(f"==> Publishing a backlog of {count} requests to {topic}", flush=True)
    publisher = pubsub_v1.PublisherClient()
    futures = [publisher.publish(topic, data) for _, data in backlog_requests(run, count)]
    for future in futures:
        future.result(timeout=300)


# Cloud Logging ----------------------------------------------------------------------------------------------------

def log_entries(rest: Rest, project: str, query: str, limit: int = 1000) -> list[dict[str, Any]]:
    """Log entries matching ``query``, newest first, at most ``limit`` (and :data:`LOG_PAGES` pages)."""
    entries: list[dict[str, Any]] = []
    token = ""
    for _ in range(LOG_PAGES):
        body: dict[str, Any] = {"resourceNames": [f"projects/{project}"], "filter": query,
                                "orderBy": "timestamp desc", "pageSize": min(1000, limit - len(entries))}
        if token:
            body["pageToken"] = token
        page = rest.call("logging", "POST", "v2/entries:list", body=body)
        entries += page.get("entries") or []
        token = page.get("nextPageToken") or ""
        if not token or len(entries) >= limit:
            break
    return entries[:limit]


def entry_text(entry: Mapping[str, Any]) -> str:
    payload = entry.get("jsonPayload")
    if isinstance(payload, Mapping) and isinstance(payload.get("message"), str):
        return payload["message"]
    return str(entry.get("textPayload") or "")


def job_scope(job: Job) -> str:
    return (f'resource.type="dataflow_step" AND resource.labels.job_id="{job.id}"'
            + (f' AND timestamp>="{job.create_time}"' if job.create_time else ""))


def driver_check(rest: Rest, job: Job) -> Check:
    from pipeline.serving.server_platform import driver_problem

    query = f'{job_scope(job)} AND (textPayload:"{DRIVER_TEXT}" OR jsonPayload.message:"{DRIVER_TEXT}")'
    try:
        entries = log_entries(rest, job.project, query, limit=200)
    except ApiError as exc:
        return refused("gpu_driver", exc, job.project)
    seen: dict[tuple[str, str, str], int] = {}
    for entry in entries:
        found = DRIVER_LINE.search(entry_text(entry))
        if found:
            key = (found.group("driver"), found.group("cuda"), found.group("verdict"))
            seen[key] = seen.get(key, 0) + 1
    if not seen:
        return Check("gpu_driver", UNKNOWN, f"no worker of job {job.id} has logged its driver check ('GPU driver X, "
                     f"{DRIVER_TEXT} Y') since the job started",
                     "a worker logs it when it starts its model server, on its first request: run make verify again "
                     "after the first answers (with engine=transformers or server_url there is no such line)")
    lines = "; ".join(f"driver {driver}, CUDA {cuda}: {verdict} ({count} line{'s' if count > 1 else ''})"
                      for (driver, cuda, verdict), count in sorted(seen.items()))
    unfit = [(driver, cuda) for driver, cuda, verdict in seen if verdict == "does not fit"]
    if any(driver == "not found" for driver, _, _ in seen):
        return Check("gpu_driver", FAIL, f"a worker found no NVIDIA driver: {lines}",
                     "the workers have no GPU: launch with worker_accelerator=type:nvidia-l4;count:1;"
                     "install-nvidia-driver:latest (make run sets it) on a machine type that takes it")
    if unfit:
        driver, cuda = unfit[0]
        fix = driver_problem(driver, cuda) or (f"the worker's NVIDIA driver is {driver}, but its image is built for "
                                               f"CUDA {cuda}: build the CUDA 12 image (make image CUDA=12)")
        image = re.search(r"CUDA=(\d+)", fix)
        then = (f"; then make template CUDA={image.group(1)} and make update CUDA={image.group(1)} JOB_NAME={job.name} "
                f"(or drain, and make run CUDA={image.group(1)})" if image else "")
        return Check("gpu_driver", FAIL, f"the workers' driver does not fit the image: {lines}",
                     f"{fix}{then}: docs/operations.md#gpu-driver")
    return Check("gpu_driver", PASS, lines)


def work_items_check(rest: Rest, job: Job) -> Check:
    query = (f'{job_scope(job)} AND logName="projects/{job.project}/logs/{JOB_LOG}" AND severity>=ERROR')
    try:
        entries = log_entries(rest, job.project, query, limit=1000)
    except ApiError as exc:
        return refused("work_items", exc, job.project)
    if not entries:
        return Check("work_items", PASS, "no error in the job's log"
                     + (f" since it was created ({job.create_time})" if job.create_time else ""))
    latest = entry_text(entries[0]).strip().splitlines()
    text = " ".join(entry_text(entry) for entry in entries)
    detail = (f"{len(entries)}{'+' if len(entries) >= 1000 else ''} error(s) in the job's log, the latest at "
              f"{entries[0].get('timestamp')}: {(latest[0] if latest else '')[:300]}")
    if "ZONE_RESOURCE_POOL_EXHAUSTED" in text or "quota" in text.lower():
        advice = ("workers could not get their GPUs (a stockout or a quota): docs/operations.md#quota-and-gpu-"
                  "stockouts says what to do")
    else:
        advice = (f"Dataflow logs a failed work item there ('Error message from worker') and retries it; read them: "
                  f"gcloud dataflow logs list {job.id} --region {job.region} --importance=error, and the worker logs "
                  "around that time")
    return Check("work_items", FAIL, detail, advice)


# Cloud Monitoring -------------------------------------------------------------------------------------------------

def newest(rest: Rest, project: str, query: str, window_s: float) -> float | None:
    """The sum, over the time series ``query`` matches, of each one's newest point within the last ``window_s``
    seconds (None when no series has a point there). Dataflow's counters are gauges of their running totals, one
    series per step that counts."""
    end = now_utc()
    params = {"filter": query, "interval.startTime": rfc3339(end - datetime.timedelta(seconds=window_s)),
              "interval.endTime": rfc3339(end), "view": "FULL"}
    total, found, token = 0.0, False, ""
    while True:
        page = rest.call("monitoring", "GET", f"v3/projects/{project}/timeSeries",
                         params={**params, **({"pageToken": token} if token else {})})
        for series in page.get("timeSeries") or []:
            points = series.get("points") or []
            if not points:
                continue
            # Points come newest first (TimeSeries.points); sorted anyway, by their interval's end.
            point = max(points, key=lambda p: (p.get("interval") or {}).get("endTime") or "")
            value = point.get("value") or {}
            number = value.get("int64Value", value.get("doubleValue"))
            if number is None:
                continue
            total += float(number)
            found = True
        token = page.get("nextPageToken") or ""
        if not token:
            break
    return total if found else None


def counter_query(job: Job, name: str) -> str:
    return ('metric.type="dataflow.googleapis.com/job/user_counter" AND resource.type="dataflow_job" AND '
            f'metric.labels.job_id="{job.id}" AND metric.labels.metric_name="{name}"')


def job_metric_query(job: Job, metric: str) -> str:
    return (f'metric.type="dataflow.googleapis.com/job/{metric}" AND resource.type="dataflow_job" AND '
            f'metric.labels.job_id="{job.id}"')


def undelivered_query(subscription: str) -> str:
    subscription_id = subscription.rsplit("/", 1)[-1]
    return ('metric.type="pubsub.googleapis.com/subscription/num_undelivered_messages" AND '
            f'resource.type="pubsub_subscription" AND resource.labels.subscription_id="{subscription_id}"')


def flow_control_check(rest: Rest, job: Job) -> Check:
    try:
        values = {name: newest(rest, job.project, counter_query(job, name), COUNTER_WINDOW_S) for name in FLOW_COUNTERS}
    except ApiError as exc:
        return refused("flow_control", exc, job.project)
    if values["read_messages"] is None:
        return Check("flow_control", UNKNOWN, f"no {', '.join(FLOW_COUNTERS)} of job {job.id} in Cloud Monitoring in "
                     f"the last {COUNTER_WINDOW_S / 60:.0f} minutes",
                     "Dataflow exports counters up to 4 minutes late: run make verify again in a few minutes (the job "
                     "page's Job metrics show them live)")
    shown = ", ".join(f"{name} {values[name]:.0f}" if values[name] is not None else f"{name} (none yet)"
                      for name in FLOW_COUNTERS)
    read, uncounted = values["read_messages"] or 0, values["admitted_uncounted"] or 0
    if uncounted > UNCOUNTED_SHARE * max(read, 1):
        return Check("flow_control", FAIL, f"{shown}: {uncounted / max(read, 1):.0%} of what was read passed on "
                     "without a place in the worker's hold (the runtime could not be asked), so nothing bounded what "
                     "each worker took", "the job's log says why the runtime was unreachable (its engine host or "
                     "model server failing to start: docs/operations.md#first-job-checklist)")
    try:
        trouble = {name: newest(rest, job.project, counter_query(job, name), COUNTER_WINDOW_S) or 0
                   for name in TROUBLE_COUNTERS}
    except ApiError as exc:
        return refused("flow_control", exc, job.project)
    if trouble["pull_refused"] or trouble["pubsub_unreachable"]:
        return Check("flow_control", FAIL, f"{shown}; pull_refused {trouble['pull_refused']:.0f}, "
                     f"pubsub_unreachable {trouble['pubsub_unreachable']:.0f}: the workers cannot pull the "
                     "subscription", "the job's log says why, once a minute ('Pub/Sub refuses to let this worker "
                     "pull', 'Pub/Sub cannot be reached'): the job's account needs Pub/Sub Subscriber and Viewer on "
                     "the subscription (make setup), and a worker without an external IP needs Private Google Access "
                     "(docs/operations.md#network)")
    if trouble["ack_failed"]:
        return Check("flow_control", FAIL, f"{shown}; ack_failed {trouble['ack_failed']:.0f}: acknowledgements failed, "
                     "so Pub/Sub delivers those messages again", "the job's log says why ('Acknowledging ... failed'); "
                     "a copy that comes back after dedupe_window_s is answered again (docs/architecture.md)")
    deferred = values["read_deferred"] or 0
    reading = ("the readers found the workers full in some rounds and pulled nothing then, as designed"
               if deferred else "no reader round found a worker full")
    return Check("flow_control", PASS, f"{shown}: {reading}")


def sample(rest: Rest, job: Job, subscription: str, at_s: float) -> Sample:
    project = job.project
    return Sample(round(at_s, 1), newest(rest, project, undelivered_query(subscription), GAUGE_WINDOW_S),
                  newest(rest, project, counter_query(job, "read_deferred"), COUNTER_WINDOW_S),
                  newest(rest, project, job_metric_query(job, "active_worker_instances"), GAUGE_WINDOW_S),
                  newest(rest, project, job_metric_query(job, "target_worker_instances"), GAUGE_WINDOW_S),
                  newest(rest, project, job_metric_query(job, "current_num_vcpus"), GAUGE_WINDOW_S))


def autoscaling_check(samples: Sequence[Sample], backlog: int, follow_s: float, max_workers: int | None,
                      job: Job, num_workers: int | None = None) -> Check:
    """Whether the workers rose while the backlog waited in Pub/Sub
    (docs/operations.md#autoscaling-with-the-jobs-reader)."""
    def values(field: str) -> list[float]:
        return [getattr(s, field) for s in samples if getattr(s, field) is not None]

    workers, vcpus, undelivered = values("workers"), values("vcpus"), values("undelivered")
    targets, deferred = values("target_workers"), values("read_deferred")
    counted, unit = (workers, "worker(s)") if workers else (vcpus, "vCPUs")
    if not counted or not undelivered:
        missing = " and ".join(what for what, got in (("the job's worker count", counted),
                                                      ("the subscription's undelivered messages", undelivered))
                               if not got)
        return Check("autoscaling", UNKNOWN, f"Cloud Monitoring had no {missing} in {follow_s:.0f} s",
                     "these metrics arrive up to 4 minutes late: follow longer (VERIFY_ARGS='--follow-seconds 900'), "
                     "or watch the job page's Autoscaling chart")
    first, most = counted[0], max(counted)
    rise = f"; read_deferred +{deferred[-1] - deferred[0]:.0f}" if len(deferred) > 1 else ""
    waiting = f"undelivered {undelivered[0]:.0f} -> {undelivered[-1]:.0f}{rise}"
    if most > first:
        return Check("autoscaling", PASS, f"{unit} rose from {first:.0f} to {most:.0f} within {follow_s:.0f} s of a "
                     f"backlog of {backlog} ({waiting}): the autoscaler sees the backlog this reader leaves in Pub/Sub")
    # Counted in vCPUs (no worker gauge), the workers' number is not known, but a job launched at its ceiling is.
    at_ceiling = max_workers is not None and (first >= max_workers if workers else
                                              num_workers is not None and num_workers >= max_workers)
    if at_ceiling:
        running = f"{first:.0f} of" if workers else f"NUM_WORKERS={num_workers}, at"
        return Check("autoscaling", UNKNOWN, f"the job already runs {running} MAX_WORKERS={max_workers} workers",
                     "launch a job with MAX_WORKERS above NUM_WORKERS to see whether workers are added")
    if min(undelivered) <= 0:
        return Check("autoscaling", UNKNOWN, f"the backlog of {backlog} drained within {follow_s:.0f} s without "
                     f"another worker ({waiting})", "publish a larger backlog (BACKLOG=5000) so that it outlasts the "
                     "follow")
    if targets and max(targets) > first and workers:
        return Check("autoscaling", FAIL, f"the autoscaler asked for {max(targets):.0f} workers but the job stayed at "
                     f"{first:.0f} for {follow_s:.0f} s ({waiting}): the new workers did not start",
                     "the job's log says why: ZONE_RESOURCE_POOL_EXHAUSTED (a GPU stockout) or a quota "
                     "(docs/operations.md#quota-and-gpu-stockouts)")
    soon = (f" (followed only {follow_s:.0f} s: the autoscaler takes a few minutes; VERIFY_ARGS='--follow-seconds 900')"
            if follow_s < 300 else "")
    return Check("autoscaling", FAIL, f"the job stayed at {first:.0f} {unit} for {follow_s:.0f} s while a backlog of "
                 f"{backlog} waited in Pub/Sub ({waiting}): the autoscaler does not see this reader's backlog",
                 "size the job by hand (NUM_WORKERS, or the min_num_workers service option) and report it in an issue "
                 f"with the job's id {job.id} and this report's JSON (docs/operations.md#autoscaling-with-the-jobs-"
                 f"reader){soon}")


def follow_backlog(rest: Rest, settings: Settings, job: Job, run: str, backlog: int, follow_s: float,
                   every_s: float) -> tuple[Check, list[Sample]]:
    from google.api_core import exceptions

    subscription = settings.pubsub_path("INPUT_SUBSCRIPTION")
    try:
        publish_backlog(settings, run, backlog)
    except (exceptions.GoogleAPICallError, concurrent.futures.TimeoutError) as exc:
        return refused("autoscaling", pubsub_error(exc), job.project), []
    print(f"==> Following {subscription}'s undelivered messages, read_deferred and the job's workers for "
          f"{follow_s:.0f} s, every {every_s:.0f} s (Ctrl-C stops it; the backlog stays for the job to serve)",
          flush=True)
    samples: list[Sample] = []
    started = time.monotonic()
    try:
        while True:
            at = time.monotonic() - started
            taken = sample(rest, job, subscription, at)
            samples.append(taken)
            print("  " + "  ".join(f"{name} {'-' if value is None else f'{value:g}'}"
                                   for name, value in dataclasses.asdict(taken).items()), flush=True)
            if at >= follow_s:
                break
            time.sleep(max(0.0, min(every_s, follow_s - (time.monotonic() - started))))
    except ApiError as exc:
        return refused("autoscaling", exc, job.project), samples
    except KeyboardInterrupt:
        pass
    max_workers, num_workers = settings.get("MAX_WORKERS"), settings.get("NUM_WORKERS")
    return autoscaling_check(samples, backlog, time.monotonic() - started,
                             int(max_workers) if max_workers.isdigit() else None, job,
                             int(num_workers) if num_workers.isdigit() else None), samples


# The report -------------------------------------------------------------------------------------------------------

def print_report(checks: Sequence[Check]) -> None:
    width = max(len(check.name) for check in checks)
    print("==> Report", flush=True)
    for check in checks:
        print(f"{check.status:<8} {check.name:<{width}}  {check.detail}", flush=True)
        if check.advice:
            print(f"{'':<8} {'':<{width}}  -> {check.advice}", flush=True)


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--job-id", default=None, help="the job's id (default: the active job named JOB_NAME)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="how long to wait for the known prompts' answers")
    parser.add_argument("--settle-s", type=float, default=5.0, help="how long to wait for chunks after a completion")
    parser.add_argument("--backlog", type=int, default=0, help="publish this many requests and follow the autoscaler")
    parser.add_argument("--follow-seconds", type=float, default=600.0, help="how long to follow the backlog")
    parser.add_argument("--sample-seconds", type=float, default=60.0, help="how often to sample while following")
    parser.add_argument("--json", default=None, help="where to write the report as JSON "
                        "(default: .cache/verify/JOB_NAME-TIME.json)")
    args = parser.parse_args(argv)
    environment = dict(os.environ if environ is None else environ)
    settings = Settings(environment)
    try:
        settings.require("PROJECT", "REGION", "JOB_NAME")
        for name in ("INPUT_TOPIC", "INPUT_SUBSCRIPTION", "CHUNKS_TOPIC", "COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC"):
            settings.pubsub_path(name)  # a path of another project stops here, by name
        if not settings.pubsub_path("INPUT_TOPIC"):
            raise DeployError("Set INPUT_TOPIC (or PROJECT, which it is derived from)")
        if args.backlog < 0 or args.timeout_s <= 0 or args.follow_seconds < 0 or args.sample_seconds <= 0:
            raise DeployError("--backlog must be 0 or more, --timeout-s and --sample-seconds above 0")
    except DeployError as exc:
        print(f"make verify: {exc}", file=sys.stderr)
        return 2
    import google.auth.exceptions

    try:
        rest = Rest(environment)
    except google.auth.exceptions.DefaultCredentialsError:
        print("make verify: no Application Default Credentials: gcloud auth application-default login",
              file=sys.stderr)
        return 2
    project, region, name = settings.get("PROJECT"), settings.get("REGION"), settings.get("JOB_NAME")
    run = uuid.uuid4().hex[:8]
    started = now_utc()
    checks: list[Check] = []
    answers: list[dict[str, Any]] = []
    samples: list[Sample] = []
    job: Job | None = None
    try:
        try:
            job = find_job(rest, project, region, name, args.job_id)
            checks.append(job_check(job, name, region))
        except ApiError as exc:
            checks.append(refused("job", exc, project))
            if args.job_id:  # the logs and metrics can still be asked about the job named by its id
                job = Job(project, region, args.job_id, name, "JOB_STATE_UNKNOWN", "", "")
        print(f"==> {checks[0].status} job: {checks[0].detail}", flush=True)
        running = job is not None and job.state in ("JOB_STATE_RUNNING", "JOB_STATE_UNKNOWN")
        if running:
            found, answers = ask_known_prompts(settings, run, args.timeout_s, args.settle_s)
            checks += found
        else:
            checks += [Check(check, UNKNOWN, "not asked: no running job", "see the job line")
                       for check in ("first_chunk", "answers", "streams", "lineage")]
        if job is not None:
            checks += [driver_check(rest, job), work_items_check(rest, job), flow_control_check(rest, job)]
        else:
            checks += [Check(check, UNKNOWN, "not asked: the job's id is unknown",
                             "pass it: VERIFY_ARGS='--job-id ID' (gcloud dataflow jobs list --status active)")
                       for check in ("gpu_driver", "work_items", "flow_control")]
        if args.backlog and job is not None and running:
            check, samples = follow_backlog(rest, settings, job, run, args.backlog, args.follow_seconds,
                                            args.sample_seconds)
            checks.append(check)
        elif args.backlog:
            checks.append(Check("autoscaling", UNKNOWN, "not followed: no running job", "see the job line"))
        else:
            checks.append(Check("autoscaling", UNKNOWN, "not followed: no backlog asked for",
                                "make verify BACKLOG=3000 publishes a backlog and follows, for --follow-seconds (600), "
                                "the subscription's undelivered messages, read_deferred and the job's workers; on a "
                                "job with MAX_WORKERS above its current workers"))
    finally:
        rest.close()
    print_report(checks)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    path = Path(args.json) if args.json else Path(".cache") / "verify" / f"{name}-{stamp}.json"
    write_json(path, {"project": project, "region": region, "job": dataclasses.asdict(job) if job else None,
                      "run": run, "started_at": rfc3339(started), "finished_at": rfc3339(now_utc()),
                      "checks": [dataclasses.asdict(check) for check in checks], "answers": answers,
                      "backlog": args.backlog, "samples": [dataclasses.asdict(s) for s in samples]})
    print(f"Report written to {path}", flush=True)
    return 1 if any(check.status == FAIL for check in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
