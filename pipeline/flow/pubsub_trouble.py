"""What a feed's Pub/Sub calls say of the service: which errors are tried again, which are told, and when it cannot be
reached at all.

Pub/Sub's errors are told apart (https://cloud.google.com/pubsub/docs/reference/error-codes): a long pull that ran
out its deadline (``DeadlineExceeded`` after most of it) is an empty subscription, unless no call has reached Pub/Sub
for ``UNREACHABLE_S``, when a cheap ``GetSubscription`` asks whether the service can be reached at all; one cut off
well before its deadline (a proxy's, a network's) is tried again like the errors that follow; ``Unavailable``,
``Internal``, ``Unknown``, ``Aborted`` and ``ResourceExhausted`` are tried again with backoff and counted;
``PermissionDenied``, ``NotFound`` and a service that cannot be reached (a worker without Private Google Access) are
logged at WARNING at most once a minute with their cause and counted, and the feed asks again ``REFUSED_WAIT_S``
later. None looks like an empty subscription.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

LOGGER = logging.getLogger("pipeline.flow.subscription_feed")

# The deadline of every other call (acknowledge, modify the ack deadline, GetSubscription): with a pull, a turn of
# the feed is then well within AdmissionSettings.place_open_s.
CALL_DEADLINE_S = 10.0
# With no call answered by Pub/Sub for this long, an empty pull is checked against GetSubscription.
UNREACHABLE_S = 60.0
# A pull's DeadlineExceeded before this share of its deadline passed was cut off, not an empty long pull.
CUT_SHORT = 0.5
# How often one cause of trouble is logged.
WARN_INTERVAL_S = 60.0


def classify(exc: BaseException) -> str:
    """What a Pub/Sub call's error means for the feed: ``empty`` (a long pull that ended without messages),
    ``retry`` (tried again with backoff), or ``refused`` (told in the log, and waited on)."""
    from google.api_core import exceptions

    if isinstance(exc, exceptions.DeadlineExceeded):
        return "empty"
    if isinstance(exc, (exceptions.ServiceUnavailable, exceptions.InternalServerError, exceptions.Unknown,
                        exceptions.Aborted, exceptions.ResourceExhausted, exceptions.RetryError,
                        exceptions.Cancelled)):
        return "retry"
    try:
        from google.auth import exceptions as auth_exceptions
    except ImportError:  # pragma: no cover - google-auth comes with the client
        return "refused"
    if isinstance(exc, (auth_exceptions.TransportError, auth_exceptions.RefreshError)):
        return "retry"  # the worker's credentials could not be fetched: the metadata server, for now
    return "refused"


def call_retry() -> Any:
    """How an acknowledgement, a deadline change or GetSubscription is tried again: on the errors worth it, for
    ``CALL_DEADLINE_S`` in all (the client's own default tries for 60 s, past what the feed can wait)."""
    from google.api_core import retry

    return retry.Retry(predicate=lambda exc: classify(exc) == "retry", initial=0.1, maximum=2.0,
                       timeout=CALL_DEADLINE_S)


class PubSubTrouble:
    """One feed's view of Pub/Sub's health: when a call last reached it, and what each failed pull means.
    ``count`` adds to the feed's counts, ``client`` is its Pub/Sub client, ``clock`` its clock."""

    def __init__(self, subscription: str, count: Callable[..., None], client: Callable[[], Any],
                 clock: Callable[[], float]) -> None:
        self._subscription = subscription
        self._count = count
        self._client = client
        self._clock = clock
        self._reached_at = clock()  # when Pub/Sub last answered a call
        self._warned: dict[str, float] = {}
        self._lock = threading.Lock()

    def reached(self) -> None:
        """A call was answered."""
        self._reached_at = self._clock()

    def warn(self, cause: str, message: str, *args: Any) -> None:
        now = self._clock()
        with self._lock:
            if now - self._warned.get(cause, float("-inf")) < WARN_INTERVAL_S:
                return
            self._warned[cause] = now
        LOGGER.warning(message, *args)

    def after(self, exc: BaseException, ran_s: float | None = None, deadline_s: float | None = None) -> str:
        """What follows a failed pull that ran ``ran_s`` of its ``deadline_s``: ``empty``, ``retry`` or ``refused``
        (said in the log, counted)."""
        kind = classify(exc)
        if kind == "empty" and ran_s is not None and deadline_s is not None and ran_s < CUT_SHORT * deadline_s:
            kind = "retry"  # no long pull that ran its course: nothing says the subscription is empty
        if kind == "empty":
            if self._clock() - self._reached_at < UNREACHABLE_S:
                return "empty"
            return self._probe(exc, "empty")
        if kind == "retry":
            self._count("pull_retried")
            if self._clock() - self._reached_at >= UNREACHABLE_S:
                self.warn("retrying", "Pulls of %s have failed for over %g s (%s); trying again with backoff "
                          "(counter pull_retried)", self._subscription, UNREACHABLE_S, exc)
                return self._probe(exc, "retry")
            return "retry"
        self._count("pull_refused")
        self.warn(type(exc).__name__, "Pub/Sub refuses to let this worker pull %s: %s. Nothing is read from it "
                   "until that changes (the job's account needs Pub/Sub Subscriber and Pub/Sub Viewer on it, which "
                   "make setup grants, and the subscription must exist; counter pull_refused)", self._subscription, exc)
        return "refused"

    def _probe(self, cause: BaseException, kind: str) -> str:
        """No call reached Pub/Sub for UNREACHABLE_S: whether it can be reached at all. Reached, the pull's own
        ``kind`` stands (an empty subscription, or a pull worth trying again)."""
        try:
            self._client().get_subscription(subscription=self._subscription, timeout=CALL_DEADLINE_S,
                                            retry=call_retry())
            self._reached_at = self._clock()
            return kind
        except Exception as exc:  # noqa: BLE001
            if classify(exc) == "refused" and not isinstance(exc, ConnectionError):
                return self.after(exc)
            self._count("pubsub_unreachable")
            self.warn("unreachable", "Pub/Sub cannot be reached from this worker (%s; then %s): nothing is read "
                       "from %s. A worker without an external IP needs Private Google Access on its subnetwork "
                       "(docs/operations.md#network); counter pubsub_unreachable", cause, exc, self._subscription)
            return "refused"
