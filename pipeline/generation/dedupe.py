"""The generate step's record of request ids: what makes one completion per request. Pure.

A request's id is held while it waits or streams, and for ``dedupe_window_s``
after it ends. The generate step's key is a hash of the id, so every copy of
an id meets the same record: a redelivered or retried message (same content,
same fingerprint) is dropped, and a different request reusing an id in use
becomes a dead letter that says so.

The record is one state cell (``seen``). Most polls neither finish a request
nor idle, so the cell is decoded only when a step needs it: :class:`IdRecord`
keeps the committed text and, once read, the ids. The key machine
(:mod:`pipeline.generation.key_machine`) changes a private copy of them within
one step and freezes it again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from pipeline.contract.state_format import StateFormatError, check_cell, write_cell

# A key remembers at most this many ended requests' ids; past it, the ones whose window ends first are forgotten
# early (a copy of one arriving after that is served again). Open ids (waiting, streaming) are never dropped.
MAX_ENDED_IDS = 10_000
# Version 1: the ids object itself (no "v"); 2: {"ids": ..., "v": 2}, so that a request id can be anything.
SEEN_VERSION = 2



class IdEntry(NamedTuple):
    """An id's entry; its cell's JSON holds it as the list ``[fingerprint, until]`` (a tuple encodes as one)."""

    fingerprint: str  # the request that holds the id
    until: float | None  # when the id is forgotten; None while the request waits or streams


Ids = dict[str, IdEntry]


@dataclass(frozen=True)
class IdRecord:
    """The ``seen`` cell: its text as committed and, once a step read it, its ids (``ids``) and whether they
    differ from the text (``changed``)."""

    text: str | None = None
    ids: Mapping[str, IdEntry] | None = None
    changed: bool = False

    def opened(self) -> tuple[Ids, str | None]:
        """A copy of the ids to change, and why the cell could not be read (it then starts afresh)."""
        if self.ids is not None:
            return dict(self.ids), None
        return read_ids(self.text)


def read_ids(text: str | None) -> tuple[Ids, str | None]:
    """The ids a cell holds, from any version this code knows, and the problem if it holds none readably. An
    unreadable cell holds no request (those are in the waiting and in-flight cells), so it is forgotten: a copy
    of one of its ids arriving within its window would be served again, once."""
    if not text:
        return {}, None
    try:
        data = json.loads(text)
        legacy = isinstance(data, dict) and not isinstance(data.get("v"), int)  # version 1: "v" can be an id
        ids = data if legacy else check_cell(data, (SEEN_VERSION,), {"ids": (dict,)})["ids"]
        for entry in ids.values():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and (entry[1] is None or isinstance(entry[1], (int, float)))):
                raise StateFormatError(f"an entry is not [fingerprint, until]: {str(entry)[:80]}")
        return {request_id: IdEntry(*entry) for request_id, entry in ids.items()}, None
    except (ValueError, TypeError, RecursionError, StateFormatError) as exc:
        return {}, f"the generate step's record of request ids cannot be read ({exc}); it starts afresh"


def holder(ids: Mapping[str, IdEntry], request_id: str, now: float) -> str | None:
    """The fingerprint of the request that holds this id now, if any."""
    entry = ids.get(request_id)
    if entry is None or (entry.until is not None and entry.until <= now):
        return None
    return entry.fingerprint


def release(ids: Ids, request_id: str, fingerprint: str, until: float, now: float) -> None:
    """The request ended: its id stays held until ``until`` (forgotten at once when that has passed)."""
    if until > now:
        ids[request_id] = IdEntry(fingerprint, until)
    else:
        ids.pop(request_id, None)


def release_orphans(ids: Ids, live: set[str], until: float, now: float) -> None:
    """Ids held open whose request is in neither bag any more (its entry could not be decoded and went to the
    dead letters) end now, as an ended request's do; ``live``: the fingerprints of the requests the key holds."""
    for request_id, entry in list(ids.items()):
        if entry.until is None and entry.fingerprint not in live:
            release(ids, request_id, entry.fingerprint, until, now)


def next_expiry(ids: Mapping[str, IdEntry], now: float) -> float | None:
    """When the next id held past ``now`` is to be forgotten (those already past go when the ids are pruned)."""
    return min((e.until for e in ids.values() if e.until is not None and e.until > now), default=None)


def prune(ids: Ids, now: float) -> bool:
    """Forgets the ids past their window, and the soonest-ending past :data:`MAX_ENDED_IDS`; whether any went."""
    expired = [i for i, e in ids.items() if e.until is not None and e.until <= now]
    if len(ids) > MAX_ENDED_IDS:
        ended = sorted((e.until, i) for i, e in ids.items() if e.until is not None and e.until > now)
        expired += [i for _, i in ended[:max(len(ended) - MAX_ENDED_IDS, 0)]]
    for request_id in expired:
        del ids[request_id]
    return bool(expired)


def encode_ids(ids: Mapping[str, IdEntry]) -> str | None:
    """The cell's text (None: cleared)."""
    return write_cell({"ids": dict(ids)}, SEEN_VERSION) if ids else None
