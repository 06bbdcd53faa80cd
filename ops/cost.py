"""What a launch can cost an hour, before it is launched: ``MAX_WORKERS`` GPU workers at Dataflow's list prices.

Why: a streaming job bills its workers for as long as it runs, busy or idle, and the GPU makes each worker-hour
dear; ``MAX_WORKERS`` is the only cap. So ``make run`` (and ``make update``) prints the most the job's workers can
cost an hour, from the prices Google publishes for the job's region at launch time, and with ``MAX_HOURLY_COST`` set
asks before launching above it. A ceiling that cannot be priced never stops a launch: it says why and goes on.

Where the prices come from: the Cloud Billing Catalog API (https://cloud.google.com/billing/v1/how-tos/catalog-api).

* ``GET https://cloudbilling.googleapis.com/v1/services`` lists the services, ``{"services": [{"name", "serviceId",
  "displayName"}], "nextPageToken"}``; Dataflow's id is found there by its display name (no page states it).
* ``GET .../v1/services/SERVICE_ID/skus`` lists its SKUs, ``{"skus": [Sku], "nextPageToken"}``, 5,000 a page by
  default; a Sku is ``{"description", "category": {"resourceFamily", "resourceGroup", "usageType"},
  "serviceRegions": [...], "pricingInfo": [{"pricingExpression": {"usageUnit", "tieredRates": [{"startUsageAmount",
  "unitPrice": {"currencyCode", "units", "nanos"}}]}}]}`` (the API's reference as Google's Python client renders it,
  https://github.com/googleapis/google-api-python-client/blob/main/docs/dyn/cloudbilling_v1.services.skus.html).
  ``pricingInfo`` is "a timeline ... in chronological order": its last entry is today's price. ``unitPrice`` is a
  ``google.type.Money``: ``units`` + ``nanos`` × 10⁻⁹.
* The API takes an API key (the how-to's way) or OAuth credentials (scope ``cloud-billing.readonly``); this module
  uses Application Default Credentials (``gcloud auth application-default login``) through google-auth, with
  ``PROJECT`` as the quota project unless the credentials name one. gcloud's own override for this API
  (``api_endpoint_overrides/cloudbilling``: ``CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING``) points it elsewhere
  (the tests' stand-in); with gcloud's ``CLOUDSDK_AUTH_DISABLE_CREDENTIALS=true`` no credentials are sent, and
  without an override nothing is asked at all (Google's endpoint answers no anonymous caller).

What is priced, from Dataflow's pricing page (https://cloud.google.com/dataflow/pricing): a streaming worker's vCPUs
(``vCPU Time Streaming``, per hour), memory (``RAM Time Streaming``, per GiB-hour), GPUs (per GPU-hour) and boot disk
(``Local Disk Time PD ...``, per GiB-hour), each an ``OnDemand`` SKU offered in the job's region. Those descriptions
are the ones Dataflow's SKUs carry in billing exports; the GPU's is matched by its model (``L4``, ``T4``, ``A100
80GB``...) in a SKU whose description says GPU. Where several SKUs match, the dearest is taken: this is a ceiling.
The machine type's vCPUs and memory come from Compute Engine (``machineTypes.get``, through ``gcloud compute
machine-types describe``), in ``WORKER_ZONE`` or else the region's zones in turn (``regions.get``).

Not in the hourly figure, and said so where it is printed: Streaming Engine's compute units (billed by the data
the job shuffles and keeps, not by the hour), the launcher VM (``LAUNCHER_MACHINE_TYPE``, which runs only for the
minutes a launch takes and is not one of Dataflow's SKUs), and the other services the job uses (Pub/Sub, BigQuery).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, TextIO

from ops.settings import DeployError

CATALOG_ROOT = "https://cloudbilling.googleapis.com/"
# gcloud's endpoint override for the Cloud Billing API (properties: api_endpoint_overrides/cloudbilling).
ENDPOINT_VARIABLE = "CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING"
SCOPE = "https://www.googleapis.com/auth/cloud-billing.readonly"
DATAFLOW_NAMES = ("dataflow", "cloud dataflow")  # the service's display name (the older one second)
# Every lookup together (credentials, the catalog's pages, Compute Engine's answer) gets this long; one request this.
DEADLINE_S = 30.0
REQUEST_TIMEOUT_S = 15.0
HOURS_A_MONTH = Decimal(730)  # Google's pricing pages' month, for a price per GiB-month
PRICING_PAGE = "https://cloud.google.com/dataflow/pricing"

# A GPU type as a SKU's description names its model. A100 40GB and 80GB, and H100 and H100 Mega, are told apart.
GPU_MODELS: dict[str, str] = {
    "nvidia-tesla-p4": r"\bP4\b", "nvidia-tesla-p100": r"\bP100\b", "nvidia-tesla-v100": r"\bV100\b",
    "nvidia-tesla-t4": r"\bT4\b", "nvidia-l4": r"\bL4\b",
    "nvidia-tesla-a100": r"\bA100\b(?!\s*80\s*GB)", "nvidia-a100-80gb": r"\bA100\s*80\s*GB\b",
    "nvidia-h100-80gb": r"\bH100\b(?!.*\bMega\b)", "nvidia-h100-mega-80gb": r"\bH100\b.*\bMega\b",
    "nvidia-h200-141gb": r"\bH200\b", "nvidia-b200": r"\bB200\b", "nvidia-rtx-pro-6000": r"\bRTX\s*PRO\s*6000\b",
}
# SKUs of other kinds of work or pricing than a streaming worker's on-demand resources.
_NOT_A_STREAMING_WORKER = re.compile(r"\b(Batch|FlexRS|Prime|DCU|Shuffle|Snapshot|Preemptible|Spot|Commit\w*)\b",
                                     re.IGNORECASE)


class CatalogError(Exception):
    """Why the ceiling is unknown, in words for one line."""


@dataclass(frozen=True)
class Sku:
    """One catalog SKU, as far as a price per unit needs it: today's dearest tier (a ceiling)."""

    description: str
    resource_group: str
    usage_type: str
    regions: tuple[str, ...]
    usage_unit: str
    unit_price: Decimal
    currency: str

    @classmethod
    def from_api(cls, item: Mapping[str, Any]) -> Sku | None:
        """A Sku resource as the API answers it; None for one without a price."""
        timeline = item.get("pricingInfo") or []
        if not timeline:
            return None
        expression = timeline[-1].get("pricingExpression") or {}
        rates = [rate.get("unitPrice") or {} for rate in expression.get("tieredRates") or []]
        if not rates:
            return None
        prices = [Decimal(str(rate.get("units") or 0)) + Decimal(int(rate.get("nanos") or 0)) / Decimal(10**9)
                  for rate in rates]
        category = item.get("category") or {}
        return cls(description=str(item.get("description") or ""),
                   resource_group=str(category.get("resourceGroup") or ""),
                   usage_type=str(category.get("usageType") or ""),
                   regions=tuple(item.get("serviceRegions") or ()),
                   usage_unit=str(expression.get("usageUnit") or ""), unit_price=max(prices),
                   currency=str(rates[0].get("currencyCode") or "USD"))

    def per_hour(self) -> Decimal | None:
        """The price per hour of one unit (a vCPU, a GiB, a GPU), or None for a unit that is not time-based."""
        if self.usage_unit in ("h", "GiBy.h"):
            return self.unit_price
        if self.usage_unit == "GiBy.mo":
            return self.unit_price / HOURS_A_MONTH
        return None


