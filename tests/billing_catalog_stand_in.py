"""A loopback stand-in for the Cloud Billing Catalog API and Compute Engine's machine types, for the price check.

The Catalog's answers have the shape its documentation gives (https://cloud.google.com/billing/v1/how-tos/catalog-api;
the reference as Google's Python client renders it,
https://github.com/googleapis/google-api-python-client/blob/main/docs/dyn/cloudbilling_v1.services.skus.html):
``GET /v1/services`` -> ``{"services": [{"name", "serviceId", "displayName"}], "nextPageToken"}`` and
``GET /v1/services/ID/skus`` -> ``{"skus": [Sku], "nextPageToken"}``, both paged (``pageSize``, ``pageToken``) and
here kept to a few items a page so that every client must follow ``nextPageToken``. A token it did not hand out is
refused as Google refuses it (400 INVALID_ARGUMENT), an unknown service is 404 NOT_FOUND, and ``deny`` answers every
call with the 403 PERMISSION_DENIED Google gives a caller without a key or credentials, or SERVICE_DISABLED.

The Dataflow SKUs: the vCPU, RAM and disk descriptions are those Dataflow's SKUs carry in billing exports ("vCPU Time
Streaming Iowa", "RAM Time Streaming Iowa", "Local Disk Time PD Standard Iowa"); the GPU ones are modelled on them.
Beside the ones a streaming GPU worker is billed for there are those it must not be priced from: batch workers,
committed-use and preemptible prices, SSD disks, Streaming Engine's compute units, other regions, other GPUs. The
us-central1 prices are the worked example's in docs/operations.md#cost. The service id is made up, so that nothing
can find Dataflow but by its display name.

Compute Engine, as the real gcloud asks it with ``CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE`` pointing here:
``GET /compute/v1/projects/P/regions/R`` (``{"name", "zones": [URL]}``) and
``GET /compute/v1/projects/P/zones/Z/machineTypes/M`` (``{"name", "guestCpus", "memoryMb", "zone"}``), 404 with
Compute Engine's "was not found" for a machine type a zone does not offer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.loopback_api import LoopbackApi

DATAFLOW_ID = "D1A7-F10W-5A4D"
SERVICES = [("6F81-5844-456A", "Compute Engine"), ("95FF-2EF5-5EA1", "Cloud Storage"),
            ("24E6-581D-38E5", "BigQuery"), ("A1E8-BE35-7EBC", "Cloud Pub/Sub"), (DATAFLOW_ID, "Dataflow")]
REGION_NAMES = {"us-central1": "Iowa", "europe-west4": "Netherlands", "asia-northeast1": "Tokyo"}
# Compute Engine's zones and machine types (guestCpus, memoryMb), as its machine-type pages state them.
ZONES = {"us-central1": ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"),
         "europe-west4": ("europe-west4-a", "europe-west4-b", "europe-west4-c"),
         "asia-northeast1": ("asia-northeast1-a", "asia-northeast1-b", "asia-northeast1-c")}
MACHINE_TYPES = {"g2-standard-8": (8, 32768), "g2-standard-24": (24, 98304), "n1-standard-8": (8, 30720),
                 "a2-ultragpu-1g": (12, 174080), "e2-standard-4": (4, 16384)}
# Zones that do not offer a machine type (G2 is not in every zone of a region).
NOT_OFFERED = {("us-central1-a", "g2-standard-8")}


@dataclass(frozen=True)
class Offer:
    """One SKU: its description (the region's name is appended, as the catalog writes them), price and unit."""

    description: str
    price: str  # USD per usage unit
    unit: str = "h"
    family: str = "Compute"
    group: str = ""
    usage: str = "OnDemand"


def offers(region: str) -> list[Offer]:
    """What Dataflow sells in a region: the same list everywhere, priced by region, less the GPUs a region lacks."""
    scale = {"us-central1": Decimal(1), "europe-west4": Decimal("1.1"), "asia-northeast1": Decimal("1.25")}[region]
    found = [Offer("vCPU Time Streaming", "0.069", group="CPU"),
             Offer("vCPU Time Streaming", "0.0552", group="CPU", usage="Commit1Yr"),
             Offer("vCPU Time Batch", "0.056", group="CPU"),
             Offer("RAM Time Streaming", "0.003557", "GiBy.h", group="RAM"),
             Offer("RAM Time Batch", "0.003557", "GiBy.h", group="RAM"),
             Offer("Local Disk Time PD Standard", "0.000054", "GiBy.h", "Storage", "PDStandard"),
             Offer("Local Disk Time PD SSD", "0.000298", "GiBy.h", "Storage", "SSD"),
             Offer("Streaming Engine Compute Units", "0.089", "h", group="StreamingEngine"),
             Offer("Nvidia Tesla T4 GPU", "0.35", group="GPU"),
             Offer("Nvidia Tesla T4 GPU", "0.14", group="GPU", usage="Preemptible")]
    if region != "asia-northeast1":  # no L4 in this stand-in's Tokyo: a GPU the catalog lacks in a region
        found += [Offer("Nvidia L4 GPU", "0.56", group="GPU"), Offer("Nvidia L4 GPU", "0.2", group="GPU",
                                                                      usage="Preemptible")]
    if region == "us-central1":
        found += [Offer("Nvidia Tesla A100 GPU", "2.48", group="GPU"),
                  Offer("Nvidia A100 80GB GPU", "3.93", group="GPU")]
    scaled = []
    for offer in found:
        price = (Decimal(offer.price) * scale).quantize(Decimal("0.000000001"))
        scaled.append(Offer(f"{offer.description} {REGION_NAMES[region]}", str(price), offer.unit, offer.family,
                            offer.group, offer.usage))
    return scaled


def money(price: str) -> dict[str, Any]:
    """A google.type.Money in USD: whole units as a string (int64 in JSON), nanos as a number."""
    amount = Decimal(price)
    units = int(amount)
    return {"currencyCode": "USD", "units": str(units), "nanos": int((amount - units) * 10**9)}


def sku_resource(index: int, region: str, offer: Offer) -> dict[str, Any]:
    """A Sku resource as services.skus.list answers it."""
    sku_id = f"{index:04X}-{len(offer.description) * 97 % 0xFFFF:04X}-5A4D"
    return {
        "name": f"services/{DATAFLOW_ID}/skus/{sku_id}", "skuId": sku_id, "description": offer.description,
        "category": {"serviceDisplayName": "Dataflow", "resourceFamily": offer.family, "resourceGroup": offer.group,
                     "usageType": offer.usage},
        "serviceRegions": [region],
        "pricingInfo": [
            # The timeline is in chronological order: an older price first, which must not be used.
            {"effectiveTime": "2026-01-01T00:00:00Z", "summary": "",
             "pricingExpression": {"usageUnit": offer.unit, "displayQuantity": 1, "tieredRates": [
                 {"startUsageAmount": 0, "unitPrice": money(str(Decimal(offer.price) / 2))}]},
             "currencyConversionRate": 1},
            {"effectiveTime": "2026-11-25T00:00:00Z", "summary": "",
             "pricingExpression": {"usageUnit": offer.unit, "usageUnitDescription": offer.unit,
                                   "baseUnit": "s" if offer.unit == "h" else "By.s", "baseUnitConversionFactor": 3600,
                                   "displayQuantity": 1, "tieredRates": [
                                       {"startUsageAmount": 0, "unitPrice": money(offer.price)}]},
             "aggregationInfo": {"aggregationLevel": "ACCOUNT", "aggregationInterval": "MONTHLY",
                                 "aggregationCount": 1},
             "currencyConversionRate": 1}],
        "serviceProviderName": "Google",
        "geoTaxonomy": {"type": "REGIONAL", "regions": [region]}}


def error(code: int, status: str, message: str, reason: str | None = None) -> tuple[int, dict[str, Any]]:
    """Google's error answer (AIP-193): code, status, message, and an ErrorInfo with the reason where there is one."""
    body: dict[str, Any] = {"code": code, "message": message, "status": status}
    if reason:
        body["details"] = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": reason,
                            "domain": "googleapis.com", "metadata": {"service": "cloudbilling.googleapis.com"}}]
    return code, {"error": body}


