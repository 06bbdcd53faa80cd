"""A loopback stand-in for the Google APIs ``make verify`` reads beside Pub/Sub: Dataflow's jobs, Cloud Monitoring's
time series and Cloud Logging's entries, answering as their references document them.

- Dataflow ``projects.locations.jobs.list`` (``filter`` ALL, ACTIVE or TERMINATED, a page at a time with
  ``nextPageToken``) and ``projects.locations.jobs.get`` (the ``Job`` with its ``currentState``), or NOT_FOUND
  (https://cloud.google.com/dataflow/docs/reference/rest/v1b3/projects.locations.jobs).
- Monitoring ``projects.timeSeries.list``: the ``filter`` (``metric.type``, required, ``resource.type``, and
  ``metric.labels.*`` / ``resource.labels.*`` equalities joined by AND) and ``interval.endTime`` are required; each
  ``TimeSeries`` carries ``metric``, ``resource``, ``metricKind``, ``valueType`` and its ``points``, newest first, each
  with its ``interval`` and a ``TypedValue`` (``int64Value`` as a string, or ``doubleValue``); one series a page
  (https://cloud.google.com/monitoring/api/ref_v3/rest/v3/projects.timeSeries/list). Each series is a function of the
  seconds since it was first asked, sampled when asked: one point, at the request's time, if within the interval.
- Logging ``entries:list``: ``resourceNames`` is required; the ``filter`` is read in the Logging query language's
  subset that comparisons of fields (``=``, ``!=``, ``:``, ``>=``, ``<=``, ``>``, ``<``) joined by AND and OR, with
  parentheses, make (OR binds tighter than AND, as the language says:
  https://cloud.google.com/logging/docs/view/logging-query-language), ``severity`` compared by level and
  ``timestamp`` as a time; ``orderBy`` is ``timestamp asc`` or ``timestamp desc``; at most two entries a page with a
  ``nextPageToken``, as the API may return fewer than ``pageSize``
  (https://cloud.google.com/logging/docs/reference/v2/rest/v2/entries/list).

Errors take the documented shape ``{"error": {"code", "message", "status"}}`` (https://cloud.google.com/apis/design/
errors): INVALID_ARGUMENT 400 for a request the API would refuse, NOT_FOUND 404, and PERMISSION_DENIED 403 for every
call to an API listed in ``denied``. Anything else is a 404 naming what was asked.
"""

from __future__ import annotations

import datetime
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from tests.loopback_api import LoopbackApi

ACTIVE_STATES = {"JOB_STATE_RUNNING", "JOB_STATE_PENDING", "JOB_STATE_QUEUED", "JOB_STATE_DRAINING",
                 "JOB_STATE_CANCELLING", "JOB_STATE_RESOURCE_CLEANING_UP", "JOB_STATE_STOPPED"}
SEVERITIES = {"DEFAULT": 0, "DEBUG": 100, "INFO": 200, "NOTICE": 300, "WARNING": 400, "ERROR": 500, "CRITICAL": 600,
              "ALERT": 700, "EMERGENCY": 800}
LOG_PAGE = 2  # entries a page at most
DENIED_MESSAGES = {"dataflow": "(abc): Permission 'dataflow.jobs.list' denied on project: '{project}'",
                   "monitoring": "Permission monitoring.timeSeries.list denied (or the resource may not exist).",
                   "logging": "The caller does not have permission"}


def error(code: int, status: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"error": {"code": code, "message": message, "status": status}}