@dataclass(frozen=True)
class Job:
    """What a launch asks for, as far as its price goes."""

    project: str
    region: str
    zone: str  # WORKER_ZONE; empty: Dataflow picks one of the region's
    machine_type: str
    gpu_type: str  # empty: no GPU
    gpu_count: int
    disk_gb: int
    max_workers: int
    launcher_machine_type: str


@dataclass(frozen=True)
class Shape:
    """A machine type's vCPUs and memory, as Compute Engine states them (``guestCpus``, ``memoryMb``)."""

    vcpus: int
    memory_gib: Decimal


@dataclass(frozen=True)
class Line:
    """One billed resource of one worker: how much of it, at which SKU's price per unit-hour."""

    what: str
    quantity: Decimal
    unit_price: Decimal  # per unit per hour
    sku: str

    @property
    def per_hour(self) -> Decimal:
        return self.quantity * self.unit_price


@dataclass(frozen=True)
class Ceiling:
    """The most the job's workers can cost an hour: every worker MAX_WORKERS allows, each billed all its lines."""

    workers: int
    lines: tuple[Line, ...]
    currency: str

    @property
    def per_worker(self) -> Decimal:
        return sum((line.per_hour for line in self.lines), Decimal(0))

    @property
    def per_hour(self) -> Decimal:
        return self.per_worker * self.workers


