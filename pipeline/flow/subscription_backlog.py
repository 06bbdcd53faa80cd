"""The backlog of a subscription the job reads, as Cloud Monitoring reports it: what a reader tells the autoscaler.

Dataflow sizes a streaming job by the work it sees waiting. For its own Pub/Sub source that is the subscription's
backlog; a splittable DoFn's is what its restrictions report as their size (``restriction_size``), and Dataflow
acts on that number: Beam's ``PeriodicSequence`` made jobs scale up and never down while its reported backlog
bytes were wrong (apache/beam PR #32513). The job's reader (:mod:`pipeline.flow.subscription_reader`) leaves its
backlog in Pub/Sub, where only Pub/Sub can count it: a reader that has not pulled a message cannot see it. So each
reader reports its share of the subscription's ``pubsub.googleapis.com/subscription/backlog_bytes`` (the bytes of
unacknowledged messages: https://cloud.google.com/monitoring/api/metrics_gcp_p_z#gcp-pubsub), read from Cloud
Monitoring's ``projects.timeSeries.list``
(https://cloud.google.com/monitoring/api/ref_v3/rest/v3/projects.timeSeries/list) at most once every
``REFRESH_S`` per process and subscription, on the reader's own thread, never in ``restriction_size``. The figure is
monotone in the backlog and zero for an empty subscription. Pub/Sub samples it every 60 s and Monitoring shows a
sample up to 4 minutes later; a figure read more than ``STALE_S`` ago (the calls since refused, or the metric
absent) is not used, so what a reader reports is at most ``STALE_S`` plus Monitoring's own delay old. Without a
figure the reader reports what it knows itself (the bytes its feed holds pulled and not yet handed on).

The job's account needs ``monitoring.timeSeries.list`` on the project (Monitoring Viewer, which ``make setup``
grants). Where it cannot be reached or refuses (a local run has no Monitoring), the figure goes stale and the
refusal is logged once every ``REFUSED_LOG_INTERVAL_S``. The API's address can be overridden with
``CLOUDSDK_API_ENDPOINT_OVERRIDES_MONITORING``, the variable gcloud reads (a private endpoint, say), which is then
called with the worker's credentials as the default one is; only a loopback ``http://`` address (the tests'
stand-in) is called without any.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

LOGGER = logging.getLogger(__name__)

# How often a process asks Monitoring for one subscription's backlog.
REFRESH_S = 60.0
# A figure read longer ago than this is not reported (two refreshes missed).
STALE_S = 180.0
# How far back a query looks for the newest point.
WINDOW_S = 300.0
# How often a refusal is logged.
REFUSED_LOG_INTERVAL_S = 600.0
DEFAULT_ENDPOINT = "https://monitoring.googleapis.com/"
ENDPOINT_VARIABLE = "CLOUDSDK_API_ENDPOINT_OVERRIDES_MONITORING"


def backlog_query(subscription: str) -> str:
    """The filter of one subscription's backlog bytes (``projects/P/subscriptions/ID``)."""
    subscription_id = subscription.rsplit("/", 1)[-1]
    return ('metric.type="pubsub.googleapis.com/subscription/backlog_bytes" AND '
            f'resource.type="pubsub_subscription" AND resource.labels.subscription_id="{subscription_id}"')


def newest_value(answer: dict[str, Any]) -> float | None:
    """The newest point's value in a ``timeSeries.list`` answer (points come newest first), or None."""
    newest: tuple[str, float] | None = None
    for series in answer.get("timeSeries", []):
        for point in series.get("points", [])[:1]:
            value = point.get("value", {})
            number = value.get("int64Value", value.get("doubleValue"))
            if number is None:
                continue
            at = point.get("interval", {}).get("endTime", "")
            if newest is None or at > newest[0]:
                newest = (at, float(number))
    return newest[1] if newest else None


