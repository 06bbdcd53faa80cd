"""Local-only fix for the Python DirectRunner's Pub/Sub read.

The DirectRunner reads Pub/Sub with a blocking ``pull(timeout=30)`` on the
thread that also fires timers, so while input is idle our millisecond batch
timers and chunk polls fire up to 30 s late, and ``cancel()`` takes as long.
:func:`bound_pubsub_pull` replaces that pull with a short one (and a short
sleep when nothing came). It touches private DirectRunner internals, so it is
applied only when the pipeline runs on the DirectRunner, never on Dataflow.
"""

from __future__ import annotations

import logging
import time
from typing import Any

LOGGER = logging.getLogger(__name__)
LOCAL_RUNNERS = ("DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")


class _BoundedPullClient:
    """Wraps a SubscriberClient so that ``pull`` returns within ``deadline_s``."""

    def __init__(self, client: Any, deadline_s: float, idle_sleep_s: float, max_messages: int) -> None:
        self._client = client
        self._deadline_s = deadline_s
        self._idle_sleep_s = idle_sleep_s
        self._max_messages = max_messages

    def pull(self, subscription: str, max_messages: int = 10, timeout: float | None = None) -> Any:
        from google.api_core import exceptions
        from google.cloud.pubsub_v1 import types

        try:
            response = self._client.pull(subscription=subscription, max_messages=self._max_messages,
                                         timeout=self._deadline_s, retry=None)
        except (exceptions.DeadlineExceeded, exceptions.ServiceUnavailable):
            response = types.PullResponse()
        if not response.received_messages:
            time.sleep(self._idle_sleep_s)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


_applied = False


def bound_pubsub_pull(deadline_s: float = 0.05, idle_sleep_s: float = 0.01, max_messages: int = 100) -> None:
    """Makes the DirectRunner's Pub/Sub read return quickly when idle (idempotent)."""
    global _applied
    if _applied:
        return
    from apache_beam.runners.direct import transform_evaluator

    evaluator = transform_evaluator._PubSubReadEvaluator
    original = evaluator._get_subscriber_client.__func__

    def bounded(cls, transform):
        return _BoundedPullClient(original(cls, transform), deadline_s, idle_sleep_s, max_messages)

    evaluator._get_subscriber_client = classmethod(bounded)
    _applied = True
    LOGGER.info("DirectRunner Pub/Sub pull bounded to %.0f ms (local runs only)", deadline_s * 1000)
