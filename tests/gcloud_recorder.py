"""A loopback stand-in for the Google Cloud APIs that the deploy targets call, so the real gcloud runs offline.

gcloud reads API endpoint overrides from its configuration (``CLOUDSDK_API_ENDPOINT_OVERRIDES_<API>``), and
``CLOUDSDK_AUTH_DISABLE_CREDENTIALS=true`` sends no credentials: the CLI's own argument parsing, flags files
and request building all run, and what it sends lands here. The answers are the smallest that gcloud
accepts: a job for Dataflow's launch and update calls, an object with the uploaded bytes' hashes for Cloud
Storage (gcloud compares them with the file it sent), a build operation for Cloud Build, for Cloud
Monitoring the dashboard or alert policy it was sent, named, and for IAM the account it was asked to create and an
empty policy that a grant reads and writes back (``not_yet`` grants are first refused as IAM refuses a grant for an
account it does not know yet).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from urllib.parse import quote, unquote
from dataclasses import dataclass
from typing import Any

import google_crc32c

from tests.loopback_api import LoopbackApi


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Recorder:
    """Records every request; ``env()`` points gcloud at it with a throwaway configuration folder."""

    def __init__(self, config_dir: str) -> None:
        self.config_dir = config_dir
        self.requests: list[Request] = []
        self.objects: dict[str, bytes] = {}  # "bucket/name" -> uploaded bytes
        self.jobs: list[dict[str, Any]] = []  # what a job listing answers
        self.made: list[dict[str, Any]] = []  # dashboards and alert policies created, as created or updated
        self.not_yet = 0  # how many policy writes to refuse first, as for an account IAM does not know yet
        self.missing: set[str] = set()  # API paths of topics, subscriptions and accounts that do not exist
        self.api = LoopbackApi(self.record)

    @property
    def url(self) -> str:
        return self.api.url + "/"

    def record(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any]:
        request = Request(method, path, body)
        self.requests.append(request)
        return self.answer(request, headers.get("Content-Type", ""))

    def env(self) -> dict[str, str]:
        return {"CLOUDSDK_CONFIG": self.config_dir, "CLOUDSDK_AUTH_DISABLE_CREDENTIALS": "true",
                "CLOUDSDK_CORE_DISABLE_PROMPTS": "1", "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true",
                "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true",
                **{f"CLOUDSDK_API_ENDPOINT_OVERRIDES_{api}": self.url
                   for api in ("DATAFLOW", "STORAGE", "CLOUDBUILD", "MONITORING", "SERVICEUSAGE", "PUBSUB",
                               "ARTIFACTREGISTRY", "CLOUDRESOURCEMANAGER", "IAM", "SECRETMANAGER")}}

    def close(self) -> None:
        self.api.close()

    def find(self, method: str, pattern: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and re.search(pattern, r.path.split("?")[0])]

    def grants(self) -> list[tuple[str, str, str]]:
        """Every (resource path, role, member) a policy write added, in order (a Cloud Storage bucket's as
        ``/storage/v1/b/BUCKET``)."""
        found = []
        for request in self.requests:
            path = request.path.split("?")[0]
            if path.endswith(":setIamPolicy") or (path.endswith("/iam") and request.method == "PUT"):
                policy = request.json().get("policy", request.json())
                resource = path.removesuffix(":setIamPolicy").removesuffix("/iam")
                found += [(resource, b["role"], m) for b in policy.get("bindings", []) for m in b["members"]]
        return found

    def answer(self, request: Request, content_type: str) -> tuple[int, Any]:
        path = request.path.split("?")[0]
        if path.endswith(":setIamPolicy") or (path.endswith("/iam") and request.method == "PUT"):
            if self.not_yet > 0:
                self.not_yet -= 1
                member = next((m for b in request.json().get("policy", request.json()).get("bindings", [])
                               for m in b["members"]), "the account")
                return 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT",
                                       "message": f"Service account {member.split(':')[-1]} does not exist."}}
            return 200, request.json().get("policy", request.json())
        if path.endswith(":getIamPolicy") or (path.endswith("/iam") and request.method == "GET"):
            return 200, {"etag": "BwYAAAAAAAA=", "version": 1, "bindings": []}
        if re.match(r"^/v1/projects/[^/]+/(topics|subscriptions|serviceAccounts)/[^/:]+$", path) \
                and request.method == "GET":  # a describe: there, unless the test says it is missing
            if unquote(path) in self.missing:
                return 404, {"error": {"code": 404, "status": "NOT_FOUND", "message": "Resource not found"}}
            return 200, {"name": unquote(path).removeprefix("/v1/"), "email": unquote(path).rsplit("/", 1)[1]}
        account = re.match(r"^/v1/projects/([^/]+)/serviceAccounts$", path)
        if account and request.method == "POST":
            email = f"{request.json()['accountId']}@{account.group(1)}.iam.gserviceaccount.com"
            return 200, {"name": f"projects/{account.group(1)}/serviceAccounts/{email}", "email": email,
                         "projectId": account.group(1), "uniqueId": "1"}
        job = {"id": "2026-11-25_00_00_00-1", "projectId": "recorded", "name": "recorded",
               "currentState": "JOB_STATE_QUEUED"}
        if path.endswith("/flexTemplates:launch"):
            launch = request.json()["launchParameter"]
            return 200, {"job": {**job, "name": launch["jobName"]}}
        if "/v1b3/" in path and "/jobs/" in path:
            return 200, job
        if re.match(r"^/v1b3/projects/[^/]+/locations/[^/]+/jobs$", path) and request.method == "GET":
            return 200, {"jobs": self.jobs}
        upload = re.match(r"^/upload/storage/v1/b/([^/]+)/o$", path)
        if upload and request.method == "POST":
            return 200, self.store(upload.group(1), request, content_type)
        stored = re.match(r"^/(?:download/)?storage/v1/b/([^/]+)/o/([^/]+)$", path)
        if stored and request.method == "GET" and f"{stored.group(1)}/{unquote(stored.group(2))}" in self.objects:
            key = f"{stored.group(1)}/{unquote(stored.group(2))}"
            if "alt=media" in request.path:
                return 200, self.objects[key]
            return 200, self.object_metadata(stored.group(1), unquote(stored.group(2)), self.objects[key])
        if re.match(r"^/storage/v1/b/[^/]+$", path):
            return 200, {"name": path.rsplit("/", 1)[1], "location": "US"}
        listing = re.search(r"[?&]prefix=([^&]+)", request.path)
        if path == "/storage/v1/b" and listing:  # the buckets gcloud builds submit looks for in the project
            return 200, {"items": [{"name": unquote(listing.group(1)), "location": "US"}]}
        if re.search(r"/v1/projects/[^/]+/(locations/[^/]+/)?builds/recorded$", path):  # gcloud waits for the build
            return 200, {"id": "recorded", "projectId": "recorded", "status": "SUCCESS", "logsBucket": "gs://recorded-logs"}
        build = re.search(r"/v1/projects/([^/]+)/(?:locations/([^/]+)/)?builds$", path)
        if build:
            return 200, {"name": "operations/build/recorded", "metadata": {
                "@type": "type.googleapis.com/google.devtools.cloudbuild.v1.BuildOperationMetadata",
                "build": {"id": "recorded", "projectId": build.group(1), "status": "QUEUED",
                          "name": f"projects/{build.group(1)}/locations/{build.group(2) or 'global'}/builds/recorded"}}}
        made = re.match(r"^/v[13]/projects/([^/]+)/(dashboards|alertPolicies)$", path)
        if made and request.method == "POST":  # kept, so that a listing finds it
            kept = {**request.json(), "name": f"projects/{made.group(1)}/{made.group(2)}/recorded-{len(self.made)}"}
            self.made.append(kept)
            return 200, kept
        if made and request.method == "GET":
            key = "dashboards" if made.group(2) == "dashboards" else "alertPolicies"
            return 200, {key: [m for m in self.made if f"/{made.group(2)}/" in m["name"]]}
        one = re.match(r"^/v[13]/(projects/[^/]+/(?:dashboards|alertPolicies)/[^/]+)$", path)
        if one and request.method == "PATCH":
            kept = next(m for m in self.made if m["name"] == one.group(1))
            kept.update({**request.json(), "name": one.group(1)})
            return 200, kept
        return 404, {"error": {"code": 404, "message": f"the recorder does not answer {request.method} {path}"}}

    def store(self, bucket: str, request: Request, content_type: str) -> dict[str, Any]:
        """A multipart upload: the object's metadata part, then its bytes; answered with the bytes' hashes."""
        boundary = re.search(r"""boundary=["']?([^"';]+)""", content_type).group(1).encode()
        parts = [part for part in request.body.split(b"--" + boundary) if part.strip() not in (b"", b"--")]
        (_, metadata), (_, data) = (re.split(rb"\r?\n\r?\n", part.lstrip(b"\r\n"), maxsplit=1) for part in parts[:2])
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
        name = re.search(r"[?&]name=([^&]+)", request.path)
        object_name = json.loads(metadata or b"{}").get("name") or (name and unquote(name.group(1)))
        self.objects[f"{bucket}/{object_name}"] = data
        return self.object_metadata(bucket, object_name, data)

    def object_metadata(self, bucket: str, name: str, data: bytes) -> dict[str, Any]:
        return {"bucket": bucket, "name": name, "size": str(len(data)),
                "mediaLink": f"{self.url}download/storage/v1/b/{bucket}/o/{quote(name, safe='')}?alt=media",
                "md5Hash": base64.b64encode(hashlib.md5(data).digest()).decode(),
                "crc32c": base64.b64encode(google_crc32c.Checksum(data).digest()).decode(),
                "generation": "1", "contentType": "application/json"}

