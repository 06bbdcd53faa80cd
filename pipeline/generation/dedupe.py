"""The generate step's record of request ids: what makes one completion per request.

A request's id is held while it waits or streams, and for ``dedupe_window_s``
after it ends. The generate step's key is a hash of the id, so every copy of
an id meets the same record: a redelivered or retried message (same content,
same fingerprint) is dropped, and a different request reusing an id in use
becomes a dead letter that says so.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from apache_beam.metrics import Metrics

from pipeline.contract.state_format import StateFormatError, check_cell, write_cell

LOGGER = logging.getLogger(__name__)
# A key remembers at most this many ended requests' ids; past it, the ones whose window ends first are forgotten
# early (a copy of one arriving after that is served again). Open ids (waiting, streaming) are never dropped.
MAX_ENDED_IDS = 10_000
# Version 1: the ids object itself (no "v"); 2: {"ids": ..., "v": 2}, so that a request id can be anything.
SEEN_VERSION = 2


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
            self._ids = _read(self._state.read())
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

    def release_orphans(self, live: set[str], until: float) -> None:
        """Ids held open whose request is in neither bag any more (its entry could not be decoded and went to the
        dead letters) end now, as an ended request's do; ``live``: the fingerprints of the requests the key holds."""
        for request_id, (fingerprint, held_until) in list(self.ids.items()):
            if held_until is None and fingerprint not in live:
                self.release(request_id, fingerprint, until)

    def next_expiry(self) -> float | None:
        return min((until for _, until in self.ids.values() if until is not None), default=None)

    def save(self, now: float, *, prune: bool = False) -> None:
        """Writes the ids back if they changed, forgetting those past their window (``prune``: read them first)."""
        if self._ids is None and not prune:
            return  # never read, so nothing changed
        expired = [i for i, (_, until) in self.ids.items() if until is not None and until <= now]
        if len(self.ids) > MAX_ENDED_IDS:
            ended = sorted((until, i) for i, (_, until) in self.ids.items() if until is not None and until > now)
            expired += [i for _, i in ended[:max(len(ended) - MAX_ENDED_IDS, 0)]]
        for request_id in expired:
            del self.ids[request_id]
        if self.changed or expired:
            if self.ids:
                self._state.write(write_cell({"ids": self.ids}, SEEN_VERSION))
            else:
                self._state.clear()


def _read(text: str | None) -> dict[str, list]:
    """The ids a cell holds, from any version this code knows. An unreadable cell holds no request (those are
    in the waiting and in-flight cells), so it is logged and forgotten: a copy of one of its ids arriving
    within its window would be served again, once."""
    if not text:
        return {}
    try:
        data = json.loads(text)
        legacy = isinstance(data, dict) and not isinstance(data.get("v"), int)  # version 1: "v" can be an id
        ids = data if legacy else check_cell(data, (SEEN_VERSION,), {"ids": (dict,)})["ids"]
        for entry in ids.values():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and (entry[1] is None or isinstance(entry[1], (int, float)))):
                raise StateFormatError(f"an entry is not [fingerprint, until]: {str(entry)[:80]}")
        return ids
    except (json.JSONDecodeError, TypeError, StateFormatError) as exc:
        Metrics.counter("streaming_generate", "undecodable_state_entries").inc()
        LOGGER.error("The generate step's record of request ids cannot be read (%s); it starts afresh", exc)
        return {}
