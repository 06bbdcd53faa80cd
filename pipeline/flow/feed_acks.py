"""A feed's acknowledgements: every finalizer's ack ids, sent on one thread of its own, many bundles in one call.

A reader's bundle finalizer runs on a harness thread and must not wait on Pub/Sub
(:mod:`pipeline.flow.subscription_feed`), so it only queues its ack ids here. One call per bundle would queue
behind each other while Pub/Sub is slow (each tried again for up to ``CALL_DEADLINE_S``), so what waits is sent
together, up to ``ACK_BATCH`` ids a call (an ``AcknowledgeRequest`` may carry many ids; Pub/Sub's quotas page:
https://cloud.google.com/pubsub/quotas). An acknowledgement is best effort and is not promised to be honoured
after its message's ack deadline (https://cloud.google.com/pubsub/docs/lease-management): one sent later than
``ack_deadline_s`` after its round took the message is counted (``ack_late``), as its message will most likely
come back, to be served once by the generate step's dedupe.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline.flow.pubsub_trouble import CALL_DEADLINE_S, call_retry

LOGGER = logging.getLogger(__name__)
# The most ack ids one Acknowledge call carries.
ACK_BATCH = 1000


class FeedAcks:
    """``client()`` is the feed's Pub/Sub client; ``count(name, value)`` and ``warn(cause, message, *args)`` its
    counts and its once-a-minute warnings. ``start=False``: no thread, each :meth:`submit` sends at once (the
    worker's simulator, a stopped feed)."""

    def __init__(self, subscription: str, ack_deadline_s: float, client: Callable[[], Any],
                 count: Callable[[str, int], None], warn: Callable[..., None], *, start: bool = True) -> None:
        self.subscription = subscription
        self._ack_deadline_s = ack_deadline_s
        self._client, self._count, self._warn = client, count, warn
        self._queue: collections.deque[tuple[str, float]] = collections.deque()  # (ack id, when taken)
        self._ready = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="pubsub-ack", daemon=True)
            self._thread.start()

    def submit(self, ack_ids: list[str], taken_at: float) -> None:
        """Acknowledges ``ack_ids`` (their round took them at ``taken_at``, monotonic); returns at once."""
        if not ack_ids:
            return
        with self._ready:
            if self._thread is not None and not self._stopped:
                self._queue.extend((ack_id, taken_at) for ack_id in ack_ids)
                self._ready.notify()
                return
        self._send([(ack_id, taken_at) for ack_id in ack_ids])

    def stop(self) -> None:
        """Sends what waits, then ends the thread."""
        with self._ready:
            self._stopped = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join(timeout=CALL_DEADLINE_S + 5)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._stopped:
                    self._ready.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(ACK_BATCH, len(self._queue)))]
            self._send(batch)

    def _send(self, batch: list[tuple[str, float]]) -> None:
        """One Acknowledge call; a failure is counted and logged, and Pub/Sub delivers them again after their
        deadline, where the generate step's dedupe serves each once."""
        now = time.monotonic()
        waited = now - min(taken_at for _, taken_at in batch)
        late = sum(now - taken_at > self._ack_deadline_s for _, taken_at in batch)
        if late:
            self._count("ack_late", late)
            self._warn("ack late", "%d acknowledgements of %s are sent %.0f s after their messages were taken, past "
                       "the %g s ack deadline: Pub/Sub may deliver them again (counter ack_late)", late,
                       self.subscription, waited, self._ack_deadline_s)
        ack_ids = [ack_id for ack_id, _ in batch]
        try:
            self._client().acknowledge(subscription=self.subscription, ack_ids=ack_ids, timeout=CALL_DEADLINE_S,
                                       retry=call_retry())
            self._count("acked", len(ack_ids))
        except Exception as exc:  # noqa: BLE001 - told and counted; Pub/Sub redelivers
            self._count("ack_failed", len(ack_ids))
            self._warn("ack", "Acknowledging %d messages of %s failed (%s): Pub/Sub delivers them again after "
                       "their deadline, and the job serves each request once (counter ack_failed)",
                       len(ack_ids), self.subscription, exc)