def rfc3339(moment: float) -> str:
    return datetime.datetime.fromtimestamp(moment, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass
class Series:
    """One time series: what it is, and its value as a function of the seconds since it was first asked (None: no
    point yet)."""

    metric_type: str
    resource_type: str
    metric_labels: dict[str, str]
    resource_labels: dict[str, str]
    value: Callable[[float], float | None]
    value_type: str = "INT64"
    first_asked: float | None = None

    def labels(self, prefix: str) -> dict[str, str]:
        return self.metric_labels if prefix == "metric" else self.resource_labels


@dataclass
class ObservabilityStandIn:
    """Holds jobs, time series and log entries of one project; ``env()`` points ``ops.verify`` (and gcloud) at it."""

    project: str
    jobs: list[dict[str, Any]] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    denied: set[str] = field(default_factory=set)  # "dataflow", "monitoring", "logging": every call refused
    requests: list[tuple[str, str, Any]] = field(default_factory=list)  # (api, path with query, body)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.api = LoopbackApi(self.answer)

    def env(self) -> dict[str, str]:
        return {"CLOUDSDK_AUTH_DISABLE_CREDENTIALS": "true",
                **{f"CLOUDSDK_API_ENDPOINT_OVERRIDES_{api}": self.api.url + "/"
                   for api in ("DATAFLOW", "MONITORING", "LOGGING")}}

    def close(self) -> None:
        self.api.close()

    # What the test puts in ------------------------------------------------------------------------------------------

    def add_job(self, job_id: str, name: str, region: str, state: str = "JOB_STATE_RUNNING",
                age_s: float = 3600.0) -> dict[str, Any]:
        created = time.time() - age_s
        job = {"id": job_id, "projectId": self.project, "name": name, "type": "JOB_TYPE_STREAMING",
               "currentState": state, "currentStateTime": rfc3339(created + 60), "createTime": rfc3339(created),
               "startTime": rfc3339(created), "location": region}
        self.jobs.append(job)
        return job

    def gauge(self, metric_type: str, resource_type: str, metric_labels: dict[str, str],
              resource_labels: dict[str, str], value: Callable[[float], float | None],
              value_type: str = "INT64") -> None:
        self.series.append(Series(metric_type, resource_type, metric_labels, resource_labels, value, value_type))

    def log(self, log_id: str, job_id: str, job_name: str, region: str, *, text: str | None = None,
            message: str | None = None, severity: str = "INFO", age_s: float = 600.0) -> None:
        """A log entry of a Dataflow job's step: ``text`` as ``textPayload`` or ``message`` in ``jsonPayload``."""
        entry: dict[str, Any] = {
            "logName": f"projects/{self.project}/logs/{log_id.replace('/', '%2F')}",
            "resource": {"type": "dataflow_step", "labels": {"job_id": job_id, "job_name": job_name,
                                                             "project_id": self.project, "region": region,
                                                             "step_id": ""}},
            "timestamp": rfc3339(time.time() - age_s), "receiveTimestamp": rfc3339(time.time() - age_s + 1),
            "severity": severity, "insertId": f"stand-in-{len(self.entries)}"}
        if text is not None:
            entry["textPayload"] = text
        else:
            entry["jsonPayload"] = {"message": message, "logger": "pipeline.serving.vllm_server", "thread": "1"}
        self.entries.append(entry)

    # What the APIs answer -------------------------------------------------------------------------------------------

    def answer(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any]:
        parts = urlsplit(path)
        query = {key: values[-1] for key, values in parse_qs(parts.query, keep_blank_values=True).items()}
        api = ("dataflow" if parts.path.startswith("/v1b3/") else "monitoring" if parts.path.startswith("/v3/")
               else "logging" if parts.path.startswith("/v2/") else "")
        with self._lock:
            self.requests.append((api, path, json.loads(body) if body else None))
        if api in self.denied:
            return error(403, "PERMISSION_DENIED", DENIED_MESSAGES[api].format(project=self.project))
        if api == "dataflow" and method == "GET":
            return self.dataflow(parts.path, query)
        if api == "monitoring" and method == "GET":
            return self.time_series(parts.path, query)
        if api == "logging" and method == "POST" and parts.path == "/v2/entries:list":
            return self.list_entries(json.loads(body or b"{}"))
        return error(404, "NOT_FOUND", f"the stand-in does not answer {method} {parts.path}")

    def dataflow(self, path: str, query: dict[str, str]) -> tuple[int, Any]:
        listing = re.fullmatch(r"/v1b3/projects/([^/]+)/locations/([^/]+)/jobs", path)
        one = re.fullmatch(r"/v1b3/projects/([^/]+)/locations/([^/]+)/jobs/([^/:]+)", path)
        if listing:
            project, region = listing.groups()
            wanted = query.get("filter", "UNKNOWN")
            # The REST reference's enum names; the generated clients send their numbers (ListJobsRequest.Filter).
            wanted = {"0": "UNKNOWN", "1": "ALL", "2": "TERMINATED", "3": "ACTIVE"}.get(wanted, wanted)
            if wanted not in ("UNKNOWN", "ALL", "TERMINATED", "ACTIVE"):
                return error(400, "INVALID_ARGUMENT", f"Invalid value at 'filter' (type.googleapis.com/google.dataflow"
                                                      f".v1beta3.ListJobsRequest.Filter), \"{wanted}\"")
            jobs = [job for job in self.jobs if job["projectId"] == project and job["location"] == region and (
                wanted in ("UNKNOWN", "ALL") or (job["currentState"] in ACTIVE_STATES) == (wanted == "ACTIVE"))]
            start = query.get("pageToken") or "0"
            if not start.isdigit() or int(start) > len(jobs):
                return error(400, "INVALID_ARGUMENT", "Invalid page token")
            page: dict[str, Any] = {"jobs": jobs[int(start):int(start) + 1]}
            if int(start) + 1 < len(jobs):
                page["nextPageToken"] = str(int(start) + 1)
            return 200, page
        if one:
            project, region, job_id = one.groups()
            for job in self.jobs:
                if job["id"] == job_id and job["projectId"] == project and job["location"] == region:
                    return 200, job
            return error(404, "NOT_FOUND", f"(1b2c3d): Information about job {job_id} could not be found in our "
                                           f"system. Please double check that the API being used is projects.locations"
                                           f".jobs.get (https://cloud.google.com/dataflow/docs/reference/rest/v1b3/"
                                           f"projects.locations.jobs/get). If the API being used is projects.locations"
                                           f".jobs.get, please double check the id {job_id} is correct.")
        return error(404, "NOT_FOUND", f"the stand-in does not answer GET {path}")

    def time_series(self, path: str, query: dict[str, str]) -> tuple[int, Any]:
        found = re.fullmatch(r"/v3/projects/([^/]+)/timeSeries", path)
        if not found:
            return error(404, "NOT_FOUND", f"the stand-in does not answer GET {path}")
        if found.group(1) != self.project:
            return error(403, "PERMISSION_DENIED", DENIED_MESSAGES["monitoring"])
        if "filter" not in query or "interval.endTime" not in query:
            return error(400, "INVALID_ARGUMENT", "Field filter and interval.endTime must be given")
        terms = re.findall(r'\s*(metric\.type|resource\.type|(?:metric|resource)\.labels?\.[a-z_]+)\s*=\s*"([^"]*)"'
                           r'\s*(?:AND|$)', query["filter"])
        rebuilt = " AND ".join(f'{name}="{value}"' for name, value in terms)
        if re.sub(r"\s+", "", rebuilt) != re.sub(r"\s+", "", query["filter"]):
            return error(400, "INVALID_ARGUMENT", f"Could not parse filter \"{query['filter']}\"")
        wanted = dict(terms)
        if "metric.type" not in wanted:
            return error(400, "INVALID_ARGUMENT", "A filter must specify a metric type")
        end = parse_time(query["interval.endTime"])
        start = parse_time(query.get("interval.startTime") or query["interval.endTime"])
        now = time.time()
        matching = []
        for series in self.series:
            if series.metric_type != wanted["metric.type"] or (
                    "resource.type" in wanted and series.resource_type != wanted["resource.type"]):
                continue
            if any(series.labels(name.split(".", 1)[0]).get(name.rsplit(".", 1)[1]) != value
                   for name, value in wanted.items() if ".label" in name):
                continue
            if series.first_asked is None:
                series.first_asked = now
            value = series.value(now - series.first_asked)
            moment = datetime.datetime.fromtimestamp(now, datetime.timezone.utc)
            if value is None or not start <= moment <= end + datetime.timedelta(seconds=5):
                continue
            typed = {"int64Value": str(int(value))} if series.value_type == "INT64" else {"doubleValue": float(value)}
            matching.append({"metric": {"type": series.metric_type, "labels": series.metric_labels},
                             "resource": {"type": series.resource_type, "labels": series.resource_labels},
                             "metricKind": "GAUGE", "valueType": series.value_type,
                             "points": [{"interval": {"startTime": rfc3339(now), "endTime": rfc3339(now)},
                                         "value": typed}]})
        index = query.get("pageToken") or "0"
        if not index.isdigit() or int(index) > len(matching):
            return error(400, "INVALID_ARGUMENT", "Invalid page token")
        page: dict[str, Any] = {"timeSeries": matching[int(index):int(index) + 1]} if matching else {}
        if int(index) + 1 < len(matching):
            page["nextPageToken"] = str(int(index) + 1)
        return 200, page

    def list_entries(self, body: dict[str, Any]) -> tuple[int, Any]:
        names = body.get("resourceNames")
        if not names:
            return error(400, "INVALID_ARGUMENT", "resourceNames: must be specified")
        if any(name != f"projects/{self.project}" for name in names):
            return error(403, "PERMISSION_DENIED", DENIED_MESSAGES["logging"])
        order = body.get("orderBy", "timestamp asc")
        if order not in ("timestamp asc", "timestamp desc"):
            return error(400, "INVALID_ARGUMENT", f"Invalid orderBy: {order}")
        size = body.get("pageSize", 50)
        if not isinstance(size, int) or size < 0 or size > 1000:
            return error(400, "INVALID_ARGUMENT", "pageSize must be between 0 and 1000")
        try:
            test = LogFilter(body.get("filter") or "").matches
        except ValueError as exc:
            return error(400, "INVALID_ARGUMENT", f"Unparseable filter: {exc}")
        chosen = sorted((entry for entry in self.entries if test(entry)), key=lambda e: e["timestamp"],
                        reverse=order == "timestamp desc")
        token = body.get("pageToken") or "0"
        if not token.isdigit() or int(token) > len(chosen):
            return error(400, "INVALID_ARGUMENT", "Invalid page token")
        start = int(token)
        end = start + min(size or 50, LOG_PAGE)
        page: dict[str, Any] = {"entries": chosen[start:end]} if chosen[start:end] else {}
        if end < len(chosen):
            page["nextPageToken"] = str(end)
        return 200, page


TOKEN = re.compile(r'\s*(?:(?P<open>\()|(?P<close>\))|(?P<word>AND|OR)\b|(?P<field>[A-Za-z_][\w.]*)\s*'
                   r'(?P<op>>=|<=|!=|=|:|>|<)\s*(?P<value>"(?:[^"\\]|\\.)*"|[^\s()"]+))')


class LogFilter:
    """A Logging filter in the subset the stand-in reads: ``a AND (b OR c)``, adjacent terms ANDed."""

    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, Any]] = []
        position = 0
        while text[position:].strip():
            found = TOKEN.match(text, position)
            if not found:
                raise ValueError(f"at {text[position:position + 30]!r}")
            position = found.end()
            kind = next(name for name in ("open", "close", "word", "field") if found.group(name))
            self.tokens.append((kind, found.group(kind) if kind != "field" else (
                found.group("field"), found.group("op"), json.loads(found.group("value"))
                if found.group("value").startswith('"') else found.group("value"))))
        self.at = 0
        self.tree = self.conjunction() if self.tokens else ("and", [])
        if self.at != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.at]}")

    def conjunction(self) -> Any:
        parts = [self.disjunction()]
        while self.at < len(self.tokens) and self.tokens[self.at] != ("close", ")"):
            if self.tokens[self.at] == ("word", "AND"):
                self.at += 1
            parts.append(self.disjunction())
        return ("and", parts)

    def disjunction(self) -> Any:
        parts = [self.atom()]
        while self.at < len(self.tokens) and self.tokens[self.at] == ("word", "OR"):
            self.at += 1
            parts.append(self.atom())
        return ("or", parts)

    def atom(self) -> Any:
        if self.at >= len(self.tokens):
            raise ValueError("the filter ends early")
        kind, value = self.tokens[self.at]
        self.at += 1
        if kind == "open":
            inner = self.conjunction()
            if self.at >= len(self.tokens) or self.tokens[self.at][0] != "close":
                raise ValueError("a parenthesis is not closed")
            self.at += 1
            return inner
        if kind != "field":
            raise ValueError(f"unexpected {value}")
        return ("term", value)

    def matches(self, entry: dict[str, Any]) -> bool:
        return self._eval(self.tree, entry)

    def _eval(self, node: Any, entry: dict[str, Any]) -> bool:
        kind, content = node
        if kind == "and":
            return all(self._eval(part, entry) for part in content)
        if kind == "or":
            return any(self._eval(part, entry) for part in content)
        name, op, wanted = content
        found: Any = entry
        for part in name.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if found is None:
            return op == "!="
        have: Any
        want: Any
        if name == "severity":
            have, want = SEVERITIES.get(str(found), 0), SEVERITIES.get(str(wanted).upper(), -1)
        elif name in ("timestamp", "receiveTimestamp"):
            have, want = parse_time(str(found)), parse_time(str(wanted))
        else:
            have, want = str(found), str(wanted)
        if op == ":":
            return str(want).lower() in str(have).lower()
        return {"=": have == want, "!=": have != want, ">=": have >= want, "<=": have <= want, ">": have > want,
                "<": have < want}[op]