@dataclass(frozen=True)
class Unknown:
    """A ceiling that could not be priced, and why."""

    reason: str


def catalog_root(environ: Mapping[str, str]) -> str:
    """The API's root URL: gcloud's override for it if set (with or without its ``v1/``), else Google's."""
    root = (environ.get(ENDPOINT_VARIABLE) or CATALOG_ROOT).rstrip("/")
    return root.removesuffix("/v1") + "/"


def credentials_disabled(environ: Mapping[str, str]) -> bool:
    return (environ.get("CLOUDSDK_AUTH_DISABLE_CREDENTIALS") or "").lower() in ("1", "true", "yes")


def session(project: str, environ: Mapping[str, str]) -> Any:
    """An authorized requests session: Application Default Credentials, or none where gcloud's setting says so."""
    import google.auth
    from google.auth.credentials import AnonymousCredentials
    from google.auth.exceptions import DefaultCredentialsError
    from google.auth.transport.requests import AuthorizedSession

    if credentials_disabled(environ):
        return AuthorizedSession(AnonymousCredentials())
    try:
        credentials, _ = google.auth.default(scopes=[SCOPE])
    except DefaultCredentialsError:
        raise CatalogError("no Application Default Credentials to read it with (gcloud auth application-default "
                           "login)") from None
    with_quota_project = getattr(credentials, "with_quota_project", None)
    if project and getattr(credentials, "quota_project_id", None) is None and callable(with_quota_project):
        credentials = with_quota_project(project)
    return AuthorizedSession(credentials)


def api_error(response: Any) -> str:
    """A Google API error answer (``{"error": {"code", "status", "message", "details"}}``) in one line."""
    try:
        error = response.json().get("error") or {}
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]!r}"
    reasons = [detail.get("reason") for detail in error.get("details") or [] if detail.get("reason")]
    status = error.get("status") or f"HTTP {response.status_code}"
    text = f"{status}{' (' + ', '.join(reasons) + ')' if reasons else ''}: {str(error.get('message') or '')[:300]}"
    if "SERVICE_DISABLED" in reasons:
        text += " (gcloud services enable cloudbilling.googleapis.com)"
    return text


def pages(http: Any, url: str, key: str) -> list[dict[str, Any]]:
    """Every item of a paginated list (``nextPageToken`` -> ``pageToken``), in order."""
    from requests import RequestException

    found: list[dict[str, Any]] = []
    token, seen = "", set()
    while True:
        try:
            response = http.get(url, params={"pageToken": token} if token else {}, timeout=REQUEST_TIMEOUT_S)
        except RequestException as exc:
            raise CatalogError(f"the catalog could not be reached ({type(exc).__name__}: {str(exc)[:200]})") from None
        except Exception as exc:  # google-auth's refresh and transport errors
            raise CatalogError(f"the credentials could not be used ({type(exc).__name__}: {str(exc)[:200]})") \
                from None
        if response.status_code != 200:
            raise CatalogError(f"the catalog answered {api_error(response)}")
        try:
            body = response.json()
        except ValueError:
            raise CatalogError(f"the catalog answered something that is not JSON: {response.text[:200]!r}") from None
        found += body.get(key) or []
        token = body.get("nextPageToken") or ""
        if not token:
            return found
        if token in seen:
            raise CatalogError(f"the catalog handed out page token {token[:40]!r} twice")
        seen.add(token)


