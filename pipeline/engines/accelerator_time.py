"""What each request cost: the model's busy time, apportioned across the requests running at each moment.

Over any interval in which ``n`` requests run on the engine's model (sent to the vLLM server and not yet ended,
or rows of the transformers engine's batch not yet finished), each is charged ``1/n`` of it: a request that ran
alone for 2 s costs 2 s, four that ran together for 2 s cost 0.5 s each, and the charges add up to the time the
model was busy. Kept as one running integral (seconds per running request), so a start or an end costs O(1)
whatever runs beside it. Pure: the caller passes a monotonic clock's readings and holds its own lock.
"""

from __future__ import annotations


class BusyShares:
    """The apportioning ledger of one engine."""

    def __init__(self) -> None:
        self._per_request = 0.0  # seconds charged so far to a request that has run since the start
        self._running: dict[str, float] = {}  # key -> _per_request when it began
        self._at: float | None = None
        self.busy_s = 0.0  # time with at least one request running

    def _advance(self, now: float) -> None:
        if self._running and self._at is not None:
            elapsed = max(now - self._at, 0.0)
            self._per_request += elapsed / len(self._running)
            self.busy_s += elapsed
        self._at = now if self._at is None else max(self._at, now)

    def begin(self, key: str, now: float) -> None:
        """``key`` runs from ``now`` (a key already running goes on, charged from its first begin)."""
        self._advance(now)
        self._running.setdefault(key, self._per_request)

    def end(self, key: str, now: float) -> float:
        """``key`` stops running at ``now``; returns the seconds charged to it since it began (0 if it was not)."""
        self._advance(now)
        began = self._running.pop(key, None)
        return 0.0 if began is None else self._per_request - began

    def running(self) -> int:
        return len(self._running)
