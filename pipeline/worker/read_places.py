"""Places a reader takes in its worker's hold before it pulls, which the admission step's requests take over.

A reader that pulls only what its worker has room for (:mod:`pipeline.flow.subscription_reader` on Dataflow,
the local runner's read in ``local/direct_runner.py``) cannot count what it pulls by request id: the id is known
only once the message is parsed, a few steps later in the same fused stage. So before it pulls, the reader
admits up to that many **place-holders** into the worker's admission ledger
(:class:`~pipeline.worker.admission_ledger.AdmissionLedger`); the ledger grants no more than its room, and the
reader pulls no more than it was granted and gives back what the pull did not fill. The places it used are
queued in this process, and count, open, until the read's bundle ends; the admission step
(:class:`~pipeline.flow.admission.AdmitFn`), which runs in the same process and bundle right after parsing,
admits each request in place of one of them, in one step under the ledger's lock, so nothing is counted twice
and no other admission takes the place in between. A place that no request takes over (its message was a dead
letter) lapses, once its bundle ended, like any request on its way (:mod:`pipeline.worker.hold`).

One queue per runtime tag, process and bundle: a fused stage runs the reader and the admission step in one
process, and the SDK harness runs each bundle on one thread of its own, so a read's places are queued under its
thread (``owner``) and only that bundle's admission step takes them; several bundles at once never take each
other's, which their own ends discard. A read whose admission runs on another thread (the local runner's,
``local/direct_runner.py``) queues without an owner, and any admission step of the process takes those.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Protocol


class Ledger(Protocol):
    """What places are taken from: the worker's runtime (through its proxy) or its admission ledger itself."""

    def admit(self, ids: list[str], in_place_of: Sequence[str] = (), bulk: bool = False) -> int: ...

    def withdraw(self, ids: list[str]) -> None: ...

    def settled(self, filled: list[str], unfilled: list[str]) -> None: ...

    def renew(self, ids: list[str]) -> list[str]: ...

    def dispatched(self, ids: list[str]) -> None: ...


# How a place-holder's name starts in the ledger; its random rest keeps it apart from any request id.
PLACE_PREFIX = "read-place:"
# A bulk read's places go on with this: the ledger counts them as the lane's work, not as room
# (:meth:`~pipeline.worker.admission_ledger.AdmissionLedger.admit`).
BULK_PLACE_PREFIX = f"{PLACE_PREFIX}bulk:"

# Each entry: a place and when it was queued (the monotonic clock). By runtime tag and owner (the bundle's thread;
# None: any), per process: the places this process's reads took and its admission step has not yet taken over.
_QUEUES: dict[tuple[str, int | None], collections.deque[tuple[str, float]]] = {}
_LOCK = threading.Lock()


def reserve(runtime: Ledger, most: int, bulk: bool = False, name: str | None = None) -> list[str]:
    """Up to ``most`` place-holders admitted into the worker's hold while it has room (none when it is full; for a
    read of the bulk lane, while it has more room than the live lane keeps and less than the lane's next wave
    waits: :meth:`~pipeline.worker.admission_ledger.AdmissionLedger.admit`).

    ``name`` names the places (``name:0``, ``name:1``, ...), so a call made again after its answer was lost (a
    runtime call past its bound may still be carried out) takes the same places, not more: an id already held
    takes no room. Unnamed, each call takes new ones."""
    if most <= 0:
        return []
    lane = BULK_PLACE_PREFIX if bulk else PLACE_PREFIX
    prefix = f"{lane}{name}:" if name is not None else None
    places = [f"{prefix}{n}" if prefix else lane + uuid.uuid4().hex for n in range(most)]
    return places[:runtime.admit(places, (), bulk)]


def renew(runtime: Ledger, places: list[str]) -> list[str]:
    """The reader still holds these places (messages not yet handed on): their open time starts again, so they do
    not lapse (``AdmissionSettings.place_open_s``). A place taken over or lapsed meanwhile stays out. Returns those
    that no longer counted."""
    return runtime.renew(places) if places else []


def settle(runtime: Ledger, tag: str, places: list[str], used: int, owner: int | None = None) -> None:
    """The pull filled ``used`` of ``places``: those are queued for the admission step to take over, and the rest
    are given back to the worker's room. The used places count, open, until they are taken over or the read's
    bundle ends (the reader then :func:`discard` s what is left, dead letters' places, and gives them back)."""
    runtime.settled(places[:used], places[used:])
    queue(tag, places[:used], owner)


def this_bundle() -> int:
    """The owner a read's places are queued under: the thread its bundle runs on."""
    return threading.get_ident()


def queue(tag: str, places: list[str], owner: int | None = None) -> None:
    """Places whose messages go down this process's stage now: the admission step of ``owner``'s bundle (None:
    any) takes them over."""
    if places:
        now = time.monotonic()
        with _LOCK:
            _QUEUES.setdefault((tag, owner), collections.deque()).extend((place, now) for place in places)


def take(tag: str, count: int, fresher_than_s: float = float("inf")) -> list[str]:
    """Up to ``count`` of the places queued for this bundle (this thread's, then those any may take), oldest first,
    for requests to be admitted in place of. Places queued longer ago than ``fresher_than_s`` are dropped, not
    taken: their messages were dead letters (nothing took them over), and in the ledger they have lapsed, or will
    once their bundle ends."""
    horizon = time.monotonic() - fresher_than_s
    taken: list[str] = []
    with _LOCK:
        for owner in (this_bundle(), None):
            queue = _QUEUES.get((tag, owner))
            while queue and len(taken) < count:
                place, queued_at = queue.popleft()
                if queued_at >= horizon:
                    taken.append(place)
    return taken


def discard(tag: str, places: list[str], owner: int | None = None) -> None:
    """The read's bundle ended: what it queued and nothing took over (dead letters) is no longer for taking."""
    left = set(places)
    with _LOCK:
        queue = _QUEUES.get((tag, owner))
        if queue and left:
            kept = collections.deque(entry for entry in queue if entry[0] not in left)
            if kept:
                _QUEUES[(tag, owner)] = kept
            else:
                del _QUEUES[(tag, owner)]