def dataflow_skus(http: Any, root: str) -> list[Sku]:
    """Dataflow's SKUs: its service id from ``services.list`` by display name, then ``services.skus.list``."""
    services = pages(http, f"{root}v1/services", "services")
    ids = [service.get("serviceId") or str(service.get("name", "")).removeprefix("services/")
           for service in services if str(service.get("displayName", "")).strip().lower() in DATAFLOW_NAMES]
    if not ids:
        raise CatalogError(f"the catalog's {len(services)} services include none named Dataflow")
    return [sku for item in pages(http, f"{root}v1/services/{ids[0]}/skus", "skus")
            if (sku := Sku.from_api(item)) is not None]


def dearest(skus: Sequence[Sku], region: str, what: str, unit: str, *patterns: str) -> Sku:
    """The dearest on-demand SKU offered in ``region`` whose description matches every pattern, priced by time."""
    found = [sku for sku in skus
             if region in sku.regions and sku.usage_type == "OnDemand" and sku.per_hour() is not None
             and sku.usage_unit.startswith(unit) and not _NOT_A_STREAMING_WORKER.search(sku.description)
             and all(re.search(pattern, sku.description, re.IGNORECASE) for pattern in patterns)]
    if not found:
        raise CatalogError(f"no on-demand Dataflow SKU for {what} in {region}")
    return max(found, key=lambda sku: sku.per_hour() or Decimal(0))


def worker_lines(skus: Sequence[Sku], job: Job, shape: Shape) -> tuple[tuple[Line, ...], str]:
    """One worker's billed resources (Dataflow's pricing page: vCPU, memory, GPU, Persistent Disk), priced, and the
    currency of their prices."""
    wanted: list[tuple[str, Decimal, Sku]] = [
        (f"{shape.vcpus} vCPUs", Decimal(shape.vcpus),
         dearest(skus, job.region, "streaming vCPUs", "h", r"\bvCPU\b", r"\bStreaming\b")),
        (f"{shape.memory_gib:g} GiB memory", shape.memory_gib,
         dearest(skus, job.region, "streaming memory", "GiBy", r"\b(RAM|Memory)\b", r"\bStreaming\b"))]
    if job.gpu_type:
        model = GPU_MODELS.get(job.gpu_type)
        if model is None:
            raise CatalogError(f"no catalog name is known for GPU_TYPE={job.gpu_type}")
        wanted.append((f"{job.gpu_count} {job.gpu_type}", Decimal(job.gpu_count),
                       dearest(skus, job.region, f"{job.gpu_type} GPUs", "h", r"\bGPU\b", model)))
    wanted.append((f"{job.disk_gb} GB boot disk", Decimal(job.disk_gb),
                   dearest(skus, job.region, "persistent disk", "GiBy", r"\b(PD|Persistent Disk)\b", r"^(?!.*SSD)")))
    currencies = {sku.currency for _, _, sku in wanted}
    if len(currencies) > 1:
        raise CatalogError(f"the SKUs are priced in several currencies ({', '.join(sorted(currencies))})")
    lines = tuple(Line(what, quantity, sku.per_hour() or Decimal(0), sku.description) for what, quantity, sku in wanted)
    return lines, currencies.pop()