class CatalogStandIn:
    """Serves the catalog (all of :data:`REGION_NAMES`'s SKUs, a few a page) and Compute Engine's machine types."""

    def __init__(self, page_size: int = 4) -> None:
        self.page_size = page_size
        self.deny: str | None = None  # "PERMISSION_DENIED" or "SERVICE_DISABLED": every catalog call refused so
        self.requests: list[str] = []
        self.skus = [sku_resource(i, region, offer) for i, (region, offer) in enumerate(
            (region, offer) for region in REGION_NAMES for offer in offers(region))]
        self.api = LoopbackApi(self.answer)

    @property
    def url(self) -> str:
        return self.api.url + "/"

    def env(self) -> dict[str, str]:
        """Points the price check (the catalog) and gcloud (Compute Engine) here."""
        return {"CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING": self.url,
                "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": self.url}

    def close(self) -> None:
        self.api.close()

    def page(self, items: list[dict[str, Any]], key: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        size = min(int((query.get("pageSize") or ["5000"])[0]), self.page_size)
        token = (query.get("pageToken") or [""])[0]
        if token and not re.fullmatch(r"page-\d+", token):
            return error(400, "INVALID_ARGUMENT", f"Invalid page token: {token}")
        start = int(token.removeprefix("page-")) if token else 0
        body: dict[str, Any] = {key: items[start:start + size]}
        if start + size < len(items):
            body["nextPageToken"] = f"page-{start + size}"
        return 200, body

    def answer(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any]:
        self.requests.append(f"{method} {path}")
        parts = urlsplit(path)
        query = parse_qs(parts.query)
        if parts.path.startswith("/compute/v1/"):
            return self.compute(method, parts.path)
        if method != "GET":
            return error(404, "NOT_FOUND", f"Method not found: {method} {parts.path}")
        if self.deny == "SERVICE_DISABLED":
            return error(403, "PERMISSION_DENIED", "Cloud Billing API has not been used in project 123456789 before "
                         "or it is disabled. Enable it by visiting https://console.developers.google.com/apis/api/"
                         "cloudbilling.googleapis.com/overview?project=123456789 then retry.", "SERVICE_DISABLED")
        if self.deny:
            return error(403, "PERMISSION_DENIED", "Method doesn't allow unregistered callers (callers without "
                         "established identity). Please use API Key or other form of API consumer identity to call "
                         "this API.")
        if parts.path == "/v1/services":
            return self.page([{"name": f"services/{sid}", "serviceId": sid, "displayName": name}
                              for sid, name in SERVICES], "services", query)
        skus = re.fullmatch(r"/v1/services/([^/]+)/skus", parts.path)
        if skus and skus.group(1) == DATAFLOW_ID:
            return self.page(self.skus, "skus", query)
        if skus:
            return error(404, "NOT_FOUND", f"Service services/{skus.group(1)} not found.")
        return error(404, "NOT_FOUND", f"the stand-in does not answer {method} {parts.path}")

    def compute(self, method: str, path: str) -> tuple[int, Any]:
        region = re.fullmatch(r"/compute/v1/projects/([^/]+)/regions/([^/]+)", path)
        if method == "GET" and region and region.group(2) in ZONES:
            project, name = region.groups()
            return 200, {"kind": "compute#region", "name": name, "status": "UP", "zones": [
                f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}" for zone in ZONES[name]]}
        machine = re.fullmatch(r"/compute/v1/projects/([^/]+)/zones/([^/]+)/machineTypes/([^/]+)", path)
        if method == "GET" and machine:
            project, zone, name = machine.groups()
            known = any(zone in zones for zones in ZONES.values())
            if name in MACHINE_TYPES and known and (zone, name) not in NOT_OFFERED:
                cpus, memory = MACHINE_TYPES[name]
                return 200, {"kind": "compute#machineType", "name": name, "guestCpus": cpus, "memoryMb": memory,
                             "zone": zone, "selfLink": f"https://www.googleapis.com{path}"}
        # Compute Engine's own 404 (the older error shape it still answers with).
        resource = path.removeprefix("/compute/v1/")
        return 404, {"error": {"code": 404, "message": f"The resource '{resource}' was not found",
                               "errors": [{"message": f"The resource '{resource}' was not found", "domain": "global",
                                           "reason": "notFound"}]}}
