"""The generate step's record of request ids: what makes one completion per request.

A request's id is held while it waits or streams, and for ``dedupe_window_s``
after it ends. The generate step's key is a hash of the id, so every copy of
an id meets the same record: a redelivered or retried message (same content,
same fingerprint) is dropped, and a different request reusing an id in use
becomes a dead letter that says so.
"""

from __future__ import annotations

import json
import time
from typing import Any


class SeenIds:
    """The ``seen`` state: id -> [fingerprint, forget-after time, or None while the request is open].

    Read on first use only: most polls neither finish a request nor idle, and
    then the state is neither decoded nor written.
    """

    def __init__(self, state: Any) -> None:
        self._state = state
        self._ids: dict[str, list] | None = None
        self.changed = False

    @property
    def ids(self) -> dict[str, list]:
        if self._ids is None:
            self._ids = json.loads(self._state.read() or "{}")
        return self._ids

    def holder(self, request_id: str, now: float) -> str | None:
        """The fingerprint of the request that holds this id now, if any."""
        entry = self.ids.get(request_id)
        if entry is None or (entry[1] is not None and entry[1] <= now):
            return None
        return entry[0]

    def hold(self, request_id: str, fingerprint: str, until: float | None = None) -> None:
        self.ids[request_id] = [fingerprint, until]
        self.changed = True

    def release(self, request_id: str, fingerprint: str, until: float) -> None:
        if until > time.time():
            self.hold(request_id, fingerprint, until)
        elif self.ids.pop(request_id, None) is not None:
            self.changed = True

    def next_expiry(self) -> float | None:
        return min((until for _, until in self.ids.values() if until is not None), default=None)

    def save(self, now: float, *, prune: bool = False) -> None:
        """Writes the ids back if they changed, forgetting those past their window (``prune``: read them first)."""
        if self._ids is None and not prune:
            return  # never read, so nothing changed
        expired = [i for i, (_, until) in self.ids.items() if until is not None and until <= now]
        for request_id in expired:
            del self.ids[request_id]
        if self.changed or expired:
            if self.ids:
                self._state.write(json.dumps(self.ids, separators=(",", ":")))
            else:
                self._state.clear()