def gcloud_json(command: list[str]) -> tuple[Any, str]:
    """A gcloud command's JSON answer, or (None, what it said on failure)."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if result.returncode:
        return None, result.stderr.strip()
    try:
        return json.loads(result.stdout), ""
    except ValueError:
        return None, f"not JSON: {result.stdout[:200]!r}"


def machine_shape(job: Job) -> Shape:
    """The machine type's vCPUs and memory from Compute Engine: ``WORKER_ZONE``'s, else the first zone of the region
    that offers it (``gcloud compute regions describe`` lists them)."""
    where = ["--project", job.project, "--format=json"]
    zones = [job.zone]
    if not job.zone:
        region, said = gcloud_json(["gcloud", "compute", "regions", "describe", job.region, *where])
        if region is None:
            raise CatalogError(f"Compute Engine did not describe region {job.region}: {said[-300:]}")
        zones = sorted(str(url).rsplit("/", 1)[-1] for url in region.get("zones") or [])
    said = f"region {job.region} lists no zones"
    for zone in zones:
        found, said = gcloud_json(["gcloud", "compute", "machine-types", "describe", job.machine_type, "--zone", zone,
                                   *where])
        if found is not None:
            try:
                return Shape(int(found["guestCpus"]), Decimal(int(found["memoryMb"])) / 1024)
            except (KeyError, TypeError, ValueError):
                raise CatalogError(f"Compute Engine's machine type {job.machine_type} has no guestCpus and "
                                   "memoryMb") from None
        if "was not found" not in said and "notFound" not in said:
            break
    raise CatalogError(f"Compute Engine did not describe machine type {job.machine_type} in "
                       f"{job.zone or job.region}: {said.splitlines()[-1][-300:] if said else 'no answer'}")


def job_ceiling(job: Job, environ: Mapping[str, str]) -> Ceiling | Unknown:
    """The job's hourly ceiling, or why it is unknown; every failure is an answer, within :data:`DEADLINE_S`."""
    if credentials_disabled(environ) and not environ.get(ENDPOINT_VARIABLE):
        return Unknown("CLOUDSDK_AUTH_DISABLE_CREDENTIALS is set, and the catalog answers no caller without "
                       "credentials")
    results: dict[str, Any] = {}

    def run(name: str, work: Callable[[], Any]) -> threading.Thread:
        def target() -> None:
            try:
                results[name] = work()
            except CatalogError as exc:
                results[name] = exc
            except Exception as exc:  # an unexpected answer must not stop a launch
                results[name] = CatalogError(f"{type(exc).__name__}: {str(exc)[:200]}")
        thread = threading.Thread(target=target, daemon=True)  # not waited for at exit, if it overruns
        thread.start()
        return thread

    started = time.monotonic()
    lookups = [("skus", "the Cloud Billing Catalog",
                run("skus", lambda: dataflow_skus(session(job.project, environ), catalog_root(environ)))),
               ("shape", "Compute Engine", run("shape", lambda: machine_shape(job)))]
    for name, what, thread in lookups:  # the catalog first: where it fails, Compute Engine's answer is not awaited
        thread.join(max(0.0, DEADLINE_S - (time.monotonic() - started)))
        if name not in results:
            return Unknown(f"{what} did not answer within {DEADLINE_S:g} s")
        if isinstance(results[name], CatalogError):
            return Unknown(str(results[name]))
    try:
        lines, currency = worker_lines(results["skus"], job, results["shape"])
    except CatalogError as exc:
        return Unknown(str(exc))
    return Ceiling(job.max_workers, lines, currency)


def money(amount: Decimal, places: int = 4) -> str:
    return f"{amount.quantize(Decimal(10) ** -places):,}"