def _rfc3339(moment: float) -> str:
    return datetime.datetime.fromtimestamp(moment, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class SubscriptionBacklog:
    """One subscription's backlog bytes, refreshed by :meth:`refresh` (call it from a thread that may wait) and read
    by :meth:`bytes` (never waits). ``fetch`` answers a ``timeSeries.list`` query; by default the REST API."""

    def __init__(self, subscription: str, fetch: Callable[[str, str], dict[str, Any]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._subscription = subscription
        self._project = subscription.split("/")[1] if subscription.startswith("projects/") else ""
        self._fetch = fetch
        self._clock = clock
        self._value: tuple[float, float] | None = None  # (bytes, when read)
        self._asked_at = float("-inf")
        self._refused_logged_at = float("-inf")
        self._lock = threading.Lock()
        self._refreshing: threading.Thread | None = None

    def bytes(self) -> float | None:
        """The subscription's backlog in bytes, or None when no figure fresher than ``STALE_S`` is known."""
        with self._lock:
            if self._value is None or self._clock() - self._value[1] > STALE_S:
                return None
            return self._value[0]

    def refresh_soon(self) -> None:
        """:meth:`refresh` on a thread of its own, unless one is under way: the first call may wait for the worker's
        credentials, which must not hold up the caller (the feed's pulls)."""
        with self._lock:
            if self._refreshing is not None and self._refreshing.is_alive():
                return
            self._refreshing = threading.Thread(target=self.refresh, name="pubsub-backlog", daemon=True)
            self._refreshing.start()

    def refresh(self) -> None:
        """Asks Monitoring again if ``REFRESH_S`` has passed since it last asked; never raises."""
        now = self._clock()
        if now - self._asked_at < REFRESH_S or not self._project:
            return
        self._asked_at = now
        try:
            if self._fetch is None:
                self._fetch = rest_fetch()
            value = newest_value(self._fetch(self._project, backlog_query(self._subscription)))
        except Exception as exc:  # noqa: BLE001 - any failure leaves the figure to go stale, said once in a while
            if now - self._refused_logged_at >= REFUSED_LOG_INTERVAL_S:
                self._refused_logged_at = now
                LOGGER.warning("The backlog of %s could not be read from Cloud Monitoring (%s); the readers report "
                               "only what they hold to the autoscaler. The job's account needs Monitoring Viewer "
                               "on the project (make setup grants it).", self._subscription, exc)
            return
        if value is not None:
            with self._lock:
                self._value = (value, now)


def rest_fetch() -> Callable[[str, str], dict[str, Any]]:
    """A ``timeSeries.list`` call through the worker's credentials."""
    endpoint = os.environ.get(ENDPOINT_VARIABLE)
    base = (endpoint or DEFAULT_ENDPOINT).rstrip("/") + "/"
    session = _session(anonymous=endpoint is not None and _loopback(endpoint))

    def fetch(project: str, query: str) -> dict[str, Any]:
        now = time.time()
        response = session.get(f"{base}v3/projects/{project}/timeSeries", timeout=30, params={
            "filter": query, "interval.startTime": _rfc3339(now - WINDOW_S), "interval.endTime": _rfc3339(now),
            "view": "FULL"})
        if response.status_code >= 400:
            raise RuntimeError(f"{response.status_code} {response.text[:200]}")
        return response.json()

    return fetch


def _loopback(url: str) -> bool:
    """Whether ``url`` is a plain-HTTP address on this machine's loopback interface (a stand-in's)."""
    parsed = urllib.parse.urlparse(url)
    return parsed.scheme == "http" and parsed.hostname in ("127.0.0.1", "localhost", "::1")


def _session(anonymous: bool) -> Any:
    import google.auth
    from google.auth.credentials import AnonymousCredentials
    from google.auth.transport.requests import AuthorizedSession

    if anonymous:
        return AuthorizedSession(AnonymousCredentials())
    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/monitoring.read"])
    return AuthorizedSession(credentials)
