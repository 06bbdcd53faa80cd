"""A loopback stand-in for the Google Cloud APIs that the deploy targets call, so the real gcloud runs offline.

gcloud reads API endpoint overrides from its configuration (``CLOUDSDK_API_ENDPOINT_OVERRIDES_<API>``), and
``CLOUDSDK_AUTH_DISABLE_CREDENTIALS=true`` sends no credentials: the CLI's own argument parsing, flags files
and request building all run, and what it sends lands here. The answers are the smallest that gcloud
accepts: a job for Dataflow's launch and update calls, an object with the uploaded bytes' hashes for Cloud
Storage (gcloud compares them with the file it sent), a build operation for Cloud Build, for Cloud
Monitoring the dashboard or alert policy it was sent, named.

What ``make setup`` creates is answered as each service documents it, not with 200 to everything: the recorder keeps
what was made, so a second create of a topic, subscription, repository or service account is refused with 409
``ALREADY_EXISTS`` (Pub/Sub's, Artifact Registry's and IAM's reference pages), a bucket its caller owns with Cloud
Storage's own 409 ("Your previous request to create the named bucket succeeded and you already own it.", as gcloud
528 prints it) and a bucket another project holds with 409 "not available" (Cloud Storage's bucket naming page), a
subscription of a topic that does not exist with 404 ``NOT_FOUND``; a grant to an account that does not exist is
refused as IAM refuses it (400, "Service account ... does not exist."), and so, ``propagation`` times each, is a
grant to an account just created (IAM's eventual consistency: https://cloud.google.com/iam/docs/access-change-propagation);
requests a test lists in ``denied`` get 403 ``PERMISSION_DENIED``, and the ``enabling`` calls after an API is
enabled get its 403 ``SERVICE_DISABLED`` (https://cloud.google.com/apis/design/errors). Policies are kept and read
back, so a rerun's grants find the earlier ones; a conditional grant on a bucket without uniform bucket-level access
is refused, as IAM Conditions need it (https://cloud.google.com/storage/docs/access-control/iam#conditions).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

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
        self.missing: set[str] = set()  # API paths of topics, subscriptions and accounts a describe does not find
        self.made_resources: set[str] = set()  # what creates made: API paths (a bucket as /storage/v1/b/NAME)
        self.taken_buckets: set[str] = set()  # bucket names another project holds
        self.accounts: set[str] = set()  # emails of service accounts that exist (made here, or said to exist)
        self.propagation = 0  # how many policy writes naming a just-made account IAM refuses first, for each
        self.unknown: dict[str, int] = {}  # email -> policy writes still to refuse
        self.denied: list[str] = []  # regexes over "METHOD /path": answered 403 PERMISSION_DENIED
        self.policies: dict[str, dict[str, Any]] = {}  # resource path -> its IAM policy as last written
        self.repositories: dict[str, dict[str, Any]] = {}  # API path -> an image repository made
        self.subscriptions: dict[str, dict[str, Any]] = {}  # API path -> a subscription as made
        self.project_number = "123456789012"  # what Resource Manager answers for the project's number
        self.buckets: dict[str, dict[str, Any]] = {}  # name -> a bucket made (or said to exist), as last written
        self.enabling = 0  # how many calls after services:batchEnable the just-enabled APIs refuse, as not yet on
        self.enabling_left = 0
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
        if self.enabling_left > 0 and not path.endswith(":batchEnable"):  # an API switched on, not yet serving
            self.enabling_left -= 1
            return 403, {"error": {"code": 403, "status": "PERMISSION_DENIED", "message": "The API has not been used "
                                   "in project proj-123456 before or it is disabled. If you enabled this API recently, "
                                   "wait a few minutes for the action to propagate to our systems and retry.",
                                   "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                                                "reason": "SERVICE_DISABLED"}]}}
        if any(re.search(pattern, f"{request.method} {unquote(path)}") for pattern in self.denied):
            # Pub/Sub's message for it, and the one most Google APIs give.
            message = "User not authorized to perform this action." if re.match(r"^/v1/projects/[^/]+/(topics|sub" \
                r"scriptions)/", path) else "The caller does not have permission"
            return 403, {"error": {"code": 403, "status": "PERMISSION_DENIED", "message": message}}
        if made := self.create(request, path):
            return made
        if path.endswith(":setIamPolicy") or (path.endswith("/iam") and request.method == "PUT"):
            policy = request.json().get("policy", request.json())
            for member in (m for b in policy.get("bindings", []) for m in b["members"]):
                email = member.split(":", 1)[-1]
                if member.startswith("serviceAccount:") and (email not in self.accounts or self.unknown.get(email)):
                    if self.unknown.get(email):
                        self.unknown[email] -= 1
                    return 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT",
                                           "message": f"Service account {email} does not exist."}}
            resource = path.removesuffix(":setIamPolicy").removesuffix("/iam")
            bucket = self.buckets.get(resource.removeprefix("/storage/v1/b/"), {})
            uniform = bucket.get("iamConfiguration", {}).get("uniformBucketLevelAccess", {}).get("enabled")
            if resource.startswith("/storage/v1/b/") and not uniform \
                    and any(b.get("condition") for b in policy.get("bindings", [])):
                # IAM Conditions on a bucket need uniform bucket-level access (Cloud Storage's IAM page).
                return 400, {"error": {"code": 400, "message": "IAM conditions need uniform bucket-level access "
                                       "enabled on the bucket.", "errors": [{"reason": "invalid"}]}}
            self.policies[resource] = {**policy, "etag": "BwYAAAAAAAE="}
            return 200, self.policies[resource]
        if path.endswith(":getIamPolicy") or (path.endswith("/iam") and request.method == "GET"):
            resource = path.removesuffix(":getIamPolicy").removesuffix("/iam")
            return 200, self.policies.get(resource, {"etag": "BwYAAAAAAAA=", "version": 1, "bindings": []})
        if re.match(r"^/v1/projects/[^/]+/subscriptions/[^/:]+$", path) and request.method == "DELETE":
            if unquote(path) not in self.made_resources:
                return 404, {"error": {"code": 404, "status": "NOT_FOUND", "message": "Resource not found "
                                       f"(resource={path.rsplit('/', 1)[1]})."}}
            self.made_resources.discard(unquote(path))
            self.subscriptions.pop(unquote(path), None)
            return 200, {}
        if re.match(r"^/v1/projects/[^/]+/(topics|subscriptions|serviceAccounts)/[^/:]+$", path) \
                and request.method == "GET":  # a describe: there, unless the test says it is missing
            if unquote(path) in self.missing:
                return 404, {"error": {"code": 404, "status": "NOT_FOUND", "message": "Resource not found"}}
            return 200, {"name": unquote(path).removeprefix("/v1/"), "email": unquote(path).rsplit("/", 1)[1],
                         **self.subscriptions.get(unquote(path), {})}
        project = re.match(r"^/v[13]/projects/([^/:]+)$", path)
        if project and request.method == "GET":  # Resource Manager's describe
            return 200, {"projectId": project.group(1), "projectNumber": self.project_number,
                         "name": f"projects/{self.project_number}", "lifecycleState": "ACTIVE"}
        if re.match(r"^/v1/projects/[^/]+/subscriptions/[^/:]+$", path) and request.method == "PATCH":
            if unquote(path) not in self.made_resources:
                return 404, {"error": {"code": 404, "status": "NOT_FOUND",
                                       "message": f"Resource not found (resource={path.rsplit('/', 1)[1]})."}}
            return 200, {**request.json().get("subscription", {}), "name": unquote(path).removeprefix("/v1/")}
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
        bucket = re.match(r"^/storage/v1/b/([^/]+)$", path)
        if bucket and request.method == "PATCH" and bucket.group(1) in self.buckets:
            self.buckets[bucket.group(1)].update(request.json())
            return 200, self.buckets[bucket.group(1)]
        if bucket:
            return 200, self.buckets.get(bucket.group(1), {"name": bucket.group(1), "location": "US"})
        listing = re.search(r"[?&]prefix=([^&]+)", request.path)
        if path == "/storage/v1/b" and listing:  # the buckets gcloud builds submit looks for in the project
            return 200, {"items": [{"name": unquote(listing.group(1)), "location": "US"}]}
        if re.search(r"/v1/projects/[^/]+/(locations/[^/]+/)?builds/recorded$", path):  # gcloud waits for the build
            return 200, {"id": "recorded", "projectId": "recorded", "status": "SUCCESS", "logsBucket": "gs://recorded-logs"}
        build = re.search(r"/v1/projects/([^/]+)/(?:locations/([^/]+)/)?builds$", path)
        if build and request.method == "POST":
            body = request.json()
            if body.get("serviceAccount") and not body.get("logsBucket") and (body.get("options") or {}).get(
                    "logging") not in ("CLOUD_LOGGING_ONLY", "NONE"):
                return 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": (
                    "generic::invalid_argument: if 'build.service_account' is specified, the build must either (a) "
                    "specify 'build.logs_bucket', (b) use the REGIONAL_USER_OWNED_BUCKET "
                    "build.options.default_logs_bucket_behavior option, or (c) use either CLOUD_LOGGING_ONLY / NONE "
                    "logging options")}}
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

    def create(self, request: Request, path: str) -> tuple[int, Any] | None:
        """The answer to one of make setup's creates (see the module docstring), or None for any other request."""
        exists = {"code": 409, "status": "ALREADY_EXISTS"}
        if request.method == "POST" and re.match(r"^/v1/projects/[^/]+/services:batchEnable$", path):
            self.enabling_left = self.enabling
            return 200, {"name": "operations/acat.recorded", "done": True, "response": {
                "@type": "type.googleapis.com/google.api.serviceusage.v1.BatchEnableServicesResponse", "services": []}}
        if request.method == "POST" and path == "/storage/v1/b":
            name = request.json()["name"]
            if name in self.taken_buckets:
                return 409, {"error": {"code": 409, "message": "The requested bucket name is not available. The "
                                       "bucket namespace is shared by all users of the system. Please select a "
                                       "different name and try again.", "errors": [{"reason": "conflict"}]}}
            if f"/storage/v1/b/{name}" in self.made_resources:
                return 409, {"error": {"code": 409, "message": "Your previous request to create the named bucket "
                                       "succeeded and you already own it.", "errors": [{"reason": "conflict"}]}}
            self.made_resources.add(f"/storage/v1/b/{name}")
            self.buckets[name] = {**request.json(), "kind": "storage#bucket", "id": name}
            return 200, self.buckets[name]
        repository = re.search(r"[?&]repositoryId=([^&]+)", request.path)
        if request.method == "POST" and repository \
                and re.match(r"^/v1/projects/[^/]+/locations/[^/]+/repositories$", path):
            made = f"{path}/{repository.group(1)}"
            if made in self.made_resources:
                return 409, {"error": {**exists, "message": "the repository already exists"}}
            self.made_resources.add(made)
            self.repositories[made] = {**request.json(), "name": made.removeprefix("/v1/")}
            return 200, {"name": "projects/recorded/locations/recorded/operations/recorded", "done": True,
                         "response": {**request.json(),
                                      "@type": "type.googleapis.com/google.devtools.artifactregistry.v1.Repository"}}
        if request.method == "GET" and path in self.repositories:  # gcloud reads the repository it made back
            return 200, self.repositories[path]
        if request.method == "PATCH" and path in self.repositories:
            self.repositories[path].update(request.json())
            return 200, self.repositories[path]
        pubsub = re.match(r"^/v1/projects/([^/]+)/(topics|subscriptions)/([^/:]+)$", path)
        if request.method == "PUT" and pubsub:
            name = unquote(path)
            if name in self.made_resources:
                return 409, {"error": {**exists, "message": "Resource already exists in the project "
                                       f"(resource={pubsub.group(3)})."}}
            topic = request.json().get("topic") or ""
            if pubsub.group(2) == "subscriptions" and f"/v1/{topic}" not in self.made_resources:
                return 404, {"error": {"code": 404, "status": "NOT_FOUND",
                                       "message": f"Resource not found (resource={topic.rsplit('/', 1)[-1]})."}}
            self.made_resources.add(name)
            if pubsub.group(2) == "subscriptions":
                self.subscriptions[name] = request.json()
            return 200, {**request.json(), "name": name.removeprefix("/v1/")}
        account = re.match(r"^/v1/projects/([^/]+)/serviceAccounts$", path)
        if request.method == "POST" and account:
            account_id = request.json()["accountId"]
            email = f"{account_id}@{account.group(1)}.iam.gserviceaccount.com"
            if email in self.accounts:
                return 409, {"error": {**exists, "message": f"Service account {account_id} already exists within "
                                       f"project projects/{account.group(1)}."}}
            self.accounts.add(email)
            self.unknown[email] = self.propagation
            return 200, {"name": f"projects/{account.group(1)}/serviceAccounts/{email}", "email": email,
                         "projectId": account.group(1), "uniqueId": "1"}
        return None


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