def report(ceiling: Ceiling, job: Job) -> list[str]:
    """The ceiling as printed before the launch: each line, then the job's figure and what it leaves out."""
    width = max(len(line.what) for line in ceiling.lines)
    prices = [f"{line.unit_price.normalize():f}" for line in ceiling.lines]
    price_width = max(map(len, prices))
    lines = [f"==> The job's hourly ceiling in {job.region}, at Dataflow's list prices in the Cloud Billing Catalog "
             f"now ({ceiling.currency}):"]
    for line, price in zip(ceiling.lines, prices, strict=True):
        lines.append(f"      {line.what:<{width}}  × {price:>{price_width}} an hour = {money(line.per_hour):>8}"
                     f"   ({line.sku})")
    lines.append(f"    one worker: {money(ceiling.per_worker)} {ceiling.currency} an hour; "
                 f"MAX_WORKERS={ceiling.workers}: at most {money(ceiling.per_hour)} {ceiling.currency} an hour "
                 f"({money(ceiling.per_hour * HOURS_A_MONTH, 2)} for a 730-hour month at that size)")
    lines.append("    not in it: Streaming Engine's compute units (billed by the data the job shuffles and keeps), the "
                 f"launcher VM ({job.launcher_machine_type or 'Dataflow default'}, for the minutes the launch takes), "
                 f"and Pub/Sub, BigQuery, Cloud Storage ({PRICING_PAGE})")
    return lines


def parse_limit(text: str) -> Decimal | None:
    """``MAX_HOURLY_COST``: a positive amount in the catalog's currency (USD), or None if unset."""
    if not text:
        return None
    try:
        limit = Decimal(text)
    except InvalidOperation:
        limit = Decimal(-1)
    if not limit.is_finite() or limit <= 0:
        raise DeployError(f"MAX_HOURLY_COST={text!r}: an amount in USD an hour, e.g. 10 or 7.5 (empty: no limit)")
    return limit


def parse_confirm(text: str) -> bool:
    """``CONFIRM_COST``: 1 (or true, yes) launches above MAX_HOURLY_COST without asking."""
    if text.lower() in ("", "0", "false", "no"):
        return False
    if text.lower() in ("1", "true", "yes"):
        return True
    raise DeployError(f"CONFIRM_COST={text!r}: 1 to launch above MAX_HOURLY_COST without asking, or empty")


def check_ceiling(job: Job, limit: Decimal | None, confirmed: bool, dry_run: bool,
                  environ: Mapping[str, str] | None = None, stdin: TextIO | None = None,
                  out: TextIO | None = None) -> Ceiling | Unknown:
    """Prints the job's hourly ceiling and, above ``limit``, has the launch confirmed: ``CONFIRM_COST=1``, or "y" on
    a terminal; with no terminal the launch is refused (a :class:`DeployError` naming what to change). An unknown
    ceiling is printed with its reason and never stops a launch."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out
    found = job_ceiling(job, os.environ if environ is None else environ)

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    if isinstance(found, Unknown):
        say(f"==> The job's hourly ceiling is unknown: {' '.join(found.reason.split())}."
            + (f" MAX_HOURLY_COST={limit} is not checked." if limit is not None else "")
            + f" Launching without it ({PRICING_PAGE} has the prices).")
        return found
    for text in report(found, job):
        say(text)
    if limit is None or found.per_hour <= limit:
        return found
    above = (f"the ceiling, {money(found.per_hour)} {found.currency} an hour, is above MAX_HOURLY_COST={limit}")
    if confirmed:
        say(f"    {above}; CONFIRM_COST=1 launches it anyway.")
        return found
    if dry_run:
        say(f"    {above}: make run asks before launching (without a terminal it refuses unless CONFIRM_COST=1).")
        return found
    advice = "raise MAX_HOURLY_COST, lower MAX_WORKERS, or set CONFIRM_COST=1 to launch anyway"
    if not stdin.isatty():
        raise DeployError(f"not launched: {above}, and there is no terminal to confirm it: {advice}")
    print(f"    {above}. Launch anyway? [y/N] ", end="", file=out, flush=True)
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise DeployError(f"not launched: {above} and the launch was not confirmed: {advice}")
    return found
